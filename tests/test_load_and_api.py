"""Loading (good and bad input), the drop-in API, and the CLIs."""

import io
import json
import shutil
import subprocess
import sys

import mlx_lm
import pytest

import mlx_mtp
from mlx_mtp.loader import CheckpointError
from mlx_mtp.model import MTPWeightError
from mlx_mtp.testing.synthetic import random_weights, tiny_text_config, write_checkpoint


def test_model_works_unchanged_with_mlx_lm(loaded):
    model, ref_model, tok = loaded("dense")
    assert mlx_lm.generate(model, tok, "abc", max_tokens=12) == mlx_lm.generate(
        ref_model, tok, "abc", max_tokens=12)


def test_api_fields_and_prompt_forms(loaded):
    model, ref_model, tok = loaded("dense")
    want = mlx_lm.generate(ref_model, tok, "hello", max_tokens=15)
    ids = tok.encode("hello")
    assert mlx_mtp.generate(model, tok, ids, max_tokens=15, draft_tokens=3) == want
    assert mlx_mtp.generate(model, tok, "hello", max_tokens=15, draft_tokens=0) == want
    last = list(mlx_mtp.stream_generate(model, tok, "hello", max_tokens=15, draft_tokens=2))[-1]
    for f in ("text", "token", "logprobs", "prompt_tokens", "prompt_tps", "generation_tokens",
              "generation_tps", "peak_memory", "finish_reason", "drafted", "accepted",
              "acceptance", "tokens_per_cycle"):
        assert hasattr(last, f), f
    assert last.prompt_tokens == len(ids) and last.generation_tokens == 15
    assert last.drafted > 0 and len(last.acceptance) == 2
    assert last.logprobs.shape == (model.language_model.args.vocab_size,)


def test_env_disables_mtp(loaded, monkeypatch):
    model, _, tok = loaded("dense")
    monkeypatch.setenv("MLX_MTP_DISABLE", "1")
    last = list(mlx_mtp.stream_generate(model, tok, "hello", max_tokens=8, draft_tokens=3))[-1]
    assert last.drafted == 0 and last.generation_tokens == 8


def test_checkpoint_without_mtp_decodes_plainly(no_mtp_ckpt, capfd):
    model, tok = mlx_mtp.load(no_mtp_ckpt)
    err = capfd.readouterr().err
    assert "no mtp.* tensors" in err and "--graft" in err and err.count("\n") == 1
    assert not model.has_mtp
    ref, _ = mlx_lm.load(str(no_mtp_ckpt))
    got = list(mlx_mtp.stream_generate(model, tok, "abc", max_tokens=10, draft_tokens=3))
    assert "".join(r.text for r in got) == mlx_lm.generate(ref, tok, "abc", max_tokens=10)
    assert got[-1].drafted == 0


def _write(tmp_path, weights, **kw):
    return write_checkpoint(tmp_path / "ck", weights=weights, **kw)


def test_partial_mtp_names_missing_tensor(tmp_path):
    w = random_weights(tiny_text_config())
    del w["mtp.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(MTPWeightError, match=r"mtp\.layers\.0\.self_attn\.k_proj\.weight"):
        mlx_mtp.load(_write(tmp_path, w))


def test_wrong_shape_mtp_names_tensor(tmp_path):
    w = random_weights(tiny_text_config())
    w["mtp.fc.weight"] = w["mtp.fc.weight"][:, :10]
    with pytest.raises(MTPWeightError, match=r"mtp\.fc\.weight has shape"):
        mlx_mtp.load(_write(tmp_path, w))


def test_unsupported_model_type_lists_supported(tmp_path, dense_ckpt):
    d = tmp_path / "ck"
    shutil.copytree(dense_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: qwen3_5, qwen3_5_moe"):
        mlx_mtp.load(d)


def test_missing_files_are_named(tmp_path):
    d = write_checkpoint(tmp_path / "sh", shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        mlx_mtp.load(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        mlx_mtp.load(d)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mlx_mtp.load(tmp_path / "nowhere")


def test_truncated_weights_name_file_and_tensor(tmp_path):
    d = write_checkpoint(tmp_path / "tr")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor \S+ is truncated"):
        mlx_mtp.load(d)
    f.write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        mlx_mtp.load(d)


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_cli(dense_ckpt, capsys, monkeypatch):
    r = _cli("mlx_mtp.generate", "--model", str(dense_ckpt), "--prompt", "def f():",
             "--max-tokens", "12", "--draft-tokens", "3", "--verbose", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "Generation: 12 tokens" in r.stdout and "tokens-per-sec" in r.stdout
    assert "MTP: draft depth 3, acceptance per position [" in r.stdout
    # the rest in this process (its `main`): a prompt on stdin, a missing folder
    from mlx_mtp.cli import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x = 1\n")))
    assert main(["--model", str(dense_ckpt), "--prompt", "-", "--max-tokens", "5",
                 "--ignore-chat-template", "--system-prompt", "be brief"]) in (0, None)
    capsys.readouterr()
    assert main(["--model", "/nonexistent/model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def test_evaluate_cli(dense_ckpt, tmp_path):
    text = tmp_path / "t.py"
    text.write_text("def add(a, b):\n    return a + b\n" * 4)
    r = _cli("mlx_mtp.evaluate", "--model", str(dense_ckpt), "--text-file", str(text),
             "--depth", "3", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert len(res["acceptance"]) == 3 and res["loss_head"] > 0
