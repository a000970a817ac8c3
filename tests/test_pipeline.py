"""Pipelined (double-buffered) decoding gives exactly what the synchronous
core and mlx_lm give.

`mtp_generate_step(pipeline=True)` launches cycle n+1 before it reads cycle n
and rolls attention caches back on the device (PaddedKVCache, device-resident
`offset`). These tests compare its outputs and caches with the synchronous
loop (`pipeline=False`) and with plain mlx_lm decoding.

The fixtures' random heads almost never draft right, so accepted and
partially accepted cycles are driven by `device_oracle`, which replaces the
head's greedy drafts by the known continuation IN-GRAPH, with a fixed pattern
of deliberately wrong drafts. It reads the draft position from the trunk
cache's length (device-side when pipelined), not from the decoder's own
bookkeeping, and leaves the decoder's `oracle` unset, so exactly the
head-drafting path runs. The head still runs its chain and its cache
rewrite; verify, commit and the device-side rollback run for real.
"""

import itertools
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from test_parity import LONG, SHORT, _plain_cache_after, reference

import mlx_mtp
from mlx_mtp.caches import PaddedKVCache
from mlx_mtp.decode import MTPDecoder, MTPStats, mtp_generate_step

OPENBLAS = "openblas" in os.environ.get("LD_PRELOAD", "").lower()
OPENBLAS_REASON = ("LD_PRELOAD has OpenBLAS: padded matmuls may round differently (~1e-7) from "
                   "exact-length ones; bitwise equality holds with MLX's bundled BLAS (CI)")


# -- helpers --------------------------------------------------------------------
def device_oracle(monkeypatch, model, prompt_len, sequence, rate, seed=0):
    """Make every MTPDecoder draft `sequence` (the generated tokens, first one
    included) in-graph: draft j of a cycle is right with probability `rate`
    (a fixed random table over (position, j)), else sequence token + 1."""
    V = model.language_model.args.vocab_size
    pad = 16
    seq = mx.array(list(sequence) + [0] * pad, dtype=mx.int32)
    right = mx.array(np.random.default_rng(seed).random((len(sequence) + pad, 8)) < rate)
    original = MTPDecoder._draft_greedy

    def drafts_from_sequence(self, k):
        drafts, chained = original(self, k)  # the head still drafts (its cache chain)
        # tokens fed to the trunk: an int (KVCache) or a device scalar (PaddedKVCache)
        fed = next(c.offset for c in self.cache if isinstance(c, (KVCache, PaddedKVCache)))
        idx = mx.minimum(mx.array(fed) - prompt_len + 1 + mx.arange(k), len(sequence) + pad - 1)
        true = mx.take(seq, idx)
        ok = right[idx, mx.arange(k)]
        return mx.where(ok, true, (true + 1) % V).astype(mx.int32), chained

    monkeypatch.setattr(MTPDecoder, "_draft_greedy", drafts_from_sequence)


def run(model, prompt_ids, k, max_tokens, pipeline, take=None, rows=False, **kw):
    """Tokens of mtp_generate_step (the first `take` of them when given), and
    with rows=True their log-probability rows [n, V] too."""
    gen = mtp_generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, draft_tokens=k,
                            pipeline=pipeline, **kw)
    out = list(itertools.islice(gen, take))
    gen.close()
    tokens = [t for t, _, _ in out]
    return (tokens, mx.stack([r for _, r, _ in out])) if rows else tokens


def reference_rows(ref_model, prompt_ids, max_tokens, prefill_step_size):
    """mlx_lm.generate_step's tokens and log-probability rows."""
    out = list(generate_step(mx.array(prompt_ids), ref_model, max_tokens=max_tokens,
                             prefill_step_size=prefill_step_size))
    return [t for t, _ in out], mx.stack([r for _, r in out])


# bit for bit with MLX's bundled BLAS; OpenBLAS may round padded matmuls differently
SAME = mx.array_equal if not OPENBLAS else (lambda a, b: mx.allclose(a, b, atol=1e-4))


