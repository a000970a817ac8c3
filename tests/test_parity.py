"""Greedy MTP output must be token-identical to mlx_lm greedy decoding.

The random heads of the fixtures almost never draft right, so the accept and
partial-accept paths are driven by an oracle drafter that proposes the true
continuation with a set accept rate; verify, GDN capture/commit, KV trimming
and the head-cache rewrite all run for real.
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from mlx_mtp import stream_generate
from mlx_mtp.decode import MTPDecoder, MTPStats, OracleDrafter, mtp_generate_step

SHORT = "def f(x):"
LONG = "import os\nclass Spam(object):\n    def eggs(self, n):\n        return [i * n for i in range(n)]\n"


def reference(ref_model, tok, prompt, max_tokens=40, prefill_step_size=2048, processors=None):
    p = mx.array(tok.encode(prompt))
    return [t for t, _ in generate_step(p, ref_model, max_tokens=max_tokens,
                                        prefill_step_size=prefill_step_size,
                                        logits_processors=processors)]


def mtp_tokens(model, tok, prompt, k, max_tokens=40, oracle=None, prefill_step_size=2048,
               processors=None, stats=None):
    p = mx.array(tok.encode(prompt))
    return [t for t, _, _ in mtp_generate_step(
        p, model, max_tokens=max_tokens, draft_tokens=k, oracle=oracle,
        prefill_step_size=prefill_step_size, logits_processors=processors, stats=stats)]


@pytest.mark.parametrize("name", ["dense", "dense_bf16", "moe"])
@pytest.mark.parametrize("prompt,step", [(SHORT, 2048), (LONG, 16)])
def test_real_head_parity(loaded, name, prompt, step):
    model, ref_model, tok = loaded(name)
    ref = reference(ref_model, tok, prompt, prefill_step_size=step)
    for k in range(0, 5):
        assert mtp_tokens(model, tok, prompt, k, prefill_step_size=step) == ref, f"depth {k}"


@pytest.mark.parametrize("name", ["dense", "dense_bf16", "moe"])
@pytest.mark.parametrize("rate", [1.0, 0.6, 0.0])
def test_oracle_parity(loaded, name, rate):
    model, ref_model, tok = loaded(name)
    V = model.language_model.args.vocab_size
    for prompt, step in [(SHORT, 2048), (LONG, 16)]:
        ref = reference(ref_model, tok, prompt, prefill_step_size=step)
        for k in range(1, 5):
            stats = MTPStats()
            got = mtp_tokens(model, tok, prompt, k, oracle=OracleDrafter(ref, rate, V, seed=k),
                             prefill_step_size=step, stats=stats)
            assert got == ref, f"depth {k} rate {rate}"
            if rate == 1.0:
                assert stats.acceptance == [1.0] * k
            if rate == 0.0:
                assert stats.accepted == 0


def test_oracle_parity_with_logits_processor(loaded):
    model, ref_model, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    procs = make_logits_processors(logit_bias={5: 3.0}, repetition_penalty=1.5,
                                   repetition_context_size=8)
    ref = reference(ref_model, tok, LONG, processors=procs)
    for k in (1, 3):
        got = mtp_tokens(model, tok, LONG, k, oracle=OracleDrafter(ref, 0.7, V, seed=3),
                         processors=procs)
        assert got == ref


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11])
def test_max_tokens_never_exceeded(loaded, max_tokens):
    model, ref_model, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    ref = reference(ref_model, tok, SHORT, max_tokens=max_tokens + 8)
    for k in (1, 4):
        got = mtp_tokens(model, tok, SHORT, k, max_tokens=max_tokens,
                         oracle=OracleDrafter(ref, 1.0, V))
        assert got == ref[:max_tokens]
    import mlx_lm

    want = mlx_lm.generate(ref_model, tok, SHORT, max_tokens=max_tokens)
    out = list(stream_generate(model, tok, SHORT, max_tokens=max_tokens, draft_tokens=3))
    assert "".join(r.text for r in out) == want
    assert out[-1].generation_tokens == max_tokens
    assert out[-1].finish_reason == "length"


def test_eos_stops_like_mlx_lm(loaded, dense_ckpt):
    import mlx_lm

    import mlx_mtp

    model, ref_model, _ = loaded("dense")
    _, tok = mlx_mtp.load(dense_ckpt)
    _, ref_tok = mlx_lm.load(str(dense_ckpt))
    ref = reference(ref_model, tok, SHORT, max_tokens=30)
    eos = ref[9]
    first = ref.index(eos)
    for t in (tok, ref_tok):
        t._eos_token_ids = set(t.eos_token_ids) | {eos}
    want = list(mlx_lm.stream_generate(ref_model, ref_tok, SHORT, max_tokens=30))
    for k in (1, 2, 4):
        got = list(stream_generate(model, tok, SHORT, max_tokens=30, draft_tokens=k))
        assert "".join(r.text for r in got) == "".join(r.text for r in want)
        assert got[-1].finish_reason == "stop" == want[-1].finish_reason
        assert got[-1].generation_tokens == first + 1 == want[-1].generation_tokens


def _plain_cache_after(ref_model, prompt_ids, emitted, step=2048):
    """mlx_lm caches after plain decoding fed the prompt and emitted[:-1]."""
    cache = make_prompt_cache(ref_model)
    p = mx.array(prompt_ids)
    for s in range(0, len(prompt_ids) - 1, step):
        ref_model(p[s:min(s + step, len(prompt_ids) - 1)][None], cache=cache)
    ref_model(p[-1:][None], cache=cache)
    for t in emitted[:-1]:
        ref_model(mx.array([[t]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_rollback_leaves_caches_as_plain_decoding(loaded, rate):
    """After any accept pattern, every trunk cache (GDN conv window and state,
    attention K/V) equals plain decoding's, bit for bit; and the head's cache
    equals the head run over the trunk's own hiddens (not its drafts')."""
    model, ref_model, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    ids = tok.encode(LONG)
    ref = reference(ref_model, tok, LONG, max_tokens=30)
    dec = MTPDecoder(model, oracle=OracleDrafter(ref, rate, V, seed=7))
    y, _ = dec.prefill(mx.array(ids))
    emitted = [y.item()]
    while len(emitted) < 20:
        toks, _, _ = dec.cycle(3)
        emitted += toks
    assert emitted == ref[:len(emitted)]
    plain = _plain_cache_after(ref_model, ids, emitted)
    for mine, want in zip(dec.cache, plain):
        if hasattr(want, "offset"):
            assert mine.offset == want.offset
            n = want.offset
            assert mx.array_equal(mine.keys[..., :n, :], want.keys[..., :n, :])
            assert mx.array_equal(mine.values[..., :n, :], want.values[..., :n, :])
        else:
            assert mx.array_equal(mine[0], want[0]), "conv window"
            assert mx.array_equal(mine[1], want[1]), "GDN state"

    # head cache: pairs (h_p, tok_{p+1}) for every fed position p
    seq = mx.array(ids + emitted)
    h = model.trunk_hidden(seq[None, :-1], None)
    fresh = model.mtp.make_cache()
    model.mtp(h, model.embed(seq[None, 1:]), fresh)
    n = seq.size - 1
    for mine, want in zip(dec.head_cache, fresh):
        assert mine.offset == want.offset == n
        assert mx.allclose(mine.keys[..., :n, :], want.keys[..., :n, :], atol=1e-4)
        assert mx.allclose(mine.values[..., :n, :], want.values[..., :n, :], atol=1e-4)


def test_one_host_sync_per_cycle(loaded, count_host_syncs):
    model, ref_model, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    ref = reference(ref_model, tok, SHORT, max_tokens=30)
    dec = MTPDecoder(model, oracle=OracleDrafter(ref, 0.5, V, seed=1))
    dec.prefill(mx.array(tok.encode(SHORT)))
    calls = count_host_syncs()
    for _ in range(5):
        dec.cycle(3)
    assert len(calls) == 5


@pytest.mark.parametrize("rate", [None, 0.5, 0.95])
def test_auto_depth_parity(loaded, rate):
    """draft_tokens='auto' switches depth (0 included) between cycles; the
    head catches up on the pairs of plain steps; output stays identical."""
    from mlx_mtp.depth import DepthController

    model, ref_model, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    ref = reference(ref_model, tok, LONG, max_tokens=120)
    class ModelCostController(DepthController):
        # deterministic cycle costs (decode units): timing noise on a busy
        # machine must not decide what this test checks
        def update_cost(self, k, seconds):
            super().update_cost(k, 1.0 + 0.3 * k)

    ctl = ModelCostController(max_depth=4, probe_every=4)
    oracle = OracleDrafter(ref, rate, V, seed=5) if rate is not None else None
    p = mx.array(tok.encode(LONG))
    got = [t for t, _, _ in mtp_generate_step(p, model, max_tokens=120, draft_tokens="auto",
                                              oracle=oracle, controller=ctl)]
    assert got == ref
    assert len(ctl.cost) >= 2  # it did move between depths
    if rate is None:  # the random head never pays: plain decoding wins
        assert ctl.k == 0
    if rate == 0.95:
        assert ctl.k >= 3
