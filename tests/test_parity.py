"""Greedy MTP output is token-identical to mlx_lm's greedy decoding.

The fixtures' random heads almost never draft right, so the accept and
partial-accept paths are driven by an OracleDrafter that proposes the true
continuation with a set accept rate; verify, GDN capture/commit, the KV
rollback and the head's cache rewrite all run for real. Every loop is
checked: pipelined (lookahead 1) and synchronous, compiled and eager.
"""

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

import mlx_lm
import mlx_mtp
from mlx_mtp.depth import DepthController
from mlx_mtp.testing.drafters import OracleDrafter
from mlx_mtp.decode import generate_tokens
from mlx_mtp.stats import MTPStats
from util import (LONG, SAME, SHORT, slow, assert_head_follows, assert_trunk_equal, mtp,
                  plain_cache, reference)

MODES = {"pipelined": {}, "sync": dict(lookahead=False), "eager": dict(compiled=False),
         "sync-eager": dict(lookahead=False, compiled=False)}


class Scripted(DepthController):
    """Depths from a fixed script (cycled): every transition, plain steps included."""

    def __init__(self, depths):
        super().__init__(max_depth=max(depths))
        self.script, self.i = depths, 0

    def next_depth(self):
        self.i += 1
        return self.script[(self.i - 1) % len(self.script)]


# the prompt prefilled in one step on the dense model, in chunks on each (the other
# one-step cases in the slow tier; test_oracle_parity runs both prompts on each model)
@pytest.mark.parametrize("name,prompt,step", [
    ("dense", SHORT, 2048), slow("dense_bf16", SHORT, 2048, id="short-dense_bf16"),
    slow("moe", SHORT, 2048, id="short-moe"), ("dense", LONG, 16),
    slow("dense_bf16", LONG, 16, id="chunked-dense_bf16"), ("moe", LONG, 16)], ids=["short-dense", "short-dense_bf16", "short-moe", "chunked-dense",
                             "chunked-dense_bf16", "chunked-moe"])
def test_real_head_parity(loaded, name, prompt, step):
    """The real head's drafts at every depth: tokens equal mlx_lm's, and the
    log-prob row of every token too (bit for bit with the bundled BLAS)."""
    model, ref_model, tok = loaded(name)
    ids = tok.encode(prompt)
    want, want_rows = reference(ref_model, ids, 33, step, rows=True)
    for k in [0, 1, 2, 3, 4, "auto"]:
        got, rows = mtp(model, ids, k, 33, prefill_step_size=step, rows=True)
        assert got == want, f"depth {k}"
        assert SAME(rows, want_rows), f"log-probs, depth {k}"
    assert mtp(model, ids, 2, 33, prefill_step_size=step, lookahead=False) == want


@pytest.mark.parametrize("name,rate", [  # every loop at each rate on one model, MoE partly
    slow("dense", 1.0), slow("dense", 0.6), slow("dense", 0.0), ("dense_bf16", 1.0),
    slow("dense_bf16", 0.6), ("dense_bf16", 0.0), slow("moe", 1.0), ("moe", 0.6), slow("moe", 0.0)])
def test_oracle_parity(loaded, name, rate):
    """Drafts right with probability `rate`: full, partial and no acceptance,
    in every loop (all four on the dense model). The default tier: full and
    none on bf16, partial on MoE."""
    model, ref_model, tok = loaded(name)
    V = model.vocab_size
    modes = MODES if name == "dense" else {"pipelined": {}}
    for prompt, step in [(SHORT, 2048), (LONG, 16)]:
        ids = tok.encode(prompt)
        # the oracle knows past max_tokens: the last cycle may draft beyond it
        ahead = reference(ref_model, ids, 44, step)
        want = ahead[:40]
        for k in [1, 2, 3, 4, "auto"]:
            for mode, kw in modes.items():
                stats = MTPStats()
                got = mtp(model, ids, k, 40, prefill_step_size=step, stats=stats,
                          drafter=OracleDrafter(ahead, rate, V, seed=3), **kw)
                assert got == want, f"depth {k} {mode}"
                if rate == 1.0 and k != "auto":
                    assert stats.acceptance == [1.0] * k
                if rate == 0.0:
                    assert stats.accepted == 0
                if rate == 0.6 and k != "auto":
                    assert 0 < stats.accepted < stats.drafted


