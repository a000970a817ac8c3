"""mlx_mtp.convert --graft: add the MTP head to an existing MLX conversion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_mtp.convert import ConvertError, convert, graft
from mlx_mtp.convert.__main__ import main as cli
from mlx_mtp.testing.synthetic import write_checkpoint

SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
          "model-00003-of-00003.safetensors"]


def reshard_with_head_apart(single: Path, dst: Path) -> Path:
    """Copy an HF checkpoint as 3 shards: trunk in 1-2, every mtp.* in 3 (as released)."""
    dst.mkdir(parents=True)
    tensors = {}
    for f in sorted(single.glob("model*.safetensors")):
        tensors.update(mx.load(str(f)))
    trunk = sorted(k for k in tensors if not k.startswith("mtp."))
    parts = [trunk[: len(trunk) // 2], trunk[len(trunk) // 2:], sorted(k for k in tensors if k.startswith("mtp."))]
    weight_map = {}
    for name, keys in zip(SHARDS, parts):
        mx.save_safetensors(str(dst / name), {k: tensors[k] for k in keys}, metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in single.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    return dst


def make_unreadable(folder: Path, names):
    """Replace shards by garbage: any read of them (header or data) fails."""
    for n in names:
        (folder / n).write_bytes(b"\xff" * 64)


def plain_mlx_lm_convert(src: Path, dst: Path, **kw) -> Path:
    from mlx_lm.convert import convert as lm_convert

    lm_convert(str(src), str(dst), **kw)
    return dst


def snapshot(path: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
            for p in sorted(Path(path).iterdir())}


def raw(path: Path) -> dict:
    out = {}
    for f in sorted(Path(path).glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    base = tmp_path_factory.mktemp("graft")
    single = write_checkpoint(base / "single", seed=5)
    sharded = reshard_with_head_apart(single, base / "sharded")
    return single, sharded


@pytest.fixture
def q4(src, tmp_path):
    """An 'mlx-community' style 4-bit conversion by plain mlx_lm (no head)."""
    return plain_mlx_lm_convert(src[0], tmp_path / "mlx-q4", quantize=True, q_bits=4)


def test_plain_mlx_lm_conversion_loads_without_head(q4, capsys):
    import mlx_mtp

    model, _ = mlx_mtp.load(q4)
    assert not model.has_mtp
    assert "--graft" in capsys.readouterr().err


def test_graft_reads_only_the_mtp_shard(src, q4, tmp_path, capsys):
    import mlx_lm

    import mlx_mtp

    sharded = tmp_path / "sharded"
    shutil.copytree(src[1], sharded)
    make_unreadable(sharded, SHARDS[:2])  # trunk shards: reading them would fail
    trunk_files = snapshot(q4)
    s = graft(q4, sharded, mtp_bits=8)
    assert s["source_shards_read"] == [SHARDS[2]]
    after = snapshot(q4)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert after[name] == trunk_files[name], f"{name} was touched"
    assert "model-mtp.safetensors" in after
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    cfg = json.loads((q4 / "config.json").read_text())
    assert cfg["mlx_mtp"]["mtp_bits"] == 8 and cfg["quantization"]["bits"] == 4
    assert cfg["quantization"]["mtp.fc"]["bits"] == 8
    index = json.loads((q4 / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["mtp.fc.weight"] == "model-mtp.safetensors"
    model, _ = mlx_mtp.load(q4, quiet=True)
    assert model.has_mtp and isinstance(model.mtp.fc, nn.QuantizedLinear) and model.mtp.fc.bits == 8
    mlx_lm.load(str(q4))  # strict plain load still fine

    # The grafted head equals the head of a direct HF -> q4 conversion with an 8-bit head
    direct = tmp_path / "direct"
    convert(src[0], direct, quantize=True, q_bits=4, mtp_bits=8)
    a, b = raw(q4), raw(direct)
    heads = sorted(k for k in b if k.startswith("mtp."))
    assert heads == sorted(k for k in a if k.startswith("mtp."))
    for k in heads:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]), k

    # a second graft needs --force, and then replaces only the head file
    with pytest.raises(ConvertError, match="already has an MTP head"):
        graft(q4, src[1])
    before = snapshot(q4)
    graft(q4, src[1], mtp_bits=16, force=True)
    after = snapshot(q4)
    assert after["model.safetensors"] == before["model.safetensors"]
    model, _ = mlx_mtp.load(q4, quiet=True)
    assert type(model.mtp.fc) is nn.Linear
    cfg = json.loads((q4 / "config.json").read_text())
    assert not [k for k in cfg["quantization"] if k.startswith("mtp.")]


def test_graft_from_hub_downloads_only_needed_files(src, q4, monkeypatch):
    import huggingface_hub

    asked = []

    def fake_hf_hub_download(repo_id, filename, revision=None, **kw):
        asked.append(filename)
        return str(src[1] / filename)

    def no_snapshot(*a, **k):
        raise AssertionError("graft must not snapshot the whole repository")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_snapshot)
    graft(q4, "Qwen/Qwen3.6-Tiny")
    assert sorted(asked) == sorted(["config.json", "model.safetensors.index.json", SHARDS[2]])
    cfg = json.loads((q4 / "config.json").read_text())
    assert cfg["mlx_mtp"]["mtp_bits"] == 8  # default with a quantized trunk
    assert cfg["mlx_mtp"]["grafted_from"] == "Qwen/Qwen3.6-Tiny"


def test_graft_into_float_conversion_keeps_dtype(src, tmp_path):
    import mlx_mtp

    target = plain_mlx_lm_convert(src[0], tmp_path / "bf16", dtype="bfloat16")
    graft(target, src[1])  # unquantized trunk: head at 16 bits by default
    heads = {k: v for k, v in raw(target).items() if k.startswith("mtp.")}
    assert heads and all(v.dtype == mx.bfloat16 for v in heads.values())
    cfg = json.loads((target / "config.json").read_text())
    assert "quantization" not in cfg and cfg["mlx_mtp"]["mtp_bits"] == 16
    # same tensors as converting the HF checkpoint with mlx_mtp directly
    direct = tmp_path / "direct"
    convert(src[0], direct, dtype="bfloat16")
    ref = raw(direct)
    for k, v in heads.items():
        assert mx.array_equal(v, ref[k]), k
    model, _ = mlx_mtp.load(target, quiet=True)
    assert model.has_mtp


def test_graft_refuses_source_without_head(tmp_path, q4, capsys):
    nohead = write_checkpoint(tmp_path / "nohead", seed=5, mtp=False)
    before = snapshot(q4)
    rc = cli(["--graft", str(q4), "--hf-path", str(nohead)])
    err = capsys.readouterr().err
    assert rc == 1 and "no mtp.* tensors" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert snapshot(q4) == before


def test_graft_refuses_mismatched_trunk(tmp_path, q4, capsys):
    other = write_checkpoint(tmp_path / "other", seed=5, text_overrides={"num_hidden_layers": 8})
    before = snapshot(q4)
    rc = cli(["--graft", str(q4), "--hf-path", str(other)])
    err = capsys.readouterr().err
    assert rc == 1 and "trunk mismatch: num_hidden_layers" in err
    moe = write_checkpoint(tmp_path / "moe", seed=5, moe=True)
    assert cli(["--graft", str(q4), "--hf-path", str(moe)]) == 1
    assert "trunk mismatch: model_type" in capsys.readouterr().err
    assert snapshot(q4) == before


def test_graft_corrupt_head_shard_names_the_file(src, tmp_path, q4, capsys):
    sharded = tmp_path / "sharded"
    shutil.copytree(src[1], sharded)
    f = sharded / SHARDS[2]
    f.write_bytes(f.read_bytes()[:-64])
    before = snapshot(q4)
    assert cli(["--graft", str(q4), "--hf-path", str(sharded)]) == 1
    err = capsys.readouterr().err
    assert SHARDS[2] in err and "truncated" in err and "Traceback" not in err
    assert snapshot(q4) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_graft_refuses_hf_layout_target(src, tmp_path):
    with pytest.raises(ConvertError, match="Hugging Face layout"):
        graft(src[0], src[1])


def test_graft_from_mlx_source_does_not_shift_twice(src, q4, tmp_path):
    """The head can come from an mlx_mtp conversion (norms already shifted)."""
    mlx_src = tmp_path / "mlx_fp32"
    convert(src[0], mlx_src)
    s = graft(q4, mlx_src, mtp_bits=16)
    assert "already" in s["norms"]
    direct = tmp_path / "direct"
    convert(src[0], direct)
    a, b = raw(q4), raw(direct)
    for k in (k for k in b if k.startswith("mtp.")):
        assert mx.array_equal(a[k], b[k]), k


def test_graft_refuses_if_the_target_changed_meanwhile(src, q4, tmp_path, monkeypatch, capsys):
    """The swap drops the old folder: a file added to it during the graft would be lost."""
    from mlx_mtp.convert import interrupts

    def meddle(point):
        if point == "before-publish":
            (q4 / "notes.txt").write_text("mine")

    monkeypatch.setattr(interrupts, "pause_point", meddle)
    assert cli(["--graft", str(q4), "--hf-path", str(src[1])]) == 1
    err = capsys.readouterr().err
    assert "changed while grafting (notes.txt)" in err and "Traceback" not in err
    assert (q4 / "notes.txt").read_text() == "mine" and not (q4 / "model-mtp.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_graft_signal_during_the_swap_check_changes_nothing(src, q4, tmp_path, monkeypatch, capsys):
    import importlib
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    mod = importlib.import_module("mlx_mtp.convert.graft")
    real = mod._check_unchanged

    def signal_then_check(target, state):
        os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised: signals are held off in publish
        return real(target, state)

    monkeypatch.setattr(mod, "_check_unchanged", signal_then_check)
    before = snapshot(q4)
    assert cli(["--graft", str(q4), "--hf-path", str(src[1])]) == 130
    err = capsys.readouterr().err
    assert "interrupted by SIGINT" in err and "Traceback" not in err
    assert snapshot(q4) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
