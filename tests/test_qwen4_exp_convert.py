"""Qwen3.8-Flash-Next (`qwen4_exp`) through the tools: `mlx_mtp.convert`
(head kept, norms shifted once, `-q` and `--mtp-bits`), `--graft` (reads
only the `mtp.*` shard) and `mlx_mtp.evaluate`. Tiny random checkpoints in
the released HF layout (hidden 64 and 64-wide n-gram rows, so that group-64
quantization reaches the routers and the n-gram tables); docs/qwen4_exp.md."""

from __future__ import annotations

import json
import math
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_convert_graft import SHARDS, make_unreadable, raw, reshard_with_head_apart, snapshot
from util import mtp, reference

import mlx_mtp
from mlx_mtp.convert import ConvertError, convert, graft
from mlx_mtp.convert.__main__ import main as cli
from mlx_mtp.testing.drafters import OracleDrafter
from mlx_mtp.stats import MTPStats
from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint

OVERRIDES = {"hidden_size": 64, "ple_embed_dim": 256}  # n-gram rows: 256 / 4 heads = 64
PROMPT = [3, 17, 99, 42, 7, 7, 150, 258, 12, 64, 88, 5, 9, 200, 31, 1]
N = 20
LM = "language_model.model."


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The HF checkpoint, its fp32 conversion, and its 4-bit conversion with
    an 8-bit head (through the command line)."""
    base = tmp_path_factory.mktemp("q4x_convert")
    hf = write_qwen4_exp_checkpoint(base / "hf", seed=3, text_overrides=OVERRIDES)
    convert(hf, base / "fp32")
    assert cli(["--hf-path", str(hf), "--mlx-path", str(base / "q4"), "-q", "--q-bits", "4",
                "--mtp-bits", "8"]) == 0
    return dict(hf=hf, fp32=base / "fp32", q4=base / "q4")


def _trunk_alone(path):
    """The converted trunk as a plain mlx_lm model (mtp.* dropped by its sanitize)."""
    from mlx_lm.utils import load_model

    from mlx_mtp.models import qwen4_exp

    model, _ = load_model(path, get_model_classes=lambda config: (qwen4_exp.Model, qwen4_exp.ModelArgs))
    return model


def _logits(model, ids):
    """Teacher-forced trunk and head logits over `ids`."""
    seq = mx.array([ids])
    h = model.trunk_hidden(seq, None)
    g = model.mtp(h[:, :-1], model.embed(seq[:, 1:]))
    return model.logits_from_hidden(h), model.logits_from_hidden(g)


def _greedy_equals_plain(model, want, depths):
    for k in depths:
        for drafter in (OracleDrafter(want, 0.7, model.vocab_size, seed=k), None):
            stats = MTPStats()
            got = mtp(model, PROMPT, k, N, drafter=drafter, stats=stats)
            assert got == want, f"depth {k}, drafter {drafter}"
            assert stats.drafted > 0 and (drafter is None or stats.accepted > 0)


# ---------------------------------------------------------------- convert


def test_fp32_convert_is_the_unconverted_model(ckpts):
    """fp32: the conversion gives the unconverted checkpoint's trunk and head
    logits exactly; zero-centred norms (trunk and head) are shifted once, the
    gated GDN norm is not; n-gram tables kept as their row shards (3, no more
    than NGRAM_GROUPS: groups of one), the
    derived hash buffers dropped, torch conv layout moved, the head in a
    shard of its own."""
    a, _ = mlx_mtp.load(ckpts["hf"], quiet=True)
    b, _ = mlx_mtp.load(ckpts["fp32"], quiet=True)
    for x, y in zip(_logits(a, PROMPT), _logits(b, PROMPT)):
        assert mx.array_equal(x, y)

    src, out = raw(ckpts["hf"]), raw(ckpts["fp32"])
    s = lambda k: np.array(src["model.language_model." + k])  # noqa: E731
    o = lambda k: np.array(out[LM + k])  # noqa: E731
    for k in ("hyper_connection_mixer.hc_norm.weight", "layers.0.ple.norm_conv.weight",
              "layers.1.self_attn.indexer.q_layernorm.weight", "layers.1.self_attn.k_norm.weight"):
        assert np.array_equal(o(k), s(k) + 1), k
    for k in ("pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight",
              "layers.0.self_attn.indexer.k_layernorm.weight", "layers.0.mlp_hyper_connection.hc_norm.weight"):
        assert np.array_equal(np.array(out["mtp." + k]), np.array(src["mtp." + k]) + 1), k
    assert np.array_equal(o("layers.0.linear_attn.norm.weight"), s("layers.0.linear_attn.norm.weight"))
    for k in ("layers.0.linear_attn.conv1d.weight", "layers.2.ple.conv1d.weight"):
        assert np.array_equal(o(k), np.moveaxis(s(k), 2, 1)), k
    for layer in (0, 2):  # ple_layer_ids [1, 3]
        p = f"layers.{layer}.ple.ple_embedding.ngram_embedding"
        parts = sorted((int(k.rsplit(".shard_", 1)[1].split(".")[0]), k) for k in src
                       if k.startswith(f"model.language_model.{p}.shard_"))
        assert len(parts) == 3  # written as the row shards they came as, not joined
        for i, k in parts:
            assert np.array_equal(o(f"{p}.shard_{i}.weight"), np.array(src[k])), k
        assert LM + p + ".weight" not in out
    assert not [k for k in out if "multipliers" in k or "ngram_heads" in k]

    index = json.loads((ckpts["fp32"] / "model.safetensors.index.json").read_text())
    head_files = {f for k, f in index["weight_map"].items() if k.startswith("mtp.")}
    assert len(head_files) == 1 and not [k for k, f in index["weight_map"].items()
                                         if f in head_files and not k.startswith("mtp.")]
    cfg = json.loads((ckpts["fp32"] / "config.json").read_text())
    assert cfg["mlx_mtp"]["mtp"] and cfg["mlx_mtp"]["mtp_bits"] == 16 and "quantization" not in cfg


def test_reconvert_shifts_nothing_and_refuses_overwrite(ckpts, tmp_path):
    """An MLX-layout source is converted without shifting again (here to
    bfloat16: A_log stays float32, the family's cast_predicate); an existing
    output is not overwritten without --force; a quantized source is not
    quantized again."""
    s = convert(ckpts["fp32"], tmp_path / "bf16", dtype="bfloat16")
    assert "already" in s["norms"] and s["trunk"] == s["head"] == "bfloat16"
    a, b = raw(ckpts["fp32"]), raw(tmp_path / "bf16")
    assert sorted(a) == sorted(b)
    for k, v in b.items():
        want = mx.float32 if k.endswith("A_log") else mx.bfloat16
        assert v.dtype == want and mx.array_equal(v, a[k].astype(want)), k

    before = snapshot(ckpts["fp32"])
    with pytest.raises(ConvertError, match="exists and is not empty; pass --force"):
        convert(ckpts["hf"], ckpts["fp32"])
    assert snapshot(ckpts["fp32"]) == before
    with pytest.raises(ConvertError, match="already quantized"):
        convert(ckpts["q4"], tmp_path / "again", quantize=True)
    assert not (tmp_path / "again").exists()


def test_q4_convert_greedy_mtp_equals_plain(ckpts):
    """-q --q-bits 4 --mtp-bits 8: the trunk at 4 bits (routers 8, n-gram
    tables 4: the family's quant_predicate), the head at 8; greedy MTP ==
    plain greedy decoding of the same converted trunk (loaded alone by
    mlx_lm), depths 1-3, oracle drafts and the head's own."""
    cfg = json.loads((ckpts["q4"] / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["mlx_mtp"]["mtp_bits"] == 8
    model, _ = mlx_mtp.load(ckpts["q4"], quiet=True)
    layers, head = model.layers, model.mtp
    assert layers[1].self_attn.q_proj.bits == 4 and layers[1].mlp.gate.bits == 8
    table = layers[0].ple.ple_embedding.ngram_embedding
    assert len(table.pieces()) == 3  # quantized shard by shard
    for name, _, _ in table.pieces():
        assert isinstance(table[name], nn.QuantizedEmbedding) and table[name].bits == 4
    assert head.fc_hidden.bits == 8 and head.layers[0].self_attn.indexer.index_qk_proj.bits == 8
    assert head.layers[0].mlp.gate.bits == 8
    want = reference(_trunk_alone(ckpts["q4"]), PROMPT, N)
    _greedy_equals_plain(model, want, (1, 2, 3))


@pytest.mark.parametrize("kind", ["fp32", "q4"])
def test_older_conversion_with_joined_tables_loads(ckpts, tmp_path, kind):
    """A conversion written before the row shards were kept (each n-gram
    table one tensor, with -q quantized whole) loads through mlx_mtp.load,
    cut into the config's shards, and gives the same trunk and head logits
    bit for bit."""
    old = tmp_path / "old"
    shutil.copytree(ckpts[kind], old)
    weight_map = {}
    for f in sorted(old.glob("*.safetensors")):
        w, joined = mx.load(str(f)), {}
        for k in [k for k in w if ".ngram_embedding.shard_" in k]:
            head, tail = k.split(".shard_")
            i, leaf = tail.split(".")
            joined.setdefault(f"{head}.{leaf}", {})[int(i)] = w.pop(k)
        w.update({k: mx.concatenate([p[i] for i in sorted(p)]) for k, p in joined.items()})
        mx.save_safetensors(str(f), w, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(w, f.name))
    index = old / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        index.write_text(json.dumps(dict(data, weight_map=weight_map)))
    assert LM + "layers.0.ple.ple_embedding.ngram_embedding.weight" in weight_map
    new, _ = mlx_mtp.load(ckpts[kind], quiet=True)
    model, _ = mlx_mtp.load(old, quiet=True)
    table = model.layers[0].ple.ple_embedding.ngram_embedding
    assert isinstance(table["shard_2"], nn.QuantizedEmbedding) == (kind == "q4")
    assert [n for _, _, n in table.pieces()] == [n for _, _, n in new.layers[0].ple.ple_embedding.ngram_embedding.pieces()]
    for a, b in zip(_logits(model, PROMPT), _logits(new, PROMPT)):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("kind", ["fp32", "q4"])
def test_convert_writes_the_groups_held(ckpts, tmp_path, monkeypatch, kind):
    """With fewer groups than the checkpoint's shards (NGRAM_GROUPS=2, 3
    parts: shard 0, then shards 1-2), convert writes the groups the model
    holds (-q: quantized group by group), not the shards and not the table
    joined; the folder loads as it is (same trunk and head logits as the
    shards' conversion, bit for bit), and also with the default grouping
    (cut back into the shards)."""
    from mlx_mtp.models import qwen4_exp

    monkeypatch.setattr(qwen4_exp, "NGRAM_GROUPS", 2)
    out = tmp_path / kind
    q = ["-q", "--q-bits", "4", "--mtp-bits", "8"] if kind == "q4" else []
    assert cli(["--hf-path", str(ckpts["hf"]), "--mlx-path", str(out)] + q) == 0
    src, written = raw(ckpts["hf"]), raw(out)
    for layer in (0, 2):
        p = f"{LM}layers.{layer}.ple.ple_embedding.ngram_embedding."
        assert sorted(k[len(p):] for k in written if k.startswith(p)) == sorted(
            f"{n}.{leaf}" for n in ("shard_0", "shards_1_2")
            for leaf in (("weight", "scales", "biases") if kind == "q4" else ("weight",)))
        if kind == "fp32":
            h = f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_"
            assert np.array_equal(np.array(written[p + "shards_1_2.weight"]),
                                  np.concatenate([np.array(src[f"{h}{i}.weight"]) for i in (1, 2)]))
    want = _logits(mlx_mtp.load(ckpts[kind], quiet=True)[0], PROMPT)
    model, _ = mlx_mtp.load(out, quiet=True)
    table = model.layers[0].ple.ple_embedding.ngram_embedding
    assert [name for name, _, _ in table.pieces()] == ["shard_0", "shards_1_2"]
    assert isinstance(table["shards_1_2"], nn.QuantizedEmbedding) == (kind == "q4")
    for a, b in zip(_logits(model, PROMPT), want):
        assert mx.array_equal(a, b)
    monkeypatch.setattr(qwen4_exp, "NGRAM_GROUPS", 8)
    model, _ = mlx_mtp.load(out, quiet=True)
    assert len(model.layers[0].ple.ple_embedding.ngram_embedding.pieces()) == 3
    for a, b in zip(_logits(model, PROMPT), want):
        assert mx.array_equal(a, b)


def test_head_only_quantized(ckpts, tmp_path):
    """--mtp-bits 4 without -q: the head at 4 bits, the trunk in floating
    point; greedy MTP == plain."""
    s = convert(ckpts["hf"], tmp_path / "h4", mtp_bits=4)
    assert s["trunk"] == "float32" and s["head"] == "4-bit (group 64)"
    model, _ = mlx_mtp.load(tmp_path / "h4", quiet=True)
    assert model.mtp.fc_hidden.bits == 4 and type(model.layers[1].self_attn.q_proj) is nn.Linear
    _greedy_equals_plain(model, reference(_trunk_alone(tmp_path / "h4"), PROMPT, N), (2,))


# ---------------------------------------------------------------- graft


def test_graft_reads_only_the_mtp_shard_and_equals_convert(ckpts, tmp_path):
    """The head grafted from an HF checkpoint (trunk shards unreadable) into a
    conversion without one is the direct conversion's, tensor for tensor and
    in the config: 4-bit trunk with an 8-bit head, and fp32 (the head takes
    the target's float dtype)."""
    nohead = write_qwen4_exp_checkpoint(tmp_path / "nohead", seed=3, mtp=False, text_overrides=OVERRIDES)
    sharded = reshard_with_head_apart(ckpts["hf"], tmp_path / "sharded")
    make_unreadable(sharded, SHARDS[:2])  # reading the trunk's shards would fail
    for name, kw, direct, bits in [("q4", dict(quantize=True, q_bits=4), ckpts["q4"], 8),
                                   ("fp32", {}, ckpts["fp32"], None)]:
        target = tmp_path / name
        convert(nohead, target, **kw)
        s = graft(target, sharded, mtp_bits=bits)
        assert s["source_shards_read"] == [SHARDS[2]] and s["norms"] == "shifted once (HF source)"
        assert s["head"] == ("8-bit (group 64)" if bits else "float32")
        a, b = raw(target), raw(direct)
        assert sorted(a) == sorted(b)
        for k in b:
            assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]), f"{name}: {k}"
        ca, cb = (json.loads((p / "config.json").read_text()) for p in (target, direct))
        assert ca.get("quantization") == cb.get("quantization")
        assert ca["mlx_mtp"]["mtp_bits"] == cb["mlx_mtp"]["mtp_bits"]
    model, _ = mlx_mtp.load(target, quiet=True)
    assert model.has_mtp


# ---------------------------------------------------------------- evaluate


def test_evaluate_acceptance(ckpts, tmp_path, capsys):
    """Teacher-forced acceptance: every start's chain of drafts (the head's
    cache cut to the pairs before it: QSA K/V and indexer keys) as decoding
    would draft them, computed here from a fresh head cache per start.
    lm_head reduced to two tokens whose order a direction decides, so trunk
    and head agree about half the time (a random head rarely agrees over the
    full vocabulary); the head's attention output scaled up, so that what its
    cache holds decides drafts (an uncut cache changes the numbers). Then the
    command line on the 4-bit conversion."""
    from mlx_mtp.evaluate import expected_acceptance, main

    model, _ = mlx_mtp.load(ckpts["hf"], quiet=True)
    u = mx.random.normal((model.text_args.hidden_size,), key=mx.random.key(0))
    w = mx.zeros_like(model.untied_lm_head.weight)
    model.untied_lm_head.weight = w.at[10].add(u).at[20].add(-u)
    o_proj = model.mtp.layers[0].self_attn.o_proj
    o_proj.weight = o_proj.weight * 10
    toks = PROMPT + [40, 41, 258, 7, 99, 12, 12, 130, 5, 64, 88, 3, 200, 17]
    depth = 3
    res = expected_acceptance(model, toks, depth=depth)

    seq = mx.array([toks])
    h = model.trunk_hidden(seq, None)
    greedy = mx.argmax(model.logits_from_hidden(h)[0], axis=-1).tolist()
    starts = range(len(toks) - 1 - depth)
    accepted = [0] * depth
    for t in starts:
        cache = model.mtp.make_cache()
        g = model.mtp(h[:, : t + 1], model.embed(seq[:, 1 : t + 2]), cache)[:, -1:]
        for i in range(depth):
            d = int(mx.argmax(model.logits_from_hidden(g)[0, -1]))
            if d != greedy[t + 1 + i]:
                break
            accepted[i] += 1
            g = model.mtp(g, model.embed(mx.array([[d]])), cache)
    acc = [a / len(starts) for a in accepted]
    assert res["starts"] == len(starts) and res["acceptance"] == acc
    assert 0 < acc[0] < 1 and acc[1] > 0 and acc == sorted(acc, reverse=True)
    assert res["tokens_per_cycle"] == {k: 1 + sum(acc[:k]) for k in range(1, depth + 1)}

    text = tmp_path / "t.py"
    text.write_text("def add(a, b):\n    return a + b\n" * 3)
    capsys.readouterr()
    assert main(["--model", str(ckpts["q4"]), "--text-file", str(text), "--depth", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["acceptance"]) == 2 and all(0 <= a <= 1 for a in out["acceptance"])
    assert all(math.isfinite(out[k]) and out[k] > 0 for k in ("loss_trunk", "loss_head"))
