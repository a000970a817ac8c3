"""mlx_mtp.convert: conversion, head precision, norms, compatibility, safety."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_mtp.convert import ConvertError, convert
from mlx_mtp.convert.__main__ import main as cli
from mlx_mtp.testing.synthetic import write_checkpoint


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Dense HF-layout checkpoint, fp32 on disk, no torch_dtype (stays fp32)."""
    return write_checkpoint(tmp_path_factory.mktemp("src") / "hf", seed=1)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("src") / "hf_moe", moe=True, seed=2)


def raw(path: Path) -> dict:
    out = {}
    for f in sorted(Path(path).glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def cfg(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def snapshot(path: Path) -> dict:
    """name -> (size, mtime_ns, inode) of every file; to prove a folder untouched."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
            for p in sorted(Path(path).iterdir())}


def no_leftovers(parent: Path):
    left = [p.name for p in Path(parent).iterdir() if p.name.startswith(".")]
    assert not left, f"staging folders left behind: {left}"


# -- conversion -----------------------------------------------------------------
def test_convert_bf16_keeps_head_and_shifts_norms_once(hf, tmp_path):
    out = tmp_path / "bf16"
    s = convert(hf, out, dtype="bfloat16")
    assert s["head_tensors"] > 0 and s["trunk"] == "bfloat16" and s["head"] == "bfloat16"
    src, dst = raw(hf), raw(out)
    # zero-centred norms: trunk and head shifted by exactly +1; the GDN gated norm not
    for hf_name, mlx_name in [
        ("mtp.norm.weight", "mtp.norm.weight"),
        ("mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_hidden.weight"),
        ("mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.q_norm.weight"),
        ("mtp.layers.0.input_layernorm.weight", "mtp.layers.0.input_layernorm.weight"),
        ("model.language_model.norm.weight", "language_model.model.norm.weight"),
        ("model.language_model.layers.0.input_layernorm.weight",
         "language_model.model.layers.0.input_layernorm.weight"),
    ]:
        want = (src[hf_name] + 1.0).astype(mx.bfloat16)
        assert dst[mlx_name].dtype == mx.bfloat16
        assert mx.array_equal(dst[mlx_name], want), mlx_name
    gated = "layers.0.linear_attn.norm.weight"
    assert mx.array_equal(dst[f"language_model.model.{gated}"],
                          src[f"model.language_model.{gated}"].astype(mx.bfloat16))
    assert dst["language_model.model.layers.0.linear_attn.A_log"].dtype == mx.float32
    assert not any(k.startswith("model.visual") for k in dst)
    c = cfg(out)
    assert "quantization" not in c
    assert c["mlx_mtp"]["mtp_bits"] == 16 and c["mlx_mtp"]["mtp"] is True
    index = json.loads((out / "model.safetensors.index.json").read_text())
    head_shards = {v for k, v in index["weight_map"].items() if k.startswith("mtp.")}
    trunk_shards = {v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    assert len(head_shards) == 1 and not head_shards & trunk_shards  # head in its own shard
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (hf / f).read_bytes()
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)
    no_leftovers(tmp_path)


def _check_quantized(out: Path, trunk_bits, head_bits):
    import mlx_lm

    import mlx_mtp

    c = cfg(out)
    if trunk_bits:
        assert c["quantization"]["bits"] == trunk_bits
        assert c["quantization_config"] == c["quantization"]
    overrides = {k: v for k, v in c.get("quantization", {}).items() if k.startswith("mtp.")}
    if head_bits == 16:
        assert not overrides
    else:
        assert overrides and all(v["bits"] == head_bits for k, v in overrides.items()
                                 if not k.endswith(("mlp.gate", "shared_expert_gate")))
    assert c["mlx_mtp"]["mtp_bits"] == head_bits
    # mlx_mtp.load: the head at its precision, the trunk at its own
    model, _ = mlx_mtp.load(out, quiet=True)
    assert model.has_mtp
    fc = model.mtp.fc
    if head_bits == 16:
        assert isinstance(fc, nn.Linear) and not isinstance(fc, nn.QuantizedLinear)
    else:
        assert isinstance(fc, nn.QuantizedLinear) and fc.bits == head_bits
    q = model.language_model.model.layers[0].linear_attn.out_proj
    if trunk_bits:
        assert isinstance(q, nn.QuantizedLinear) and q.bits == trunk_bits
    # plain mlx_lm: strict load succeeds, mtp.* ignored, generation runs
    m2, tok = mlx_lm.load(str(out))
    assert not any("mtp" in k for k, _ in m2.named_modules())
    text = mlx_lm.generate(m2, tok, "hello", max_tokens=4)
    assert isinstance(text, str)


@pytest.mark.parametrize("q_bits,mtp_bits", [(4, None), (4, 16), (4, 4), (8, 8)])
def test_convert_quantized_head_precision(hf, tmp_path, q_bits, mtp_bits):
    out = tmp_path / "q"
    s = convert(hf, out, quantize=True, q_bits=q_bits, mtp_bits=mtp_bits)
    head_bits = 8 if mtp_bits is None else mtp_bits  # default: 8 with a quantized trunk
    assert s["trunk"].startswith(f"{q_bits}-bit")
    _check_quantized(out, q_bits, head_bits)


def test_convert_head_quantized_trunk_float(hf, tmp_path):
    out = tmp_path / "f32_h8"
    convert(hf, out, mtp_bits=8)
    c = cfg(out)
    assert c["quantization"]["bits"] == 8  # top level describes the only quantized part
    _check_quantized(out, None, 8)


def test_convert_moe_q4(hf_moe, tmp_path):
    out = tmp_path / "moe_q4"
    convert(hf_moe, out, quantize=True, q_bits=4, mtp_bits=4)
    c = cfg(out)
    # router gates stay at 8 bits in the head, as mlx_lm keeps them in the trunk
    assert c["quantization"]["mtp.layers.0.mlp.gate"]["bits"] == 8
    assert c["quantization"]["mtp.layers.0.mlp.shared_expert.gate_proj"]["bits"] == 4
    _check_quantized(out, 4, 4)


# -- double conversion ------------------------------------------------------------
def test_double_conversion_does_not_shift_twice(hf, tmp_path, capsys):
    once = tmp_path / "once"
    twice = tmp_path / "twice"
    convert(hf, once)
    s = convert(once, twice)
    assert "already" in s["norms"]
    assert "already in MLX layout" in capsys.readouterr().err
    a, b = raw(once), raw(twice)
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]), k
    # MLX fp32 -> q8 gives the same tensors as HF -> q8 directly
    direct, via = tmp_path / "direct_q8", tmp_path / "via_q8"
    convert(hf, direct, quantize=True, q_bits=8)
    convert(once, via, quantize=True, q_bits=8)
    a, b = raw(direct), raw(via)
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]), k
    # an already-quantized source cannot be quantized again
    with pytest.raises(ConvertError, match="already quantized"):
        convert(via, tmp_path / "again", quantize=True, q_bits=4)


def test_reconversion_keeps_the_heads_recorded_context(hf, tmp_path):
    """A folder whose config records its head's training context
    (mlx_mtp.head_context, as the demo does) keeps it when converted again."""
    once = tmp_path / "once"
    convert(hf, once)
    cfg = json.loads((once / "config.json").read_text())
    assert "head_context" not in cfg["mlx_mtp"]
    cfg["mlx_mtp"]["head_context"] = 128
    (once / "config.json").write_text(json.dumps(cfg))
    convert(once, tmp_path / "q8", quantize=True, q_bits=8)
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["mlx_mtp"][
        "head_context"] == 128


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_family_says_whether_a_checkpoint_is_unconverted(family, tmp_path):
    """One rule per family (`is_unconverted`), asked by the loader, convert,
    graft and draft folders: an HF release is unconverted and its conversion
    is not, from the tensors' shapes and from their names alone."""
    from mlx_mtp.convert.common import check_headers, tensor_shapes
    from mlx_mtp.families import family_of

    hf_path = write_checkpoint(tmp_path / "hf", family=family)
    mlx_path = Path(convert(hf_path, tmp_path / "mlx")["output"])
    rule = family_of(family).is_unconverted
    for folder, unconverted in ((hf_path, True), (mlx_path, False)):
        shapes = tensor_shapes(check_headers(sorted(folder.glob("*.safetensors"))))
        assert rule(shapes) is unconverted, folder.name
        assert rule(dict.fromkeys(shapes)) is unconverted, folder.name


# -- hub path (mocked) --------------------------------------------------------------
def test_convert_from_hub_downloads_only_needed_files(hf, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, allow_patterns))
        return str(hf)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    s = convert("Qwen/Qwen3.6-Tiny", tmp_path / "out", quantize=True)
    assert s["head_tensors"] > 0
    (repo, rev, patterns), = calls
    assert repo == "Qwen/Qwen3.6-Tiny" and patterns
    import fnmatch

    def allowed(name):
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    for need in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "merges.txt",
                 "preprocessor_config.json"):  # (the vision tower's image processor)
        assert allowed(need), need
    for skip in ("video_preprocessor_config.json", "README.md",
                 "consolidated.safetensors", "pytorch_model.bin", ".gitattributes"):
        assert not allowed(skip), skip
    assert "base_model: Qwen/Qwen3.6-Tiny" in (tmp_path / "out" / "README.md").read_text()


