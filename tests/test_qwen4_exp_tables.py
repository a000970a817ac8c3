"""`qwen4_exp`'s n-gram tables read from disk (mlx_mtp/ngram_tables.py):
the lookup equals the in-memory table's bit for bit (fp32, bfloat16, a 4-bit
conversion; rows kept per tensor-parallel rank), and greedy MTP decoding with
the tables on disk gives plain in-memory decoding's tokens at depths 1-3 and
auto, rows of a batch included. The memory and speed at scale (a table of
>= 2 GB) are bench/ngram_tables.py's. See docs/qwen4_exp.md."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from util import mtp, reference

import mlx_mtp
from mlx_mtp.convert import convert
from mlx_mtp.depth import DepthController
from mlx_mtp.ngram_tables import DiskRows, choose
from mlx_mtp.testing.drafters import OracleDrafter
from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint

PROMPT = [3, 17, 99, 42, 7, 7, 150, 258, 12, 64, 88, 5, 9, 200, 31, 1]
BATCH = [PROMPT, [5, 6, 258, 77, 12, 140], [258, 1, 2, 3]]
N = 16
OVERRIDES = {"hidden_size": 64, "ple_embed_dim": 256}  # n-gram rows 64 wide: group-64 quantization


def _tables(model):
    return [l.ple.ple_embedding.ngram_embedding for l in model.language_model.model.layers if l.has_ple]


def _all_rows(table):
    return mx.arange(table.total_rows, dtype=mx.int32).reshape(1, -1, 4) if table.total_rows % 4 == 0 \
        else mx.arange(table.total_rows, dtype=mx.int32)[None, :, None]


def _lookups_equal(mem, disk):
    """Every row of every table, looked up on disk and in memory: bit for bit."""
    for a, b in zip(_tables(mem), _tables(disk)):
        assert isinstance(b, DiskRows) and not isinstance(a, DiskRows)
        ids = _all_rows(a)
        x, y = a(ids), b(ids)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert mx.array_equal(x, y).item()


def _greedy_equal(mem, disk, depths=(1, 2, 3, "auto")):
    want = reference(mem, PROMPT, N)
    for k in depths:
        ctl = DepthController() if k == "auto" else None
        drafter = OracleDrafter(want, 0.7, disk.vocab_size, seed=1)  # partial acceptance
        assert mtp(disk, PROMPT, k, N, drafter=drafter, controller=ctl) == want, k
        assert mtp(disk, PROMPT, k, N) == want, k  # the head's own drafts


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    path = write_qwen4_exp_checkpoint(tmp_path_factory.mktemp("q4x_tables"))
    mem, tok = mlx_mtp.load(path, quiet=True, ngram_tables="memory")
    disk, _ = mlx_mtp.load(path, quiet=True, ngram_tables="disk")
    return path, mem, disk, tok


def test_fp32_tables_on_disk_decode_as_in_memory(fp32, capsys):
    """The tables on disk hold no arrays (nothing of them is a parameter);
    lookups and greedy MTP (depths 3 and auto here, 1 and 2 in the slow tier;
    oracle and head drafts) equal the in-memory model's plain decoding; rows
    of a batch too."""
    path, mem, disk, tok = fp32
    assert not any("ngram_embedding" in k for k, _ in tree_flatten(disk.parameters()))
    assert disk.host_lookups and not mem.host_lookups
    _lookups_equal(mem, disk)
    _greedy_equal(mem, disk, depths=(3, "auto"))
    want = [reference(mem, p, N) for p in BATCH]
    out = mlx_mtp.batch_generate(disk, tok, BATCH, max_tokens=N, draft_tokens=2, return_token_ids=True)
    assert out.token_ids == want


@pytest.mark.slow
def test_fp32_tables_on_disk_decode_as_in_memory_at_depths_1_and_2(fp32):
    _greedy_equal(fp32[1], fp32[2], depths=(1, 2))


def test_4bit_conversion_tables_on_disk(tmp_path):
    """A `-q` conversion (the tables 4-bit, group 64): the packed rows, scales
    and biases gathered from the files and dequantized equal
    `nn.QuantizedEmbedding`'s lookup bit for bit, and greedy MTP equals plain."""
    hf = write_qwen4_exp_checkpoint(tmp_path / "hf", seed=3, text_overrides=OVERRIDES)
    convert(hf, tmp_path / "q4", quantize=True, q_bits=4)
    mem, _ = mlx_mtp.load(tmp_path / "q4", quiet=True, ngram_tables="memory")
    disk, _ = mlx_mtp.load(tmp_path / "q4", quiet=True, ngram_tables="disk")
    table = _tables(mem)[0]
    assert isinstance(table[table.pieces()[0][0]], nn.QuantizedEmbedding)
    _lookups_equal(mem, disk)
    _greedy_equal(mem, disk, depths=(2, "auto"))