def test_logits_processors(loaded):
    """Processors see each position's history (the synchronous loop)."""
    model, ref_model, tok = loaded("dense")
    V = model.vocab_size
    procs = make_logits_processors(logit_bias={5: 3.0}, repetition_penalty=1.5,
                                   repetition_context_size=8)
    ids = tok.encode(LONG)
    want = reference(ref_model, ids, processors=procs)
    for k in (1, 3, "auto"):
        got = mtp(model, ids, k, logits_processors=procs,
                  drafter=OracleDrafter(want, 0.7, V, seed=3))
        assert got == want


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11])
def test_max_tokens_never_exceeded(loaded, max_tokens):
    model, ref_model, tok = loaded("dense")
    V = model.vocab_size
    ids = tok.encode(SHORT)
    want = reference(ref_model, ids, max_tokens + 8)
    for k in (1, 4):
        for kw in MODES.values():
            got = mtp(model, ids, k, max_tokens, drafter=OracleDrafter(want, 1.0, V), **kw)
            assert got == want[:max_tokens]
    text = mlx_lm.generate(ref_model, tok, SHORT, max_tokens=max_tokens)
    out = list(mlx_mtp.stream_generate(model, tok, SHORT, max_tokens=max_tokens, draft_tokens=3))
    assert "".join(r.text for r in out) == text
    assert out[-1].generation_tokens == max_tokens
    assert out[-1].finish_reason == "length"


def test_eos_stops_like_mlx_lm(loaded, dense_ckpt):
    """EOS anywhere in a cycle's output (first, middle, last of its tokens):
    the output stops on it, as mlx_lm's does; the cycle queued behind it
    never reaches the caller."""
    model, ref_model, _ = loaded("dense")
    _, tok = mlx_mtp.load(dense_ckpt, quiet=True)
    _, ref_tok = mlx_lm.load(str(dense_ckpt))
    ids = tok.encode(SHORT)
    ref = reference(ref_model, ids, 30)
    own = set(tok.eos_token_ids)
    # depth 3, all accepted: cycles emit tokens 1-4, 5-8, ...: 5 is first, 6 in the middle,
    # 8 last of a cycle (a token seen earlier cannot be the EOS that stops there)
    stops = [i for i in (5, 6, 8, 9, 10, 12) if ref.index(ref[i]) == i]
    assert len(stops) >= 3
    for stop in stops:
        for t in (tok, ref_tok):
            t._eos_token_ids = own | {ref[stop]}
        want = list(mlx_lm.stream_generate(ref_model, ref_tok, SHORT, max_tokens=30))
        assert [r.token for r in want] == ref[:stop + 1]
        for k in (1, 2, 3):
            for kw in (MODES["pipelined"], MODES["sync"]):
                got = list(mlx_mtp.stream_generate(
                    model, tok, SHORT, max_tokens=30, draft_tokens=k,
                    drafter=OracleDrafter(ref, 1.0, model.vocab_size), **kw))
                assert [r.token for r in got] == ref[:stop + 1], f"depth {k}, EOS at {stop}"
                assert "".join(r.text for r in got) == "".join(r.text for r in want)
                assert got[-1].finish_reason == "stop" == want[-1].finish_reason
                assert got[-1].generation_tokens == stop + 1 == want[-1].generation_tokens
    for t in (tok, ref_tok):
        t._eos_token_ids = own