# -- safety -----------------------------------------------------------------------
def test_refuses_non_empty_output_without_force(hf, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc = cli(["--hf-path", str(hf), "--mlx-path", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "--force" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only a folder that holds a model: not this one
    assert cli(["--hf-path", str(hf), "--mlx-path", str(out), "--force"]) == 1
    err = capsys.readouterr().err
    assert "refusing to replace" in err and str(out) in err and "no config.json" in err
    assert len(err.strip().splitlines()) == 1 and (out / "keep.txt").read_text() == "mine"
    # an empty folder is fine; --force replaces a model folder (an earlier output)
    (out / "keep.txt").unlink()
    assert cli(["--hf-path", str(hf), "--mlx-path", str(out)]) == 0
    first = (out / "model.safetensors.index.json").stat().st_ino
    assert cli(["--hf-path", str(hf), "--mlx-path", str(out), "-q"]) == 1
    assert cli(["--hf-path", str(hf), "--mlx-path", str(out), "-q", "--force"]) == 0
    assert (out / "model.safetensors.index.json").stat().st_ino != first
    assert cfg(out)["quantization"]["bits"] == 4
    no_leftovers(tmp_path)


def test_never_writes_into_the_source(hf, tmp_path):
    before = snapshot(hf)
    for target in (hf, hf / "sub"):
        with pytest.raises(ConvertError, match="source"):
            convert(hf, target, force=True)
    with pytest.raises(ConvertError, match="source"):
        convert(hf, hf.parent, force=True)
    convert(hf, tmp_path / "ok")
    assert snapshot(hf) == before


def test_interrupted_write_leaves_nothing(hf, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = mx.save_safetensors

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(mx, "save_safetensors", failing)
    with pytest.raises(KeyboardInterrupt):
        convert(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    no_leftovers(tmp_path)
    # replacing with --force: an interruption keeps the old folder intact
    monkeypatch.setattr(mx, "save_safetensors", real)
    convert(hf, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    calls["n"] = 0
    monkeypatch.setattr(mx, "save_safetensors", failing)
    with pytest.raises(KeyboardInterrupt):
        convert(hf, tmp_path / "out", quantize=True, force=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    no_leftovers(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_safetensors_names_the_file(tmp_path, capsys, damage):
    src = write_checkpoint(tmp_path / "src", seed=3, shards=2)
    bad = src / "model-00002-of-00002.safetensors"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) - 100] if damage == "truncate" else data[:8] + b"{garbage" + data[16:])
    rc = cli(["--hf-path", str(src), "--mlx-path", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "model-00002-of-00002.safetensors" in err
    assert not (tmp_path / "out").exists()
    no_leftovers(tmp_path)


def test_source_without_head_converts_with_warning(tmp_path, capsys):
    import mlx_mtp

    src = write_checkpoint(tmp_path / "nohead", seed=4, mtp=False)
    s = convert(src, tmp_path / "out")
    err = capsys.readouterr().err
    assert "no mtp.* tensors" in err and "--graft" in err
    assert s["head_tensors"] == 0 and "none" in s["head"]
    model, _ = mlx_mtp.load(tmp_path / "out", quiet=True)
    assert not model.has_mtp


def test_cli_subprocess_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mlx_mtp.convert", "--hf-path", str(tmp_path / "nope"),
                        "--mlx-path", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().startswith("mlx_mtp.convert: error:") and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_partial_head_is_an_error(tmp_path, capsys):
    from mlx_mtp.testing.synthetic import random_weights, tiny_text_config

    w = random_weights(tiny_text_config(), seed=6)
    del w["mtp.layers.0.mlp.down_proj.weight"]
    src = write_checkpoint(tmp_path / "partial", weights=w)
    assert cli(["--hf-path", str(src), "--mlx-path", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "mtp.layers.0.mlp.down_proj.weight" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_tied_embeddings_q4(tmp_path):
    """Qwen3.5-0.8B style: no lm_head; the head drafts through the embedding."""
    src = write_checkpoint(tmp_path / "tied", seed=7, text_overrides={"tie_word_embeddings": True})
    out = tmp_path / "out"
    convert(src, out, quantize=True, q_bits=4)
    assert "language_model.lm_head.weight" not in raw(out)
    _check_quantized(out, 4, 8)


def test_refuses_pre_quantized_hf_checkpoint(tmp_path):
    src = write_checkpoint(tmp_path / "fp8", seed=8)
    c = cfg(src)
    c["text_config"]["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConvertError, match="pre-quantized checkpoint \\(fp8\\)"):
        convert(src, tmp_path / "out")


def test_reconverting_a_quantized_folder_keeps_its_head(hf, tmp_path):
    q = tmp_path / "q4h4"
    convert(hf, q, quantize=True, q_bits=4, mtp_bits=4)
    again = tmp_path / "again"
    s = convert(q, again)  # no -q, no --mtp-bits: kept as is
    assert s["head"].startswith("4-bit") and s["trunk"].startswith("4-bit")
    a, b = raw(q), raw(again)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(ConvertError, match="already quantized at 4 bits"):
        convert(q, tmp_path / "h8", mtp_bits=8)


# -- --force, temporaries, an output that changes during the run ----------------------------
def test_force_replaces_only_model_folders(tmp_path, monkeypatch):
    from mlx_mtp.convert.common import not_replaceable

    d = tmp_path / "d"
    d.mkdir()
    assert not_replaceable(d) is None  # empty
    (d / "config.json").write_text("{}")
    assert "no *.safetensors" in not_replaceable(d)
    (d / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert not_replaceable(d) is None  # a model: config.json + weights
    (d / "config.json").unlink()
    assert "no config.json" in not_replaceable(d)
    (d / "config.json").mkdir()  # not a file
    assert "no config.json" in not_replaceable(d)
    assert "file-system root" in not_replaceable(Path("/"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    assert "home folder" in not_replaceable(tmp_path / "home")
    monkeypatch.chdir(d)
    assert "current working folder" in not_replaceable(d)
    assert "current working folder" in not_replaceable(tmp_path)


def test_output_changed_during_the_run_is_not_replaced(hf, tmp_path, monkeypatch, capsys):
    """`publish` checks the output again just before the swap: a folder that appeared
    meanwhile (no --force), or stopped being a model (--force), is left alone."""
    from mlx_mtp.convert import interrupts

    out = tmp_path / "out"

    def appears(point):
        if point == "before-publish":
            out.mkdir()
            (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(interrupts, "pause_point", appears)
    assert cli(["--hf-path", str(hf), "--mlx-path", str(out)]) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    no_leftovers(tmp_path)

    shutil.rmtree(out)
    monkeypatch.setattr(interrupts, "pause_point", lambda point: None)
    convert(hf, out)

    def no_longer_a_model(point):
        if point == "before-publish":
            (out / "config.json").unlink()
            (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(interrupts, "pause_point", no_longer_a_model)
    assert cli(["--hf-path", str(hf), "--mlx-path", str(out), "-q", "--force"]) == 1
    err = capsys.readouterr().err
    assert "refusing to replace" in err and "no config.json" in err
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors.index.json").exists()
    no_leftovers(tmp_path)


def test_replace_without_atomic_exchange(hf, tmp_path, monkeypatch):
    """Where the OS cannot swap two folders, the old one is renamed aside, then removed."""
    from mlx_mtp.convert import common

    out = tmp_path / "out"
    convert(hf, out)
    monkeypatch.setattr(common, "_exchange", lambda a, b: False)
    assert cli(["--hf-path", str(hf), "--mlx-path", str(out), "-q", "--force"]) == 0
    assert cfg(out)["quantization"]["bits"] == 4
    no_leftovers(tmp_path)


def test_folder_set_aside_by_a_killed_run_is_put_back(hf, tmp_path, capsys):
    """Killed between the two renames of that fallback: the next run restores the old folder."""
    convert(hf, tmp_path / "x")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "x").rename(tmp_path / f".out.old-{gone.pid}-abcd1234")
    capsys.readouterr()
    assert cli(["--hf-path", str(hf), "--mlx-path", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "restored" in err and "pass --force" in err
    assert (tmp_path / "out" / "config.json").exists()
    no_leftovers(tmp_path)


def test_signal_during_publish_before_the_rename_publishes_nothing(hf, tmp_path, monkeypatch, capsys):
    """A signal that arrives inside `publish` (signals held off) but before the
    rename still means no output: exit 143, the old folder unchanged."""
    import importlib
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    mod = importlib.import_module("mlx_mtp.convert.convert")
    out = tmp_path / "out"
    convert(hf, out)
    before = snapshot(out)
    real = mod.check_replace

    def signal_then_check(o, force):
        os.kill(os.getpid(), signal.SIGTERM)  # recorded by the converter's handler, not raised here
        return real(o, force)

    monkeypatch.setattr(mod, "check_replace", signal_then_check)
    capsys.readouterr()
    assert cli(["--hf-path", str(hf), "--mlx-path", str(out), "-q", "--force"]) == 143
    err = capsys.readouterr().err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert snapshot(out) == before
    no_leftovers(tmp_path)
