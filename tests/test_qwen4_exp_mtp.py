"""Qwen3.8-Flash-Next (`qwen4_exp`) with its MTP head through mlx_mtp: the
head against a NumPy head written from vLLM's and mlx-vlm's code, verify and
rollback of every state (QSA K/V + indexer keys, PLE conv window + n-gram
context, GDN), and greedy MTP decoding equal to plain decoding token for
token (depths 1-3 and auto; one prompt, two turns on one prompt cache, rows
of a batch; fp32 and 4-bit). Tiny random checkpoints in the released HF
layout; see docs/qwen4_exp.md."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache
from qwen4_exp_reference import Reference
from util import assert_pooled_block_keys, mtp, reference, row_tokens

import mlx_mtp
from mlx_mtp.depth import DepthController
from mlx_mtp.cache import PaddedCacheList
from mlx_mtp.testing.drafters import BigramDrafter, OracleDrafter
from mlx_mtp.batch import make_batch
from mlx_mtp.decode import decode_rows
from mlx_mtp.stats import MTPStats
from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint

# 16 tokens with an EOS (258): QSA picks 2 of up to 8 two-token blocks, n-grams are cut
PROMPT = [3, 17, 99, 42, 7, 7, 150, 258, 12, 64, 88, 5, 9, 200, 31, 1]
TURN2 = [5, 6, 258, 77, 12, 140]
N = 20


def _raw(path):
    w = {}
    for f in sorted(path.glob("*.safetensors")):
        w.update({k: np.array(v) for k, v in mx.load(str(f)).items()})
    return w


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_qwen4_exp_checkpoint(tmp_path_factory.mktemp("q4x_mtp"))
    model, tok = mlx_mtp.load(path, quiet=True)
    config = json.loads((path / "config.json").read_text())
    return dict(path=path, model=model, tok=tok, raw=_raw(path), tc=config["text_config"])


def _streams_of(model, hidden):
    """The streams part of a family hidden [.., (hc+1)*H] (docs/qwen4_exp.md)."""
    return hidden[..., model.text_args.hidden_size:]


# ---------------------------------------------------------------- the head


def test_head_logits_match_numpy_reference(ckpt):
    """Teacher-forced over the prompt's pairs, then a chain of 3 drafts on
    the head's cache (each fed the head's own streams and its draft): every
    position's logits and streams against the NumPy head."""
    model, ref = ckpt["model"], Reference(ckpt["raw"], ckpt["tc"])
    seq = mx.array([PROMPT])
    h = model.trunk_hidden(seq, None)
    # the trunk's streams and collapsed hidden are the reference's
    ref_streams = ref.streams(PROMPT)
    assert np.abs(np.array(_streams_of(model, h)[0]) - ref_streams).max() < 1e-4
    assert np.abs(np.array(model.logits_from_hidden(h)[0]) - ref.logits(PROMPT)).max() < 1e-4

    cache = model.mtp.make_cache()
    g = model.mtp(h[:, :-1], model.embed(seq[:, 1:]), cache)
    pairs_h, pairs_t = list(ref_streams[:-1]), PROMPT[1:]
    want, want_s = ref.head(np.stack(pairs_h), pairs_t)
    diffs = [np.abs(np.array(model.logits_from_hidden(g)[0]) - want).max(),
             np.abs(np.array(_streams_of(model, g)[0]) - want_s).max()]
    for _ in range(3):  # chained drafts: (the head's last streams, its arg-max)
        d = int(np.argmax(want[-1]))
        pairs_h.append(want_s[-1])
        pairs_t = list(pairs_t) + [d]
        g = model.mtp(g[:, -1:], model.embed(mx.array([[d]])), cache)
        want, want_s = ref.head(np.stack(pairs_h), pairs_t)
        diffs += [np.abs(np.array(model.logits_from_hidden(g)[0, -1]) - want[-1]).max(),
                  np.abs(np.array(_streams_of(model, g)[0, -1]) - want_s[-1]).max()]
    print("head diffs (logits, streams) per step:", ["%.1e" % d for d in diffs])
    assert max(diffs) < 1e-4, diffs
    assert ref.min_margin > 1e-4  # QSA's cut clear of ties (in trunk and head)
    assert cache[0][0].offset == cache[0][1].offset == len(PROMPT) + 2