def drive(dec, depths, pipelined):
    """Run cycles of the given depths on a prefilled decoder, double-buffered
    like `_pipelined_cycles` (every launched cycle is landed). Returns the
    emitted tokens."""
    out = []
    if not pipelined:
        for k in depths:
            out += dec.cycle(k)[0]
        return out
    inflight = None
    for k in depths:
        launched = dec.launch(k)
        mx.async_eval(launched.outputs)
        if inflight is not None:
            out += dec.land(inflight)[0]
        inflight = launched
    return out + dec.land(inflight)[0]


# -- 1. greedy: pipelined == synchronous == mlx_lm --------------------------------
# (depth, oracle accept rate or None for the real head, also synchronous?)
GREEDY = [(0, None, False), (1, 0.8, True), (2, 0.6, True), (3, 0.9, True),
          ("auto", 0.9, True), ("auto", None, False)]
GREEDY_REAL_HEAD = [(1, None, False), (2, None, False), (3, None, False)]


@pytest.mark.parametrize("name", ["dense", "dense_bf16", "moe"])
@pytest.mark.parametrize("prompt,step", [(SHORT, 2048), (LONG, 32)], ids=["short", "chunked"])
def test_greedy_parity(loaded, monkeypatch, name, prompt, step):
    """Token for token equal to mlx_lm.generate_step, and the log-probability
    rows bit for bit, max_tokens ending mid-cycle included (short prompt; the
    long one is prefilled in chunks of `step`). The synchronous loop's parity
    with mlx_lm under the real head is test_parity's; here it runs with the
    in-graph oracle too."""
    model, ref_model, tok = loaded(name)
    ids = tok.encode(prompt)
    assert len(ids) > 2 * step or step > len(ids)  # several chunks, or none
    ref, ref_rows = reference_rows(ref_model, ids, 33, step)
    short = step > len(ids)
    configs = GREEDY + (GREEDY_REAL_HEAD if name == "dense" and short else [])
    for k, rate, also_sync in configs:
        if rate is not None:
            device_oracle(monkeypatch, model, len(ids), ref, rate, seed=len(ids))
        for max_tokens in (1, 2, 7, 33) if short else (33,):
            where = f"depth {k}, oracle {rate}, max_tokens {max_tokens}"
            stats = MTPStats()
            got, rows = run(model, ids, k, max_tokens, True, prefill_step_size=step,
                            stats=stats, rows=True)
            assert got == ref[:max_tokens], "pipelined, " + where
            assert SAME(rows, ref_rows[:max_tokens]), "pipelined log-probs, " + where
            if also_sync and max_tokens in (7, 33):
                got, rows = run(model, ids, k, max_tokens, False, prefill_step_size=step,
                                rows=True)
                assert got == ref[:max_tokens], "synchronous, " + where
                assert SAME(rows, ref_rows[:max_tokens]), "synchronous log-probs, " + where
            if rate is not None and k != "auto" and max_tokens == 33:
                assert stats.accepted > 0 and stats.accepted < stats.drafted  # both paths ran
        monkeypatch.undo()


# -- 2. sampling: pipelined == synchronous for the same seed -----------------------
SAMPLING = [(0, dict(temp=1.0)), (1, dict(temp=10.0)), (2, dict(temp=5.0, top_k=100)),
            (3, dict(temp=10.0, top_p=0.98))]


