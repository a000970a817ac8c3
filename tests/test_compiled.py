"""Compiled graphs and cache capacity.

A step runs through a graph compiled once per (step, depth, mode) and kept
on the model, so later generations do not retrace; MLX retraces only when a
KV buffer grows by a block. Buffers grow in blocks as the context does
(max_tokens reserves nothing), and attention never runs over more than one
block past the live length.
"""

import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generation_stream
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

import mlx_mtp
import mlx_mtp.cache as cache_mod
from mlx_mtp.cache import PaddedKVCache, capacity_for
from mlx_mtp.testing.drafters import OracleDrafter
from util import LONG, OPENBLAS, SHORT, mtp, reference


def traces_by_depth(model):
    out = {}
    for key, n in model.runtime.traces.items():
        out[(key[0], key[1])] = out.get((key[0], key[1]), 0) + n
    return out


def test_two_generations_trace_each_depth_once(loaded):
    """Two generations in a row (and a third continuing a prompt cache) trace
    each depth's graph once in total."""
    model, ref_model, tok = loaded("dense")
    model.runtime.clear()
    for k in (1, 2, 3, "auto"):
        cache = model.make_cache()
        for prompt in (SHORT, LONG):
            ids = tok.encode(prompt)
            assert mtp(model, ids, k, 30) == reference(ref_model, ids, 30)
        mtp(model, tok.encode(SHORT), k, 20, prompt_cache=cache)
        mtp(model, tok.encode(LONG), k, 20, prompt_cache=cache)
    assert {("cycle", 1), ("cycle", 2), ("cycle", 3)} <= set(traces_by_depth(model))
    # one graph per depth and mode (fixed depths, and auto's with the ring)
    assert all(n == 1 for n in model.runtime.traces.values()), model.runtime.traces


def test_a_process_first_graph_runs_are_eager_on_the_cpu(loaded, monkeypatch):
    """On MLX's CPU backend a model's first params.CPU_EAGER_RUNS graph runs
    are eager (their kernels would otherwise be compiled with the C++
    compiler before the first token), then every graph is compiled at its
    first use; the tokens are mlx_lm's either way."""
    from mlx_mtp import params
    from mlx_mtp.model import Runtime

    model, ref_model, tok = loaded("dense")
    monkeypatch.setattr(params, "CPU_EAGER_RUNS", 5)
    monkeypatch.setattr(model, "runtime", Runtime())
    cpu = mx.default_device() == mx.cpu
    ids = tok.encode(LONG)
    assert mtp(model, ids, 2, 4) == reference(ref_model, ids, 4)  # 1-3 cycles: none compiled
    if cpu:
        assert not model.runtime.traces and 0 < model.runtime.eager_runs <= 5
    assert mtp(model, ids, 2, 40) == reference(ref_model, ids, 40)
    assert traces_by_depth(model).get(("cycle", 2)) == 1
    assert model.runtime.eager_runs == (5 if cpu else 0)
    assert mtp(model, ids, 1, 20) == reference(ref_model, ids, 20)
    assert traces_by_depth(model).get(("cycle", 1)) == 1  # (compiled at its first use)
    assert model.runtime.eager_runs == (5 if cpu else 0)


def test_retrace_only_when_capacity_grows(loaded, monkeypatch):
    """Unbounded generation: one trace per distinct buffer capacity."""
    monkeypatch.setattr(cache_mod, "BLOCK", 32)
    model, ref_model, tok = loaded("dense")
    model.runtime.clear()
    ids = tok.encode(SHORT)
    want = reference(ref_model, ids, 330)
    cache = model.make_cache()
    got = mtp(model, ids, 2, -1, take=330, prompt_cache=cache,
              drafter=OracleDrafter(want, 0.7, model.vocab_size, seed=2))
    assert got == want
    length = len(ids) + 330
    # mlx_lm's prefill buffer (256), then whole blocks as the context grew
    capacities = {256} | {capacity_for(n) for n in range(257, length + 4)}
    assert cache[3].keys.shape[2] == max(capacities) <= capacity_for(length + 3)
    assert 2 <= traces_by_depth(model)[("cycle", 2)] <= len(capacities)


def test_conversation_retraces_only_per_capacity_block(loaded):
    """mlx_lm's prefill leaves buffers of any length; they are re-cut to whole
    blocks, so a conversation retraces only when the context crosses one."""
    model, _, tok = loaded("dense")
    model.runtime.clear()
    cache, length = model.make_cache(), 0
    lengths = []
    for turn in range(7):
        ids = tok.encode(LONG)
        mtp(model, ids, 2, 10, prompt_cache=cache)
        length += len(ids) + 10
        lengths.append(length)
    blocks = {capacity_for(n + 3) for n in lengths} | {capacity_for(len(tok.encode(LONG)) + 1)}
    assert traces_by_depth(model)[("cycle", 2)] <= len(blocks) < len(lengths)