@pytest.mark.parametrize("part", ["hidden_norm", "embedding_branch", "mixer"])
def test_each_head_part_shows(ckpt, part):
    """The head comparison can fail: break one part and the logits move."""
    from mlx_mtp.models.qwen4_exp import GroupedRMSNorm

    model, _ = mlx_mtp.load(ckpt["path"], quiet=True)  # a copy to break
    ref = Reference(ckpt["raw"], ckpt["tc"])
    seq = mx.array([PROMPT])
    want, _ = ref.head(ref.streams(PROMPT)[:-1], PROMPT[1:])
    head = model.mtp
    if part == "hidden_norm":  # per stream instead of over all hc*H features
        norm = GroupedRMSNorm(head.pre_fc_norm_hidden.weight.shape[0], head.hidden)
        norm.weight = head.pre_fc_norm_hidden.weight
        head.pre_fc_norm_hidden = norm
    elif part == "embedding_branch":
        head.fc_embedding.weight = mx.zeros_like(head.fc_embedding.weight)
    else:  # the trunk's mixer instead of the head's own
        head.hyper_connection_mixer = model.text_model.hyper_connection_mixer
    h = model.trunk_hidden(seq, None)
    g = head(h[:, :-1], model.embed(seq[:, 1:]))
    assert np.abs(np.array(model.logits_from_hidden(g)[0]) - want).max() > 1e-3


# ---------------------------------------------------------------- verify / rollback


def assert_states_equal(mine: list, want: list, where="", atol=1e-5):
    """Trunk prompt caches equal: every KVCache of a CacheList (QSA K/V, the
    indexer keys) up to its length, every ArraysCache entry (GDN conv window
    and state, PLE conv window, n-gram context ids exactly)."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(mine, want)):
        assert type(a) is type(b), f"{where} layer {i}"
        if isinstance(b, CacheList):
            for j, (x, y) in enumerate(zip(a.caches, b.caches)):
                assert x.offset == y.offset, f"{where} layer {i}.{j}: {x.offset} != {y.offset}"
                n = y.offset
                for u, v in ((x.keys, y.keys), (x.values, y.values)):
                    worst = max(worst, float(mx.abs(u[..., :n, :] - v[..., :n, :]).max()) if v.size else 0)
        else:
            assert len(a.cache) == len(b.cache)
            for j, (u, v) in enumerate(zip(a.cache, b.cache)):
                assert u.shape == v.shape, f"{where} layer {i} entry {j}"
                if mx.issubdtype(v.dtype, mx.integer):
                    assert mx.array_equal(u, v), f"{where} layer {i}: n-gram context"
                else:
                    worst = max(worst, float(mx.abs(u - v).max()))
    assert worst < atol, f"{where}: {worst}"
    return worst


def assert_head_follows(model, prompt_cache, context):
    """The head's cache holds the pairs (h_p, tok_{p+1}) of the trunk's own
    hiddens over `context` (attention K/V and indexer keys), and the kept
    last hidden is the trunk's: nothing drafted or rejected is left."""
    n_trunk = len(model.is_linear)
    seq = mx.array(context)[None]
    h = model.trunk_hidden(seq, None)
    fresh = model.mtp.make_cache()
    model.mtp(h[:, :-1], model.embed(seq[:, 1:]), fresh)
    n = len(context) - 1
    for mine, want in zip(prompt_cache[n_trunk:-1], fresh):
        for x, y in zip(mine.caches, want.caches):
            assert x.offset == y.offset == n, (x.offset, n)
            assert mx.allclose(x.keys[..., :n, :], y.keys[..., :n, :], atol=1e-4)
    assert mx.allclose(prompt_cache[-1][0], h[:, -1:], atol=1e-4)


