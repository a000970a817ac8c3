"""Qwen3-Next (`qwen3_next`): load, head forward, convert, graft and greedy
parity with plain mlx_lm decoding, on tiny random checkpoints in the released
HF layout (flat `model.*`, `mtp.*`, fused GDN projections, one tensor per
expert, no MTP layer count in the config)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_head import _raw, _rms, _rope, _silu
from util import reference

import mlx_mtp
from mlx_mtp.convert import convert, graft
from mlx_mtp.testing.drafters import OracleDrafter
from mlx_mtp.evaluate import teacher_forced_logits
from mlx_mtp.decode import generate_tokens
from mlx_mtp.stats import MTPStats
from mlx_mtp.testing.synthetic import write_checkpoint

PROMPT = [3, 17, 99, 42, 7, 7, 150, 201, 12, 64, 88]
N = 24


@pytest.fixture(scope="module")
def next_ckpts(tmp_path_factory):
    """HF checkpoint, its mlx_mtp q4 conversion, and a plain mlx_lm q4
    conversion (no head: mlx_lm drops mtp.*)."""
    from mlx_lm.convert import convert as lm_convert

    base = tmp_path_factory.mktemp("next")
    hf = write_checkpoint(base / "hf", family="qwen3_next", seed=21)
    q4 = Path(convert(hf, base / "q4", quantize=True, q_bits=4, mtp_bits=8)["output"])
    lm_convert(str(hf), str(base / "lm_q4"), quantize=True, q_bits=4)
    return {"hf": hf, "q4": q4, "lm_q4": base / "lm_q4"}


def _greedy_parity(path, depths=(1, 2, 3)):
    """mlx_mtp greedy == mlx_lm greedy on `path`, with the head's drafts and
    with drafts that are often right (a random head rarely is)."""
    from mlx_lm.utils import load_model

    # strict=False: mlx_lm 0.32's qwen3_next drops mtp.* only from unconverted
    # checkpoints, so a converted folder with a head needs it (docs/guide.md, "Supported models")
    ref_model, _ = load_model(path, strict=False)
    want = reference(ref_model, PROMPT, N)
    model, _ = mlx_mtp.load(path, quiet=True)
    assert model.has_mtp
    for k in depths:
        for drafter in (None, OracleDrafter(want, accept_rate=0.7, vocab_size=259, seed=k)):
            stats = MTPStats()
            got = [t for t, _, _ in generate_tokens(mx.array(PROMPT), model, max_tokens=N,
                                                     draft_tokens=k, stats=stats, drafter=drafter)]
            assert got == want, f"{path.name}: depth {k}, drafter {drafter}"
            assert stats.drafted > 0
            if drafter is not None:
                assert stats.accepted > 0
    return model


def numpy_next_head_logits(w, cfg, hidden, next_tokens):
    """vLLM's Qwen3NextMultiTokenPredictor (qwen3_next_mtp.py) on raw HF
    tensors: concat[pre_fc_norm_embedding(embed), pre_fc_norm_hidden(h)] -> fc
    -> Qwen3-Next full-attention layer 0 (gated q, q/k norm, partial RoPE;
    sparse MoE: softmax router, top-k renormalised, one tensor per expert,
    sigmoid-gated shared expert) -> norm -> lm_head. Norms zero-centred (1+w)."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    x = np.concatenate([_rms(w["model.embed_tokens.weight"][next_tokens], w["mtp.pre_fc_norm_embedding.weight"]),
                        _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"])], -1)
    x = x @ w["mtp.fc.weight"].T
    p, T = "mtp.layers.0", x.shape[0]
    a = _rms(x, w[f"{p}.input_layernorm.weight"])
    q = (a @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = q[..., :hd], q[..., hd:].reshape(T, nh * hd)
    k = (a @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
    v = (a @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
    q = _rms(q, w[f"{p}.self_attn.q_norm.weight"]).transpose(1, 0, 2)
    k = _rms(k, w[f"{p}.self_attn.k_norm.weight"]).transpose(1, 0, 2)
    rot = int(hd * cfg["partial_rotary_factor"])
    q, k = _rope(q, rot, cfg["rope_theta"]), _rope(k, rot, cfg["rope_theta"])
    k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd)
    x = x + (o / (1 + np.exp(-gate))) @ w[f"{p}.self_attn.o_proj.weight"].T
    m = _rms(x, w[f"{p}.post_attention_layernorm.weight"])
    mp = f"{p}.mlp"

    def swiglu(y, g, u, d):
        return (_silu(y @ w[g].T) * (y @ w[u].T)) @ w[d].T

    r = m @ w[f"{mp}.gate.weight"].T
    r = np.exp(r - r.max(-1, keepdims=True))
    r /= r.sum(-1, keepdims=True)
    out = np.zeros_like(m)
    for t in range(T):
        top = np.argsort(-r[t])[: cfg["num_experts_per_tok"]]
        sc = r[t, top] / r[t, top].sum()
        for e, c in zip(top, sc):
            e_ = f"{mp}.experts.{e}"
            out[t] += c * swiglu(m[t], f"{e_}.gate_proj.weight", f"{e_}.up_proj.weight", f"{e_}.down_proj.weight")
    sh = swiglu(m, f"{mp}.shared_expert.gate_proj.weight", f"{mp}.shared_expert.up_proj.weight",
                f"{mp}.shared_expert.down_proj.weight")
    out += sh / (1 + np.exp(-(m @ w[f"{mp}.shared_expert_gate.weight"].T)))
    x = x + out
    return _rms(x, w["mtp.norm.weight"]) @ w["lm_head.weight"].T


def test_next_loads_head_from_tensors(next_ckpts):
    cfg = json.loads((next_ckpts["hf"] / "config.json").read_text())
    assert "num_nextn_predict_layers" not in cfg  # as released: the tensors decide
    model, _ = mlx_mtp.load(next_ckpts["hf"], quiet=True)
    from mlx_lm.models import qwen3_next

    assert isinstance(model, qwen3_next.Model) and model.has_mtp and model.mtp_layers == 1
    assert isinstance(model.mtp.layers[0], qwen3_next.Qwen3NextDecoderLayer)
    assert isinstance(model.mtp.layers[0].mlp, qwen3_next.Qwen3NextSparseMoeBlock)
    w = _raw(next_ckpts["hf"])
    np.testing.assert_array_equal(np.array(model.mtp.norm.weight), w["mtp.norm.weight"] + 1.0)


def test_next_head_forward_matches_vllm_layout(next_ckpts):
    path = next_ckpts["hf"]
    model, _ = mlx_mtp.load(path, quiet=True)
    cfg = json.loads((path / "config.json").read_text())
    w = _raw(path)
    tokens = PROMPT + [5, 250, 31]
    _, mtp_logits = teacher_forced_logits(model, tokens)
    h = np.array(model.trunk_hidden(mx.array(tokens)[None], None)[0])
    want = numpy_next_head_logits(w, cfg, h[:-1], np.array(tokens[1:]))
    np.testing.assert_allclose(np.array(mtp_logits), want, rtol=1e-3, atol=1e-3)
    # the other concat order gives other logits: the check can fail
    sw = dict(w)
    sw["mtp.pre_fc_norm_embedding.weight"], sw["mtp.pre_fc_norm_hidden.weight"] = (
        w["mtp.pre_fc_norm_hidden.weight"], w["mtp.pre_fc_norm_embedding.weight"])
    assert not np.allclose(numpy_next_head_logits(sw, cfg, h[:-1], np.array(tokens[1:])), want, atol=1e-3)


def test_next_fp32_greedy_parity(next_ckpts):
    _greedy_parity(next_ckpts["hf"])


def test_next_q4_convert_and_parity(next_ckpts):
    import mlx.nn as nn

    cfg = json.loads((next_ckpts["q4"] / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1  # recorded from the tensors
    model = _greedy_parity(next_ckpts["q4"])
    assert isinstance(model.mtp.fc, nn.QuantizedLinear) and model.mtp.fc.bits == 8
    assert isinstance(model.model.layers[0].linear_attn.in_proj_qkvz, nn.QuantizedLinear)


def test_next_graft_into_plain_mlx_lm_conversion(next_ckpts, tmp_path):
    import shutil

    target = tmp_path / "lm_q4"
    shutil.copytree(next_ckpts["lm_q4"], target)
    model, _ = mlx_mtp.load(target, quiet=True)
    assert not model.has_mtp  # mlx_lm dropped the head
    graft(target, next_ckpts["hf"], mtp_bits=8)
    assert json.loads((target / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # the grafted head is the head of the direct conversion, tensor for tensor
    a = {k: v for f in target.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    b = {k: v for f in next_ckpts["q4"].glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    heads = sorted(k for k in b if k.startswith("mtp."))
    assert heads == sorted(k for k in a if k.startswith("mtp."))
    for k in heads:
        assert mx.array_equal(a[k], b[k]), k
    _greedy_parity(target, depths=(2,))


def test_next_evaluate(next_ckpts, tmp_path, capsys):
    from mlx_mtp.evaluate import main

    text = tmp_path / "t.py"
    text.write_text("def add(a, b):\n    return a + b\n" * 3)
    assert main(["--model", str(next_ckpts["hf"]), "--text-file", str(text), "--depth", "2",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["acceptance"]) == 2 and res["loss_head"] > 0