def test_max_tokens_reserves_nothing(loaded):
    """A huge max_tokens costs what a small one does (buffers follow the context)."""
    model, _, tok = loaded("dense")
    ids = tok.encode(SHORT)
    times = {}
    for max_tokens in (30, 10**9):
        cache = model.make_cache()
        t0 = time.perf_counter()
        mtp(model, ids, 2, max_tokens, take=20, prompt_cache=cache)
        times[max_tokens] = time.perf_counter() - t0
        assert cache[3].keys.shape[2] == 256
    assert times[10**9] < 5 * times[30] + 1


def test_capacity_for():
    assert [capacity_for(n) for n in (1, 256, 257, 2048, 2049, 4097, 10000)] == \
        [256, 256, 512, 2048, 2304, 4608, 10240]
    for n in range(1, 40000, 97):
        c = capacity_for(n)
        assert n <= c <= n + max(256, n // 8)


@pytest.mark.parametrize("k", [1, 3])
def test_compiled_sampling_matches_eager(loaded, k):
    """Same seed, same keys split in the same order: identical samples."""
    model, _, tok = loaded("dense")
    ids = tok.encode(LONG)
    runs = [mtp(model, ids, k, 40, sampler=mlx_mtp.make_sampler(0.9, top_p=0.95), seed=11,
                compiled=compiled) for compiled in (False, True)]
    assert runs[0] == runs[1]


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
    padded = PaddedKVCache(mx.array(plain.keys), mx.array(plain.values),
                           mx.array([n], dtype=mx.int32)).grown(n + 3 * T)  # buffers of its own
    bitwise = []
    for r in range(3):
        q, k, v = rand(1, Hq, T, D), rand(1, Hkv, T, D), rand(1, Hkv, T, D)
        x = mx.zeros((1, T, 1))
        outs = []
        for c in (plain, padded):
            mask = create_attention_mask(x, c)  # as the model does: before the update
            K, V = c.update_and_fetch(k, v)
            outs.append(scaled_dot_product_attention(q, K, V, c, D ** -0.5, mask))
        assert plain.offset == padded.lengths.item()
        assert outs[0].dtype == outs[1].dtype == dtype
        assert mx.allclose(outs[0], outs[1], atol=1e-5 if dtype == mx.float32 else 1e-2)
        bitwise.append(mx.array_equal(outs[0], outs[1]).item())
        back = r % T  # roll back, leaving `back` stale entries past the length
        plain.trim(back)
        padded.trim(mx.array([back], dtype=mx.int32))
    if OPENBLAS:
        pytest.skip("bitwise check needs MLX's bundled BLAS")
    assert bitwise == [True] * 3


def test_per_row_lengths():
    """Rows of one buffer write and mask at their own lengths (batching)."""
    D = 4
    keys = mx.zeros((2, 1, 8, D))
    c = PaddedKVCache(keys, keys, mx.array([2, 5], dtype=mx.int32))
    new = mx.arange(2 * 2 * D, dtype=mx.float32).reshape(2, 1, 2, D) + 1
    K, _ = c.update_and_fetch(new, new)
    assert mx.array_equal(K[0, :, 2:4], new[0]) and mx.array_equal(K[1, :, 5:7], new[1])
    assert not mx.any(K[0, :, 4:]).item() and not mx.any(K[1, :, :5]).item()
    assert c.lengths.tolist() == [4, 7]
    mask = PaddedKVCache(keys, keys, mx.array([2, 5], dtype=mx.int32)).make_mask(2)
    assert mask.shape == (2, 1, 2, 8)
    assert mask[0, 0].sum(axis=-1).tolist() == [3, 4] and mask[1, 0].sum(axis=-1).tolist() == [6, 7]
    c.trim(mx.array([1, 3], dtype=mx.int32))
    assert c.lengths.tolist() == [3, 4]


def test_memory_kv_held_once_and_released(tmp_path):
    """While decoding, the KV buffers exist once (the prompt cache's objects
    hand them over, no copy stays alive); generations leave nothing behind,
    without gc.collect (no reference cycles keep a finished one's arrays)."""
    from mlx_mtp.testing.synthetic import write_checkpoint

    path = write_checkpoint(tmp_path / "kv", seed=4, text_overrides={  # big KV, little else
        "num_hidden_layers": 2, "full_attention_interval": 2, "num_key_value_heads": 8,
        "num_attention_heads": 8, "head_dim": 256})
    model, _ = mlx_mtp.load(path, quiet=True)
    ids = mx.array(list(range(3, 250)) * 2)  # ~500 tokens, 32 KiB of KV each (trunk + head)
    list(mlx_mtp.generate_step(ids[:20], model, max_tokens=8, draft_tokens=2))  # graphs, allocator
    mx.clear_cache()
    base = mx.get_active_memory()
    for _ in range(2):
        cache = model.make_cache()
        gen = mlx_mtp.generate_step(ids, model, max_tokens=40, draft_tokens=2, prompt_cache=cache)
        for _ in range(12):
            next(gen)
        during = mx.get_active_memory() - base
        gen.close()
        kv = sum(x.nbytes for c in cache if isinstance(c, KVCache) for x in (c.keys, c.values))
        assert kv > 10e6 and during < 1.25 * kv, (during, kv)
        del cache, gen
        mx.synchronize(generation_stream)
        assert mx.get_active_memory() - base < 0.05 * kv
