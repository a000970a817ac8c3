"""The MTP head's forward, checked against an independent NumPy implementation
written from the raw HF tensors and docs/design.md, "Models" (post-norm trunk hidden,
embedding first in the concat, zero-centred norms applied as 1+w, gated
attention with q/k norm and partial RoPE, shared lm_head)."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_mtp
from mlx_mtp.evaluate import expected_acceptance, teacher_forced_logits


def _raw(path):
    w = {}
    for f in sorted(path.glob("*.safetensors")):
        w.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    return w


def _rms(x, w, eps=1e-6, zero_centred=True):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * ((1.0 + w) if zero_centred else w)


def _rope(x, dims, base):
    # x: [heads, T, D]; non-traditional RoPE over the first `dims` features
    T = x.shape[1]
    half = dims // 2
    inv = base ** (-np.arange(0, half) * 2.0 / dims)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:dims]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:dims] = x1 * sin + x2 * cos
    return out


def _silu(x):
    return x / (1 + np.exp(-x))


def numpy_head_logits(w, tc, hidden, next_tokens):
    """hidden [T, H] post-norm trunk hiddens; next_tokens [T] -> logits [T, V]."""
    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    emb = w["model.language_model.embed_tokens.weight"][next_tokens]
    x = np.concatenate([_rms(emb, w["mtp.pre_fc_norm_embedding.weight"]),
                        _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"])], -1)
    x = x @ w["mtp.fc.weight"].T
    p = "mtp.layers.0"
    T = x.shape[0]
    a_in = _rms(x, w[f"{p}.input_layernorm.weight"])
    q = (a_in @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = q[..., :hd], q[..., hd:].reshape(T, nh * hd)
    k = (a_in @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
    v = (a_in @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
    q = _rms(q, w[f"{p}.self_attn.q_norm.weight"]).transpose(1, 0, 2)
    k = _rms(k, w[f"{p}.self_attn.k_norm.weight"]).transpose(1, 0, 2)
    v = v.transpose(1, 0, 2)
    rot = int(hd * tc["rope_parameters"]["partial_rotary_factor"])
    base = tc["rope_parameters"]["rope_theta"]
    q, k = _rope(q, rot, base), _rope(k, rot, base)
    k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    s = s + np.triu(np.full((T, T), -np.inf), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd)
    x = x + (o * (1 / (1 + np.exp(-gate)))) @ w[f"{p}.self_attn.o_proj.weight"].T
    m_in = _rms(x, w[f"{p}.post_attention_layernorm.weight"])
    mlp = (_silu(m_in @ w[f"{p}.mlp.gate_proj.weight"].T) * (m_in @ w[f"{p}.mlp.up_proj.weight"].T))
    x = x + mlp @ w[f"{p}.mlp.down_proj.weight"].T
    g = _rms(x, w["mtp.norm.weight"])
    return g @ w["lm_head.weight"].T


def test_head_forward_matches_independent_reference(dense_ckpt):
    import json

    model, tok = mlx_mtp.load(dense_ckpt)
    tc = json.loads((dense_ckpt / "config.json").read_text())["text_config"]
    w = _raw(dense_ckpt)
    tokens = tok.encode("def spam(eggs):\n    return eggs * 2\n")
    main, mtp = teacher_forced_logits(model, tokens)
    assert main.shape == (len(tokens), tc["vocab_size"])
    assert mtp.shape == (len(tokens) - 1, tc["vocab_size"])
    # trunk hidden after the final norm is what the head consumes
    h = np.array(model.trunk_hidden(mx.array(tokens)[None], None)[0])
    want = numpy_head_logits(w, tc, h[:-1], np.array(tokens[1:]))
    np.testing.assert_allclose(np.array(mtp), want, rtol=1e-3, atol=1e-3)
    # a head fed the pre-norm hidden, or the concat in the other order, differs
    swapped = w.copy()
    swapped["mtp.pre_fc_norm_embedding.weight"], swapped["mtp.pre_fc_norm_hidden.weight"] = (
        w["mtp.pre_fc_norm_hidden.weight"], w["mtp.pre_fc_norm_embedding.weight"])
    assert not np.allclose(numpy_head_logits(swapped, tc, h[:-1], np.array(tokens[1:])), want, atol=1e-3)


def test_head_norms_shifted_exactly_once(dense_ckpt):
    model, _ = mlx_mtp.load(dense_ckpt)
    w = _raw(dense_ckpt)
    for name in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.self_attn.q_norm.weight"):
        mod = model
        for part in name.split(".")[:-1]:
            mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
        np.testing.assert_array_equal(np.array(mod.weight), w[name] + 1.0)


def test_moe_fused_and_per_expert_layouts_agree(moe_ckpt, moe_per_expert_ckpt):
    a, tok = mlx_mtp.load(moe_ckpt)
    b, _ = mlx_mtp.load(moe_per_expert_ckpt)
    tokens = tok.encode("x = [1, 2, 3]")
    for x, y in zip(teacher_forced_logits(a, tokens), teacher_forced_logits(b, tokens)):
        assert mx.array_equal(x, y)


def test_expected_acceptance_counts_chained_drafts(loaded):
    model, _, tok = loaded("dense")
    tokens = tok.encode("for i in range(10):\n    print(i)\n" * 3)
    res = expected_acceptance(model, tokens, depth=3, max_starts=16)
    acc = res["acceptance"]
    assert res["starts"] == 16 and len(acc) == 3
    assert all(0.0 <= x <= 1.0 for x in acc)
    assert acc[0] >= acc[1] >= acc[2]  # position i needs 1..i-1 accepted
    assert res["tokens_per_cycle"][3] == pytest.approx(1 + sum(acc))