def _ahead(model, turns, max_tokens):
    """Plain greedy tokens of each turn on one cache (mlx_lm's generate_step)."""
    cache = make_prompt_cache(model)
    return [reference(model, t, m, prompt_cache=cache) for t, m in zip(turns, max_tokens)]


def test_two_turns_states_roll_back_exactly(ckpt):
    """Greedy MTP == plain decoding token for token at depths 1-3 and auto,
    over two turns on one prompt cache, with drafts the head makes (rarely
    right: a random head) and oracle drafts right 70% of the time (partial
    acceptance: every rejected position rolled back). After each turn the
    trunk's states equal plain decoding's and the head holds only verified
    pairs."""
    model = ckpt["model"]
    turns, limits = [PROMPT, TURN2], [N, 12]
    want = _ahead(model, turns, limits)
    worst = 0.0
    for k, rate in [(1, 0.7), (2, 0.7), (3, 0.7), ("auto", 0.7), (3, None)]:
        cache = model.make_cache()
        ref_cache = make_prompt_cache(model)
        context = []
        for i, (t, m) in enumerate(zip(turns, limits)):
            drafter = OracleDrafter(want[i], rate, model.vocab_size, seed=i) if rate else None
            stats = MTPStats()
            ctl = DepthController() if k == "auto" else None
            got = mtp(model, t, k, m, prompt_cache=cache, drafter=drafter, stats=stats,
                      controller=ctl)
            assert got == want[i], f"depth {k} oracle {rate}, turn {i}"
            assert stats.drafted > 0
            if rate and k != "auto":  # some drafts kept, some rejected
                assert 0 < stats.accepted < stats.drafted
            reference(model, t, m, prompt_cache=ref_cache)
            context += t + got
            worst = max(worst, assert_states_equal(cache[:len(ref_cache)], ref_cache,
                                                   f"depth {k}, turn {i}"))
            assert_head_follows(model, cache, context)
    print(f"max state diff vs plain decoding: {worst:.2e}")


def test_rolled_back_states_would_differ(ckpt):
    """The state comparison can fail: decoding one more token (what a missed
    rollback leaves) moves every kind of state."""
    model = ckpt["model"]
    a, b = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=a)
    model(mx.array([PROMPT[:-1]]), cache=b)
    model(mx.array([[PROMPT[-1] + 1]]), cache=b)  # the last position rejected and replaced
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, CacheList):
            assert not mx.allclose(x[0].keys, y[0].keys) and not mx.allclose(x[1].keys, y[1].keys)
        else:  # GDN conv window + state, PLE conv window + n-gram context
            assert all(not mx.array_equal(u, v) for u, v in zip(x.cache, y.cache)), i


def _pooled_keys_ok(model, cache) -> bool:
    """Every QSA entry of the trunk and the head holds its pooled block keys
    as pooling its raw keys gives them (util.assert_pooled_block_keys)."""
    n = len(model.is_linear)
    entries = [(l.self_attn.indexer, c) for l, c in zip(model.layers, cache) if not l.is_linear]
    entries += [(l.self_attn.indexer, c) for l, c in zip(model.mtp.layers, cache[n:-1])]
    try:
        for i, (indexer, c) in enumerate(entries):
            assert_pooled_block_keys(indexer, c, f"QSA entry {i}")
    except AssertionError:
        return False
    return True


