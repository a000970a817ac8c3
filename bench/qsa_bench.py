"""A qwen4_exp decode step at a long context, this tree against a git revision
(docs/qwen4_exp.md, "Caches"): tiny random trunk, `--context` tokens
prefilled, then single-token steps of mlx_lm's plain decoding (KVCache path),
the two models' steps alternated; prints the median per step.

    python bench/qsa_bench.py --before 755792d --context 4096 --ratio 8
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import mlx_mtp.families as families
from mlx_mtp.models import qwen4_exp
from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint


def module_at(rev: str):
    """qwen4_exp.py as it was at `rev`, imported beside this tree's."""
    src = subprocess.run(["git", "show", f"{rev}:mlx_mtp/families/qwen4_exp.py"],
                         capture_output=True, text=True, check=True).stdout
    f = Path(tempfile.mkdtemp()) / "qwen4_exp_before.py"
    f.write_text(src)
    name = families.__name__ + ".qwen4_exp_before"
    spec = importlib.util.spec_from_file_location(name, f)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def build(mod, path):
    import json
    config = json.loads((path / "config.json").read_text())
    m = mod.Model(mod.ModelArgs.from_dict(config))
    w = mx.load(str(path / "model.safetensors"))
    m.load_weights(list(m.sanitize(w).items()), strict=True)
    mx.eval(m.parameters())
    return m


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--before", default="HEAD")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--ratio", type=int, default=8)
    p.add_argument("--index-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    path = write_qwen4_exp_checkpoint(tempfile.mkdtemp(), text_overrides=dict(
        indexer_compress_ratio=a.ratio, indexer_budget=8 * a.ratio, indexer_head_dim=a.index_dim,
        max_position_embeddings=2 * a.context))
    models = {"before": build(module_at(a.before), path), "after": build(qwen4_exp, path)}
    prompt = mx.random.randint(0, 258, (1, a.context), key=mx.random.key(0))
    caches = {}
    for name, m in models.items():
        caches[name] = m.make_cache()
        for i in range(0, a.context, 512):
            mx.eval(m(prompt[:, i:i + 512], caches[name]))
    times = {name: [] for name in models}
    tok = mx.array([[7]])
    for _ in range(a.rounds):
        for name, m in models.items():
            mx.eval(m(tok, caches[name]))  # warm
            for _ in range(a.steps):
                t = time.perf_counter()
                mx.eval(m(tok, caches[name]))
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name:6s} median {1e3 * statistics.median(ts):.3f} ms/step over {len(ts)} steps "
              f"(context {a.context}, ratio {a.ratio}, indexer dim {a.index_dim})")


if __name__ == "__main__":
    main()