@pytest.mark.parametrize("k,cfg", SAMPLING, ids=["plain", "temp", "top_k", "top_p"])
def test_sampling_same_keys(loaded, k, cfg):
    """Unbounded generation (max_tokens=-1, 40 tokens read): the same seed
    gives the same tokens in both loops. High temperatures make the random
    head's drafts accepted often, so accepting and rejecting cycles both occur."""
    model, _, tok = loaded("dense")
    ids = tok.encode(SHORT)
    sampler, stats = mlx_mtp.make_sampler(**cfg), MTPStats()
    pipe, rows = run(model, ids, k, -1, True, take=40, sampler=sampler, seed=k, stats=stats,
                     rows=True)
    sync, sync_rows = run(model, ids, k, -1, False, take=40, sampler=sampler, seed=k, rows=True)
    assert pipe == sync
    assert SAME(rows, sync_rows)
    assert k == 0 or 0 < stats.accepted < stats.drafted
    if k == 1:  # the seed decides the tokens: the comparison above is not vacuous
        assert pipe != run(model, ids, k, -1, True, take=40, sampler=sampler, seed=k + 100)


def test_sampling_same_keys_bounded(loaded):
    """Neither loop caps the depth by max_tokens (the pipelined one could not
    know how many tokens the in-flight cycle emits), so with a token limit too
    the two split the same keys and sample the same tokens."""
    model, _, tok = loaded("dense")
    ids = tok.encode(SHORT)
    sampler = mlx_mtp.make_sampler(temp=10.0)
    pipe = run(model, ids, 3, 33, True, sampler=sampler, seed=3)
    assert pipe == run(model, ids, 3, 33, False, sampler=sampler, seed=3)


# -- 3. EOS and max_tokens through stream_generate ----------------------------------
def _with_eos(tokenizers, eos=None):
    """The tokenizers' own EOS ids, plus `eos` when given."""
    for t in tokenizers:
        t._eos_token_ids = set(t._mtp_test_eos) | ({eos} if eos is not None else set())


@pytest.mark.parametrize("rate", [None, 1.0])
def test_eos_stops_like_mlx_lm(loaded, dense_ckpt, monkeypatch, rate):
    """EOS ending a cycle's output anywhere (first, middle, last of its
    tokens): the output stops on it, as mlx_lm's does; the cycle launched
    behind it never reaches the caller."""
    import mlx_lm

    model, ref_model, _ = loaded("dense")
    _, tok = mlx_mtp.load(dense_ckpt)
    _, ref_tok = mlx_lm.load(str(dense_ckpt))
    for t in (tok, ref_tok):
        t._mtp_test_eos = set(t.eos_token_ids)
    ids = tok.encode(SHORT)
    ref = reference(ref_model, tok, SHORT, max_tokens=30)
    if rate is not None:  # every cycle emits k+1 tokens: EOS first, mid, last of a cycle
        device_oracle(monkeypatch, model, len(ids), ref, rate)
    stops = [i for i in range(4, 14) if ref.index(ref[i]) == i][:3 if rate else 1]
    assert len(stops) == (3 if rate else 1)
    for stop in stops:
        _with_eos((tok, ref_tok), ref[stop])
        want = list(mlx_lm.stream_generate(ref_model, ref_tok, SHORT, max_tokens=30))
        assert [r.token for r in want] == ref[:stop + 1]
        for k in (1, 2, 3):
            got = list(mlx_mtp.stream_generate(model, tok, SHORT, max_tokens=30, draft_tokens=k,
                                               pipeline=True))
            assert [r.token for r in got] == ref[:stop + 1], f"depth {k}, EOS at {stop}"
            assert "".join(r.text for r in got) == "".join(r.text for r in want)
            assert got[-1].finish_reason == "stop" == want[-1].finish_reason
            assert got[-1].generation_tokens == stop + 1 == want[-1].generation_tokens
    _with_eos((tok, ref_tok))
    for max_tokens in (2, 5):  # max_tokens mid-cycle
        want = mlx_lm.generate(ref_model, ref_tok, SHORT, max_tokens=max_tokens)
        got = list(mlx_mtp.stream_generate(model, tok, SHORT, max_tokens=max_tokens,
                                           draft_tokens=3, pipeline=True))
        assert "".join(r.text for r in got) == want
        assert got[-1].generation_tokens == max_tokens and got[-1].finish_reason == "length"