def test_blocks_completed_in_rejected_verifies_roll_back(tmp_path, monkeypatch):
    """4-token QSA blocks at depth 3: each verify [y, d1, d2, d3] completes a
    block and pools it. With every draft wrong, three verifies in four roll
    that block back; with 60% right drafts (depths 2 and 3) some are kept.
    Greedy MTP == plain decoding, every state equals plain decoding's (the
    pooled block keys included), and the trunk's and head's pooled keys are
    what pooling their raw keys gives, bit for bit. If the rollback skipped
    the pooled keys, that fails."""
    path = write_qwen4_exp_checkpoint(tmp_path, seed=3, text_overrides=dict(
        indexer_compress_ratio=4, indexer_budget=8))
    model, _ = mlx_mtp.load(path, quiet=True)
    ids = PROMPT + [5, 9]  # 18 tokens: the first verify starts mid-block
    ref_cache = make_prompt_cache(model)
    want = reference(model, ids, N, prompt_cache=ref_cache)

    def run(k, rate):
        cache, stats = model.make_cache(), MTPStats()
        got = mtp(model, ids, k, N, prompt_cache=cache, stats=stats,
                  drafter=OracleDrafter(want, rate, model.vocab_size, seed=k))
        return got, cache, stats

    for k, rate in ((3, 0.0), (3, 0.6), (2, 0.6)):
        got, cache, stats = run(k, rate)
        assert got == want, (k, rate)
        assert stats.accepted == 0 if rate == 0 else 0 < stats.accepted < stats.drafted
        assert_states_equal(cache[:len(ref_cache)], ref_cache, f"depth {k} oracle {rate}")
        assert _pooled_keys_ok(model, cache), (k, rate)

    trim = PaddedCacheList.trim
    monkeypatch.setattr(PaddedCacheList, "trim", lambda self, n: (
        [c.trim(n) for c in self.caches[:-1]], n)[1])  # the pooled keys not rolled back
    model.runtime.clear()
    got, cache, _ = run(3, 0.0)
    assert got != want or not _pooled_keys_ok(model, cache)
    assert trim is not PaddedCacheList.trim


# ---------------------------------------------------------------- batches, 4-bit


def _rows_equal_alone(model, prompts, limits, want, cases, depths):
    drafter = BigramDrafter(want[::2], model.vocab_size)  # odd rows: mostly wrong drafts
    for n, width in cases:
        for k in depths:
            batch = make_batch(model, draft_tokens=k, drafter=drafter)
            reqs = [batch.prepare(p, None, limits[i], None) for i, p in enumerate(prompts[:n])]
            got = [[] for _ in range(n)]
            for i, t in row_tokens(decode_rows(batch, reqs, width)):
                got[i].append(t)
            for r in range(n):
                assert got[r] == want[r][:limits[r]], f"B={n} width={width} depth {k} row {r}"
            if k != "auto":
                accepted = [r.stats.accepted for r in reqs]
                assert len(set(accepted)) > 1 and max(accepted) > 0


BATCH = [PROMPT, TURN2, [258, 1, 2, 3], [9, 9, 9, 9, 9, 9, 9, 9, 40, 41, 42]]


def test_rows_of_a_batch_equal_alone(ckpt):
    """Rows of different lengths decode together (one verify per cycle, each
    row its own acceptance, per-row QSA lengths and PLE/GDN commits), rows
    joining as others leave (width 2): each row's tokens are its plain ones."""
    model = ckpt["model"]
    limits = [N, 9, 14, 17]
    want = [reference(model, p, N) for p in BATCH]
    _rows_equal_alone(model, BATCH, limits, want, [(4, 4)], [1, 3, "auto"])
    _rows_equal_alone(model, BATCH, limits, want, [(4, 2)], [2])
    out = mlx_mtp.batch_generate(model, ckpt["tok"], BATCH[:3], max_tokens=limits[:3],
                                 draft_tokens=2, return_token_ids=True)
    assert out.token_ids == [w[:m] for w, m in zip(want[:3], limits[:3])]


def test_4bit_greedy_equals_plain(tmp_path):
    """4-bit (mlx_lm's quantize_model with the family's quant_predicate: the
    routers at 8 bits, group 64, which needs hidden_size 64), trunk and head:
    greedy MTP == plain decoding, one prompt and a batch."""
    from mlx_lm.utils import quantize_model

    path = write_qwen4_exp_checkpoint(tmp_path, seed=3, text_overrides={"hidden_size": 64})
    model, _ = mlx_mtp.load(path, quiet=True)
    quantize_model(model, {}, group_size=64, bits=4)
    assert model.mtp.fc_hidden.bits == 4 and model.mtp.layers[0].mlp.gate.bits == 8
    assert model.layers[1].self_attn.indexer.index_qk_proj.bits == 4
    want = [reference(model, p, N) for p in BATCH]
    for k in (1, 2, 3, "auto"):
        ctl = DepthController() if k == "auto" else None
        drafter = OracleDrafter(want[0], 0.7, model.vocab_size, seed=2)
        assert mtp(model, PROMPT, k, N, drafter=drafter, controller=ctl) == want[0], k
    _rows_equal_alone(model, BATCH, [N, 9, 14, 17], want, [(4, 4)], [2])


