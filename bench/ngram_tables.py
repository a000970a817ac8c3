"""qwen4_exp's n-gram tables on disk against in memory, at scale
(docs/qwen4_exp.md, "N-gram tables on disk"): a random checkpoint whose
tables take `--table-gb` (default 2.2 GB, float32, in row shards of their
own files) beside a small trunk, written to a temp folder and removed after.

1. resident memory (psutil RSS) before loading, after loading with the
   tables on disk, and after decoding: the growth against the trunk's bytes;
2. greedy MTP decoding (depth 2), the tables on disk and in memory, runs
   alternated: tokens equal, median speed of each and the ratio. The
   in-memory model also runs uncompiled, and uncompiled without lookahead
   (each cycle read before the next is built), which shows what the disk
   path's uncompiled graphs and its host reads (the host waits for the ids,
   so it cannot build a cycle while the last one runs) cost apart from the
   lookups themselves.

    python bench/ngram_tables.py [--table-gb 2.2] [--tokens 64] [--repeats 5] [--hidden 64]
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from safetensors.numpy import load_file, save_file

import mlx.core as mx
import mlx_mtp
from mlx_mtp.models.qwen4_exp import TextModelArgs, chunk_rows, ngram_head_sizes, table_tensor
from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint

PROMPT = [3, 17, 99, 42, 7, 7, 150, 258, 12, 64, 88, 5, 9, 200, 31, 1]
# a trunk of some tens of MB: 64-wide n-gram rows, a wider vocabulary, more experts
TRUNK = {"hidden_size": 64, "ple_embed_dim": 256, "vocab_size": 32768, "num_experts": 32,
         "moe_intermediate_size": 256, "split_ngram_parts": 16}


def rss() -> int:
    return psutil.Process().memory_info().rss


def file_backed() -> int:
    """Resident pages mapped from files (Linux: psutil's `shared`; 0 elsewhere):
    clean, dropped by the kernel under memory pressure."""
    return getattr(psutil.Process().memory_info(), "shared", 0)


def evict(file: Path):
    """Drop a file's pages from the page cache (Linux), so that the tables are
    read cold, as a checkpoint larger than memory is: a page still cached when
    written may be mapped as a large folio of many pages at the first touch."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def write(path: Path, table_gb: float, hidden: int = 64) -> dict:
    """The tiny checkpoint, then its tables replaced by ones of `table_gb`
    (ngram_vocab_size_base raised to fit), one safetensors file per shard,
    written a shard at a time. Returns the bytes of trunk and tables."""
    overrides = dict(TRUNK, hidden_size=hidden, ple_embed_dim=4 * hidden)  # rows `hidden` wide
    path = write_qwen4_exp_checkpoint(path, seed=1, text_overrides=overrides)
    config = json.loads((path / "config.json").read_text())
    tc = config["text_config"]
    layers, heads = len(tc["ple_layer_ids"]), (tc["ngram_size"] - 1) * tc["heads_per_ngram"]
    dims = tc["ple_embed_dim"] // heads
    tc["ngram_vocab_size_base"] = int(table_gb * 1e9 / layers / heads / dims / 4)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    trunk = {k: v for k, v in load_file(path / "model.safetensors").items() if table_tensor(k) is None}
    save_file(trunk, path / "model.safetensors", metadata={"format": "pt"})
    weight_map = {k: "model.safetensors" for k in trunk}
    weight_map.update(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
                      if (path / "model.safetensors.index.json").exists() else {})
    weight_map = {k: f for k, f in weight_map.items() if table_tensor(k) is None}
    args = TextModelArgs.from_dict(tc)
    rng, table_bytes = np.random.default_rng(0), 0
    for j, layer in enumerate(tc["ple_layer_ids"]):
        div = tc["make_ngram_vocab_size_divisible_by"]
        rows = -(-sum(ngram_head_sizes(args, j)) // div) * div
        for s, n in enumerate(chunk_rows(rows, tc["split_ngram_parts"])):
            name = f"model.language_model.layers.{layer - 1}.ple.ple_embedding.ngram_embedding.shard_{s}.weight"
            fname = f"model-ngram-{layer - 1}-{s:03d}.safetensors"
            shard = rng.standard_normal((n, dims), dtype=np.float32)
            save_file({name: shard}, path / fname, metadata={"format": "pt"})
            evict(path / fname)
            table_bytes += shard.nbytes
            weight_map[name] = fname
            del shard
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    trunk_bytes = sum(v.nbytes for v in trunk.values())
    return {"trunk": trunk_bytes, "tables": table_bytes}


def decode(model, n, compiled=True, lookahead=True):
    t = time.perf_counter()
    out = [tok for tok, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=n,
                                                     draft_tokens=2, compiled=compiled,
                                                     lookahead=lookahead)]
    return out, time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table-gb", type=float, default=2.2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=64, help="the trunk's hidden size (64: a ~50 MB trunk)")
    p.add_argument("--write-only", type=Path, help=argparse.SUPPRESS)  # (the child that writes)
    a = p.parse_args()
    if a.write_only:
        print(json.dumps(write(a.write_only, a.table_gb, a.hidden)))
        return
    root = Path(tempfile.mkdtemp(prefix="ngram_tables_"))
    try:
        t = time.perf_counter()
        # written by a child process, so that none of its buffers stay in this one's RSS
        sizes = json.loads(subprocess.run(
            [sys.executable, __file__, "--write-only", str(root / "ckpt"), "--table-gb", str(a.table_gb),
             "--hidden", str(a.hidden)],
            check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        print(f"wrote {sizes['tables'] / 1e9:.2f} GB of n-gram tables and a "
              f"{sizes['trunk'] / 1e6:.1f} MB trunk (head included) in {time.perf_counter() - t:.0f} s")
        gc.collect()
        before, before_files = rss(), file_backed()
        disk, _ = mlx_mtp.load(root / "ckpt", ngram_tables="disk")
        loaded = rss()
        tokens, _ = decode(disk, a.tokens)
        decoded, files = rss(), file_backed() - before_files
        grow = decoded - before
        print(f"RSS: {before / 1e6:.0f} MB before loading, {loaded / 1e6:.0f} MB loaded (tables on disk), "
              f"{decoded / 1e6:.0f} MB after {a.tokens} tokens: grew {grow / 1e6:.1f} MB, of which "
              f"{files / 1e6:.1f} MB file-backed pages (the mapped files' pages touched); without "
              f"them {(grow - files) / 1e6:.1f} MB. The trunk is {sizes['trunk'] / 1e6:.1f} MB (+20%: "
              f"{1.2 * sizes['trunk'] / 1e6:.1f} MB), the tables {sizes['tables'] / 1e9:.2f} GB")
        mem, _ = mlx_mtp.load(root / "ckpt", ngram_tables="memory")
        print(f"RSS with the in-memory model loaded too: {rss() / 1e6:.0f} MB")
        want, _ = decode(mem, a.tokens)
        assert tokens == want, "tables on disk decoded other tokens"
        decode(mem, a.tokens, compiled=False)  # warm both paths (compiles, first runs)
        decode(disk, a.tokens)
        runs = (("disk", disk, True, True), ("memory", mem, True, True),
                ("memory, uncompiled", mem, False, True),
                ("memory, uncompiled, no lookahead", mem, False, False))
        times = {name: [] for name, *_ in runs}
        for _ in range(a.repeats):  # alternated, so that the machine's load hits all alike
            for name, model, compiled, lookahead in runs:
                out, s = decode(model, a.tokens, compiled, lookahead)
                assert out == want
                times[name].append(s)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"{k:>32}: {a.tokens / v:7.1f} tok/s (median of {a.repeats}, {a.tokens} tokens)")
        print(f"speed disk / memory: {med['memory'] / med['disk']:.2f}x; disk / memory uncompiled: "
              f"{med['memory, uncompiled'] / med['disk']:.2f}x; disk / memory uncompiled without "
              f"lookahead: {med['memory, uncompiled, no lookahead'] / med['disk']:.2f}x; tokens equal: yes")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