def test_sampled_eos_stops_like_synchronous(loaded, dense_ckpt):
    """Sampling: the pipelined run stops on the same EOS, at the same place,
    as the synchronous run with the same seed."""
    model, _, _ = loaded("dense")
    _, tok = mlx_mtp.load(dense_ckpt)
    tok._mtp_test_eos = set(tok.eos_token_ids)
    sampler = mlx_mtp.make_sampler(temp=10.0)

    def tokens(pipeline):
        return [r.token for r in mlx_mtp.stream_generate(
            model, tok, SHORT, max_tokens=60, draft_tokens=3, sampler=sampler, seed=5,
            pipeline=pipeline)]

    sync = tokens(False)
    stop = next(i for i in range(6, 40) if sync.index(sync[i]) == i)
    _with_eos([tok], sync[stop])
    assert tokens(False) == sync[:stop + 1]
    assert tokens(True) == sync[:stop + 1]


# -- 4. caches after pipelined cycles equal plain decoding's -------------------------
@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_pipelined_caches_equal_plain_decoding(loaded, monkeypatch, rate):
    """After double-buffered cycles of mixed depths (plain steps included),
    every trunk attention cache up to its device-side length and every GDN
    state equals plain decoding's bit for bit; the head's cache has the
    trunk's length and equals the synchronous decoder's."""
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(LONG)
    ref = reference(ref_model, tok, LONG, max_tokens=40)
    device_oracle(monkeypatch, model, len(ids), ref, rate, seed=7)
    depths = [3, 1, 0, 2, 3, 0, 0, 3, 2, 1, 3]
    runs = {}
    for pipelined in (True, False):
        dec = MTPDecoder(model)
        y, _ = dec.prefill(mx.array(ids), prefill_step_size=32)
        if pipelined:
            dec.start_pipeline(reserve=8)
        emitted = [y.item()] + drive(dec, depths, pipelined)
        assert emitted == ref[:len(emitted)]
        runs[pipelined] = dec, emitted
    (pipe, emitted), (sync, _) = runs[True], runs[False]
    assert emitted == runs[False][1]
    n = len(ids) + len(emitted) - 1  # y (the last token) is not fed yet

    plain = _plain_cache_after(ref_model, ids, emitted, step=32)
    for i, (mine, want) in enumerate(zip(pipe.cache, plain)):
        if isinstance(want, KVCache):
            assert isinstance(mine, PaddedKVCache)
            assert mine.offset.item() == want.offset == n == mine.bound, f"layer {i}"
            assert SAME(mine.keys[..., :n, :], want.keys[..., :n, :]), f"keys, layer {i}"
            assert SAME(mine.values[..., :n, :], want.values[..., :n, :]), f"values, layer {i}"
        else:
            assert SAME(mine[0], want[0]), f"conv window, layer {i}"
            assert SAME(mine[1], want[1]), f"GDN state, layer {i}"
    for mine, want in zip(pipe.head_cache, sync.head_cache):
        assert mine.offset.item() == want.offset == n
        assert SAME(mine.keys[..., :n, :], want.keys[..., :n, :])
        assert SAME(mine.values[..., :n, :], want.values[..., :n, :])
    if rate == 1.0:
        assert pipe.stats.acceptance[:3] == [1.0] * 3
    if rate == 0.0:
        assert pipe.stats.accepted == 0