@pytest.mark.slow  # the first geometry's tests prove the claim; this one varies the shapes
def test_second_geometry_greedy_equals_plain(tmp_path):
    """A GDN layer without PLE (ArraysCache(2)), silu gate, 4 streams,
    4-grams, 3-token QSA blocks: greedy MTP == plain decoding, with states
    equal after."""
    overrides = dict(
        hc_count=4, output_gate_type=None, ngram_size=4, heads_per_ngram=1, ple_embed_dim=12,
        ple_conv_kernel_size=4, indexer_compress_ratio=3, indexer_budget=6, ple_layer_ids=[1],
        split_ngram_parts=1, num_hidden_layers=5,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                     "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0]})
    path = write_qwen4_exp_checkpoint(tmp_path, seed=1, text_overrides=overrides)
    model, _ = mlx_mtp.load(path, quiet=True)
    ids = PROMPT + [258, 258, 4]
    ref_cache = make_prompt_cache(model)
    want = reference(model, ids, N, prompt_cache=ref_cache)
    for k in (3,):
        cache = model.make_cache()
        got = mtp(model, ids, k, N, prompt_cache=cache,
                  drafter=OracleDrafter(want, 0.7, model.vocab_size, seed=k))
        assert got == want, k
        assert_states_equal(cache[:len(ref_cache)], ref_cache, f"depth {k}")
    assert isinstance(cache[0], type(ref_cache[0])) and len(cache[1].cache) == 2


def test_head_cache_kinds_and_checks(ckpt):
    """The head's prompt-cache entries are mlx_lm kinds (CacheList of
    KVCaches per head layer, then the last hidden); a prompt cache of the
    wrong kinds is refused in one line."""
    model = ckpt["model"]
    assert model.hidden_width == (ckpt["tc"]["hc_count"] + 1) * ckpt["tc"]["hidden_size"]
    cache = model.make_cache()
    mtp(model, PROMPT[:5], 1, 2, prompt_cache=cache)
    n = len(model.is_linear)
    assert len(cache) == n + 2 and isinstance(cache[n], CacheList)
    assert all(isinstance(c, KVCache) for c in cache[n].caches)
    bad = model.make_cache()
    bad[1] = KVCache()
    with pytest.raises(ValueError, match=r"prompt_cache\[1\] is a KVCache; .* CacheList"):
        mtp(model, PROMPT[:5], 1, 2, prompt_cache=bad)
    # a one-token prompt on a fresh cache: the decoding form starts from what
    # the layers start from (the n-gram context is EOS, not token 0)
    assert mtp(model, [5], 2, 8) == reference(model, [5], 8)


def test_without_head_decodes_plainly(tmp_path):
    """A checkpoint without `mtp.*` loads (one notice) and decodes plainly;
    a head tensor missing from a checkpoint that has the others is refused,
    naming it."""
    from mlx_mtp.model import MTPWeightError

    path = write_qwen4_exp_checkpoint(tmp_path / "plain", seed=2, mtp=False)
    model, _ = mlx_mtp.load(path, quiet=True)
    assert not model.has_mtp and model.mtp_missing
    assert mtp(model, PROMPT, 2, 6) == reference(model, PROMPT, 6)

    path = write_qwen4_exp_checkpoint(tmp_path / "cut", seed=2)
    f = path / "model.safetensors"
    w = mx.load(str(f))
    del w["mtp.fc_hidden.weight"]
    mx.save_safetensors(str(f), w, metadata={"format": "pt"})
    with pytest.raises(MTPWeightError, match="mtp.fc_hidden.weight is missing"):
        mlx_mtp.load(path, quiet=True)