def test_bf16_tables_on_disk(tmp_path):
    """bfloat16 rows (read as their raw bits, viewed as bfloat16 in MLX) equal
    the in-memory lookup bit for bit."""
    path = write_qwen4_exp_checkpoint(tmp_path, dtype="bfloat16")
    mem, _ = mlx_mtp.load(path, quiet=True, ngram_tables="memory")
    disk, _ = mlx_mtp.load(path, quiet=True, ngram_tables="disk")
    assert _tables(mem)[0][_tables(mem)[0].pieces()[0][0]].weight.dtype == mx.bfloat16
    _lookups_equal(mem, disk)


def test_rows_kept_per_rank_read_as_in_memory(fp32):
    """Tensor parallel keeps rows [r*R/N, (r+1)*R/N) per rank: on disk as in
    memory, the rows not kept read as zeros, and the ranks' lookups sum to
    the whole table's."""
    path, _, disk, _ = fp32
    for ranks in (2, 3):
        total = None
        for r in range(ranks):
            mem, _ = mlx_mtp.load(path, quiet=True, ngram_tables="memory")
            one, _ = mlx_mtp.load(path, quiet=True, ngram_tables="disk")
            a, b = _tables(mem)[0], _tables(one)[0]
            R = a.total_rows
            a.keep_rows(r * R // ranks, (r + 1) * R // ranks)
            b.keep_rows(r * R // ranks, (r + 1) * R // ranks)
            ids = _all_rows(a)
            assert mx.array_equal(a(ids), b(ids)).item(), (ranks, r)
            total = b(ids) if total is None else total + b(ids)
        assert mx.array_equal(total, _tables(disk)[0](_all_rows(a))).item()


def test_auto_follows_the_machines_memory(fp32, capsys):
    """'auto' keeps the tables in memory while the checkpoint takes at most
    60% of the machine's memory, reads them from disk beyond; the loader
    says which in one line; a bad mode is refused naming the choices."""
    gb = 10**9
    assert choose("auto", 30 * gb, memory=64 * gb) == "memory"
    assert choose("auto", 30 * gb, memory=32 * gb) == "disk"
    assert choose("memory", 30 * gb, memory=8 * gb) == "memory"
    with pytest.raises(ValueError, match="auto, disk, memory"):
        choose("ram", 1)
    path = fp32[0]
    model, _ = mlx_mtp.load(path)
    assert not model.host_lookups  # a tiny checkpoint fits any machine
    said = [l for l in capsys.readouterr().err.splitlines() if "n-gram tables" in l]
    assert len(said) == 1 and "in memory (auto:" in said[0], said
    with pytest.raises(ValueError, match="ngram_tables must be one of"):
        mlx_mtp.load(path, ngram_tables="ram")


def test_pipeline_refuses_tables_on_disk(fp32):
    """A pipeline's stages hung with the tables on disk (docs/distributed.md):
    `sharded_load` refuses them in one line, before loading anything."""
    from types import SimpleNamespace

    from mlx_mtp.distributed import sharded_load

    two = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    with pytest.raises(ValueError, match="not supported with pipeline parallelism"):
        sharded_load(fp32[0], pipeline_group=two, ngram_tables="disk")


def test_generate_cli_ngram_tables(fp32, capsys):
    """`--ngram-tables disk` on the command line: the tables are read from
    disk (the loader's line says so) and the text is the in-memory run's."""
    from mlx_mtp.cli import main

    argv = ["--model", str(fp32[0]), "--prompt", "abc", "--max-tokens", "6", "--draft-tokens", "2"]
    texts = {}
    for mode in ("disk", "memory"):
        assert main(argv + ["--ngram-tables", mode]) == 0
        out = capsys.readouterr()
        said = [l for l in out.err.splitlines() if "n-gram tables" in l]
        assert len(said) == 1 and (("read from disk" in said[0]) == (mode == "disk")), said
        texts[mode] = out.out
    assert texts["disk"] == texts["memory"] and texts["disk"].strip()