# -- 5. capacity grows in whole blocks ----------------------------------------------
def test_capacity_growth(loaded, monkeypatch):
    monkeypatch.setattr(PaddedKVCache, "block", 16)
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(SHORT)
    ref = reference(ref_model, tok, SHORT, max_tokens=70)
    device_oracle(monkeypatch, model, len(ids), ref, 0.7, seed=2)
    # unbounded: start_pipeline reserves one cycle ahead, cycles grow the caches
    assert run(model, ids, 3, -1, True, take=70) == ref
    assert run(model, ids, "auto", -1, True, take=70) == ref
    assert run(model, ids, 2, 70, True) == ref

    dec = MTPDecoder(model)
    y, _ = dec.prefill(mx.array(ids))
    dec.start_pipeline(reserve=5)
    caches = list(dec._padded_caches())
    assert len(caches) == 3  # two trunk attention layers, the head's
    assert {c.capacity for c in caches} == {16}  # 9 + 5 entries: one block
    seen = set()

    def check():
        for c in caches:
            assert c.capacity % 16 == 0 and c.bound <= c.capacity < c.bound + 16 + 4
            seen.add(c.capacity)

    emitted, inflight = [y.item()], None
    for k in [3, 2, 0, 3, 1] * 6:
        launched = dec.launch(k)
        check()
        mx.async_eval(launched.outputs)
        if inflight is not None:
            emitted += dec.land(inflight)[0]
            check()
        inflight = launched
    emitted += dec.land(inflight)[0]
    assert emitted == ref[:len(emitted)]
    assert len(seen) >= 3  # it grew more than once
    n = len(ids) + len(emitted) - 1
    assert all(c.offset.item() == c.bound == n for c in caches)


def test_reserve_whole_blocks(monkeypatch):
    monkeypatch.setattr(PaddedKVCache, "block", 16)
    plain = KVCache()
    k0 = mx.random.normal((1, 2, 5, 8), key=mx.random.key(0))
    plain.update_and_fetch(k0, -k0)
    c = PaddedKVCache.from_kv_cache(plain, reserve=11)  # 5 + 11 = one block
    assert c.capacity == 16 and c.bound == 5 and c.offset.item() == 5
    c.reserve(16)
    assert c.capacity == 16
    c.reserve(17)
    assert c.capacity == 32
    c.reserve(40)
    assert c.capacity == 48
    assert mx.array_equal(c.keys[..., :5, :], k0) and mx.array_equal(c.values[..., :5, :], -k0)
    assert not mx.any(c.keys[..., 5:, :]).item()


# -- 6. PaddedKVCache attention == KVCache attention ---------------------------------
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_padded_attention_equals_kv_cache(T, dtype):
    """Queries of T positions over a cache, then a device-side rollback that
    leaves stale entries in the buffer, three times: attention through the
    padded buffer equals attention through exact-length keys."""
    Hq, Hkv, D, n = 4, 2, 16, 11
    key = iter(mx.random.split(mx.random.key(T), 16))
    rand = lambda *s: mx.random.normal(s, key=next(key)).astype(dtype)
    plain = KVCache()
    plain.update_and_fetch(rand(1, Hkv, n, D), rand(1, Hkv, n, D))
    padded = PaddedKVCache.from_kv_cache(plain, reserve=3 * T)
    assert padded.capacity == PaddedKVCache.block
    bitwise = []
    for r in range(3):
        q, k, v = rand(1, Hq, T, D), rand(1, Hkv, T, D), rand(1, Hkv, T, D)
        x = mx.zeros((1, T, 1))
        outs = []
        for c in (plain, padded):
            mask = create_attention_mask(x, c)  # as the model does: before the update
            K, V = c.update_and_fetch(k, v)
            outs.append(scaled_dot_product_attention(q, K, V, c, D ** -0.5, mask))
        assert plain.offset == padded.offset.item()
        assert outs[0].dtype == outs[1].dtype == dtype
        assert mx.allclose(outs[0], outs[1], atol=1e-5 if dtype == mx.float32 else 1e-2)
        bitwise.append(mx.array_equal(outs[0], outs[1]).item())
        back = r % T  # roll back, leaving `back` stale entries past the offset
        plain.trim(back)
        padded.trim(mx.array(back, dtype=mx.int32))
    if OPENBLAS:
        pytest.skip("bitwise check: " + OPENBLAS_REASON)
    assert bitwise == [True] * 3
