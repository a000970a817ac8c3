"""Compiled pipelined cycles (mlx_mtp/compiled.py): same tokens as mlx_lm and as
the uncompiled loop, and one trace per depth for a whole generation."""

import mlx.core as mx
import pytest

from mlx_mtp import make_sampler
from mlx_mtp.caches import PaddedKVCache
from mlx_mtp.decode import MTPDecoder, MTPStats, OracleDrafter, _pipelined_cycles, mtp_generate_step

from test_parity import LONG, SHORT, reference


def _tokens(model, tok, prompt, k, max_tokens=40, **kw):
    p = mx.array(tok.encode(prompt))
    return [t for t, _, _ in mtp_generate_step(p, model, max_tokens=max_tokens, draft_tokens=k,
                                               pipeline=True, compiled=True, **kw)]


@pytest.mark.parametrize("name", ["dense", "dense_bf16", "moe"])
@pytest.mark.parametrize("rate", [None, 1.0, 0.6, 0.0])
def test_compiled_greedy_parity(loaded, name, rate):
    model, ref_model, tok = loaded(name)
    V = model.language_model.args.vocab_size
    for prompt, step in [(SHORT, 2048), (LONG, 16)]:
        ref = reference(ref_model, tok, prompt, prefill_step_size=step)
        for k in [0, 1, 2, 3, "auto"]:
            stats = MTPStats()
            oracle = OracleDrafter(ref, rate, V, seed=3) if rate is not None else None
            got = _tokens(model, tok, prompt, k, oracle=oracle, prefill_step_size=step,
                          stats=stats)
            assert got == ref, f"{name} depth {k} rate {rate}"
            if rate == 1.0 and k not in (0, "auto"):
                assert stats.acceptance == [1.0] * k


def _run(model, prompt_ids, k, max_tokens, oracle=None):
    dec = MTPDecoder(model, oracle=oracle)
    y, _ = dec.prefill(prompt_ids)
    mx.eval(y)
    out = [y.item()] + [t for t, _, _ in _pipelined_cycles(dec, k, None, max_tokens,
                                                           compiled=True)]
    return dec, out


def test_one_trace_per_depth_as_context_grows(loaded):
    """max_tokens known: capacity is reserved up front, so a 200-token
    generation at depth 2 traces the depth-2 graph once (plus the plain step
    the max_tokens cap may force), however long the context gets."""
    model, ref_model, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    p = mx.array(tok.encode(SHORT))
    ref = reference(ref_model, tok, SHORT, max_tokens=200)
    dec, out = _run(model, p, 2, 200, OracleDrafter(ref, 0.7, V, seed=1))
    assert out == ref
    assert dec.compiled.traces[2] == 1
    assert all(n == 1 for n in dec.compiled.traces.values())
    assert dec.stats.cycles > 50


def test_retrace_only_when_capacity_grows(loaded, monkeypatch):
    """No max_tokens (-1): caches grow in whole blocks, one trace per block."""
    monkeypatch.setattr(PaddedKVCache, "block", 32)
    model, ref_model, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    p = mx.array(tok.encode(SHORT))
    ref = reference(ref_model, tok, SHORT, max_tokens=120)
    dec = MTPDecoder(model, oracle=OracleDrafter(ref, 0.7, V, seed=2))
    y, _ = dec.prefill(p)
    mx.eval(y)
    gen = _pipelined_cycles(dec, 2, None, -1, compiled=True)
    out = [y.item()] + [next(gen) for _ in range(119)]
    gen.close()
    assert [t for t, _, _ in out[1:]] == ref[1:]
    caps = {c.capacity for c in dec._padded_caches()}
    assert all(c % 32 == 0 for c in caps)
    blocks = max(caps) // 32
    assert 2 <= dec.compiled.traces[2] <= blocks


@pytest.mark.parametrize("k", [1, 3])
def test_compiled_sampling_matches_uncompiled(loaded, k):
    """Same seed, same keys split in the same order: identical samples. The
    last cycle may differ (depth capped by an upper bound near max_tokens),
    so generate with slack and compare the prefix."""
    model, _, tok = loaded("dense")
    p = mx.array(tok.encode(LONG))
    runs = []
    for compiled in (False, True):
        sampler = make_sampler(0.9, top_p=0.95)
        runs.append([t for t, _, _ in mtp_generate_step(
            p, model, max_tokens=50, draft_tokens=k, sampler=sampler, seed=11,
            pipeline=True, compiled=compiled)][:40])
    assert runs[0] == runs[1]