def test_random_sampler_is_called_per_token(loaded):
    """A sampler mlx_mtp cannot introspect is called once per verified
    position, as plain decoding calls it once per token (XTC, for one, draws
    one coin per call)."""
    model, ref_model, tok = loaded("dense")
    rows = []

    def sampler(logprobs):  # an opaque callable: match verification, eager
        rows.append(logprobs.shape[0])
        return mx.argmax(logprobs, axis=-1)

    ids = tok.encode(SHORT)
    with pytest.warns(UserWarning, match="introspected"):
        got = mtp(model, ids, 3, 20, sampler=sampler,
                  drafter=OracleDrafter(reference(ref_model, ids, 20), 0.7, model.vocab_size))
    assert got == reference(ref_model, ids, 20)
    assert len(rows) > 20 and set(rows) == {1}


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_one_host_sync_per_cycle(loaded, count_host_syncs, mode):
    """Each cycle is queued with one async_eval (and read with one transfer);
    the loop makes no other eval call. The first cycle is read before a
    second is queued, so the first token waits for no other cycle."""
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(SHORT)
    want = reference(ref_model, ids, 40)
    stats = MTPStats()
    gen = generate_tokens(mx.array(ids), model, max_tokens=-1, draft_tokens=3, stats=stats,
                          drafter=OracleDrafter(want, 0.5, model.vocab_size, seed=1),
                          **MODES[mode])
    calls = count_host_syncs()
    next(gen)  # the prompt (evaluated) and the first cycle
    assert calls.count("async_eval") == 1 and stats.cycles == 1
    start, queued = stats.cycles, calls.count("async_eval")
    evals = calls.count("eval")
    got = [next(gen)[0] for _ in range(20)]
    assert got == want[1:21]
    assert calls.count("eval") == evals
    # as many cycles queued as read (pipelined: one more, queued ahead of the reads)
    ahead = 1 if mode == "pipelined" else 0
    assert calls.count("async_eval") - queued == stats.cycles - start + ahead
    gen.close()


@pytest.mark.parametrize("rate", [None, 0.5, slow(0.95)])
def test_auto_depth_parity(loaded, rate):
    """draft_tokens='auto' switches depth (0 included) between cycles; the
    head catches up on the plain steps' pairs; the output stays identical."""
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(LONG)
    want = reference(ref_model, ids, 120)

    class ModelCost(DepthController):
        # deterministic cycle costs (decode units): timing noise on a busy
        # machine must not decide what this test checks
        def update_cost(self, k, seconds):  # deeper drafting clearly pays at 0.95
            super().update_cost(k, 1.0 + 0.1 * k)

    ctl = ModelCost(max_depth=4, probe_every=4)
    drafter = OracleDrafter(want, rate, model.vocab_size, seed=5) if rate is not None else None
    got = mtp(model, ids, "auto", 120, drafter=drafter, controller=ctl)
    assert got == want
    assert len(ctl.cost) >= 2  # it did move between depths
    if rate is None:  # the random head never pays: plain decoding wins
        assert ctl.k == 0
    if rate == 0.95:
        assert ctl.k >= 3


@pytest.mark.parametrize("mode,rate", [  # sync-eager's edges: in the slow tier
    ("pipelined", 0.0), ("pipelined", 0.5), ("pipelined", 1.0), slow("sync-eager", 0.0),
    ("sync-eager", 0.5), slow("sync-eager", 1.0)])
def test_cache_after_call_is_plain_decodings(loaded, mode, rate):
    """After cycles of mixed depths (plain steps, ring flushes and every
    accept pattern), the prompt cache is what mlx_lm's plain decoding leaves:
    trunk bit for bit, the head's pairs over the trunk's own hiddens, and the
    last hidden; nothing drafted or rejected."""
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(LONG)
    want = reference(ref_model, ids, 60, step=32)
    script = [3, 1, 0, 2, 3, 0, 0, 3, 2, 1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4]
    for max_tokens in (7, 23, 60):
        cache = model.make_cache()
        stats = MTPStats()
        got = mtp(model, ids, "auto", max_tokens, prefill_step_size=32, prompt_cache=cache,
                  controller=Scripted(script), stats=stats,
                  drafter=OracleDrafter(want, rate, model.vocab_size, seed=7), **MODES[mode])
        assert got == want[:max_tokens]
        context = ids + got
        assert_trunk_equal(cache, plain_cache(ref_model, context, step=32), f"{max_tokens}")
        assert_head_follows(model, cache, context)
    if rate == 1.0:
        assert stats.acceptance[:3] == [1.0] * 3
    if rate == 0.0:
        assert stats.accepted == 0
