"""prompt_cache across calls: mlx_lm's semantics, exactly.

Turn after turn, each call prefills only its new prompt; its tokens equal
mlx_lm's with mlx_lm's own cache, and the cache afterwards holds exactly what
mlx_lm's does (the trunk bit for bit, the head's pairs over the trunk's own
hiddens; nothing drafted or rejected), whatever ended the call: max_tokens in
the middle of a cycle, EOS, a cycle queued past the stop.
"""

import copy
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (can_trim_prompt_cache, load_prompt_cache, make_prompt_cache,
                                 save_prompt_cache, trim_prompt_cache)

import mlx_lm
import mlx_mtp
from mlx_mtp.depth import DepthController
from mlx_mtp.testing.drafters import OracleDrafter
from mlx_mtp.stats import MTPStats
from util import (LONG, SHORT, assert_head_follows, assert_trunk_equal, mtp, plain_cache, reference,
                  row_tokens, slow)

TURNS = [LONG, "    def ham(self):\n        return", "\nclass Eggs(Spam):\n"]
MAX_TOKENS = [9, 5, 17]


def mlx_lm_turns(ref_model, turns, max_tokens=MAX_TOKENS, cache=None):
    """mlx_lm.generate_step over the turns with its own cache: tokens per turn."""
    cache = make_prompt_cache(ref_model) if cache is None else cache
    return [reference(ref_model, t, m, prompt_cache=cache) for t, m in zip(turns, max_tokens)], cache


def turns_ahead(ref_model, turns, max_tokens=MAX_TOKENS, extra=8):
    """Each turn's continuation a few tokens past its max_tokens (an oracle
    drafter's table: a cycle near the end may draft past max_tokens)."""
    cache, out = make_prompt_cache(ref_model), []
    for t, m in zip(turns, max_tokens):
        out.append(reference(ref_model, t, m + extra, prompt_cache=copy.deepcopy(cache)))
        reference(ref_model, t, m, prompt_cache=cache)
    return out


RUNS = [(k, 0.7) for k in (1, 2, 3, "auto")] + [(2, None), (3, 1.0)]  # (depth, oracle rate)
FEW_RUNS = {"dense": [(3, 0.7), ("auto", 0.7), (2, None), (3, 1.0)], "moe": [(3, 0.7), (2, None)]}


# the default tier: drafts partly accepted, auto, the head's own drafts and
# all accepted on the dense model, two of those on MoE; every run in the slow tier
@pytest.mark.parametrize("name,every", [
    ("dense", False), slow("dense", True, id="dense-every"), slow("dense_bf16", True),
    ("moe", False), slow("moe", True, id="moe-every"), slow("q4", True)],
    ids=["dense", "dense-every", "dense_bf16", "moe", "moe-every", "q4"])
def test_multi_turn_greedy(loaded, name, every):
    model, ref_model, tok = loaded(name)
    turns = [tok.encode(t) for t in TURNS]
    want, _ = mlx_lm_turns(ref_model, turns)
    ahead = turns_ahead(ref_model, turns)
    runs = RUNS if every else FEW_RUNS[name]
    for k, rate in runs:
        cache = model.make_cache()
        ref_cache = make_prompt_cache(ref_model)
        context = []
        for i, (t, m) in enumerate(zip(turns, MAX_TOKENS)):
            drafter = OracleDrafter(ahead[i], rate, model.vocab_size, seed=i) if rate else None
            stats = MTPStats()
            # auto drafting from the start (a controller the earlier tests left
            # parked would skip the head's prefill: test_parked_prefill_skips_the_head)
            ctl = DepthController() if k == "auto" else None
            got = mtp(model, t, k, m, prompt_cache=cache, drafter=drafter, stats=stats,
                      controller=ctl)
            assert got == want[i], f"{name} depth {k} oracle {rate}, turn {i}"
            if rate == 1.0:
                assert stats.acceptance == [1.0] * k
            reference(ref_model, t, m, prompt_cache=ref_cache)
            context += t + got
            assert_trunk_equal(cache, ref_cache, f"{name} depth {k}, after turn {i}")
            assert_head_follows(model, cache, context)


def test_eos_and_stop_points_leave_exact_caches(loaded, dense_ckpt):
    """EOS first, in the middle and last of a cycle's tokens, through
    stream_generate (the caller stops; the generator is closed), in both
    loops: the next turn still equals mlx_lm's."""
    model, ref_model, _ = loaded("dense")
    _, tok = mlx_mtp.load(dense_ckpt, quiet=True)
    turns = [tok.encode(t) for t in TURNS[:2]]
    first = reference(ref_model, turns[0], 20)
    own = set(tok.eos_token_ids)
    # depth 3, all accepted: cycles emit tokens 1-4, 5-8, ...: 5 is the first of a
    # cycle, 6 in the middle, 8 the last (a token seen earlier cannot stop there)
    stops = [i for i in (5, 6, 8, 9, 10, 12) if first.index(first[i]) == i]
    assert len(stops) >= 3
    for stop in stops:
        eos = first[stop]
        tok._eos_token_ids = own | {eos}
        ref_cache = make_prompt_cache(ref_model)
        want0 = [r.token for r in mlx_lm.stream_generate(ref_model, tok, turns[0], max_tokens=20,
                                                          prompt_cache=ref_cache)]
        want1 = [r.token for r in mlx_lm.stream_generate(ref_model, tok, turns[1], max_tokens=8,
                                                          prompt_cache=ref_cache)]
        for lookahead in (True, False):
            cache = model.make_cache()
            got0 = [r.token for r in mlx_mtp.stream_generate(
                model, tok, turns[0], max_tokens=20, draft_tokens=3, prompt_cache=cache,
                lookahead=lookahead, drafter=OracleDrafter(first, 1.0, model.vocab_size))]
            assert got0 == want0 and got0[-1] == eos
            got1 = [r.token for r in mlx_mtp.stream_generate(
                model, tok, turns[1], max_tokens=8, draft_tokens=3, prompt_cache=cache,
                lookahead=lookahead)]
            assert got1 == want1, f"EOS at {stop}, lookahead {lookahead}"
            assert_trunk_equal(cache, ref_cache)
    tok._eos_token_ids = own


def test_consumer_stops_early(loaded):
    """A caller that stops reading (close) after any token: the cache holds
    the prompt and exactly the tokens it read."""
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(LONG)
    want = reference(ref_model, ids, 30)
    for take in (1, 2, 5, 8, 13):
        cache = model.make_cache()
        got = mtp(model, ids, 3, -1, take=take, prompt_cache=cache,
                  drafter=OracleDrafter(want, 0.8, model.vocab_size, seed=take))
        assert got == want[:take]
        assert_trunk_equal(cache, plain_cache(ref_model, ids + got))
        assert_head_follows(model, cache, ids + got)


def test_max_tokens_zero_leaves_the_prompt(loaded):
    """generate_step(max_tokens=0) yields nothing and caches the prompt, as mlx_lm's."""
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(SHORT)
    cache, ref_cache = model.make_cache(), make_prompt_cache(ref_model)
    assert list(mlx_mtp.generate_step(mx.array(ids), model, max_tokens=0, prompt_cache=cache)) == []
    assert reference(ref_model, ids, 0, prompt_cache=ref_cache) == []
    assert_trunk_equal(cache, ref_cache)
    assert_head_follows(model, cache, ids)
    want, _ = mlx_lm_turns(ref_model, [tok.encode(TURNS[1])], [6], ref_cache)
    assert mtp(model, tok.encode(TURNS[1]), 2, 6, prompt_cache=cache) == want[0]


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_multi_turn_sampling(loaded, tmp_path, name):
    """Seeded sampling across turns: every yielded log-prob row is mlx_lm's
    teacher-forced one over the same context with mlx_lm's cache (so each
    turn samples from exactly mlx_lm's distribution); at a fixed depth runs
    repeat with the seed and pipelined == synchronous (adaptive depth follows
    timings, so its tokens vary); a cache saved after turn 1 and loaded back
    continues identically."""
    model, ref_model, tok = loaded(name)
    turns = [tok.encode(t) for t in TURNS]
    sampler = mlx_mtp.make_sampler(temp=10.0)  # the random head's drafts are often accepted

    def run(cache, k, seed0, lookahead=True, first=0, save_after=None):
        out = []
        for i, t in enumerate(turns[first:], start=first):
            stats = MTPStats()
            got, rows = mtp(model, t, k, MAX_TOKENS[i], rows=True, prompt_cache=cache,
                            sampler=sampler, seed=seed0 + i, lookahead=lookahead, stats=stats)
            out.append((got, rows, stats))
            if save_after == i:
                save_prompt_cache(str(tmp_path / "turn.safetensors"), cache)
        return out

    for k in (2, "auto"):
        runs = run(model.make_cache(), k, 100)
        ref_cache = make_prompt_cache(ref_model)
        for i, (t, (got, rows, _)) in enumerate(zip(turns, runs)):
            seq = mx.array(t + got[:-1])
            logits = ref_model(seq[None], cache=ref_cache)[0, len(t) - 1:].astype(mx.float32)
            ref_model(mx.array(got[-1:])[None], cache=ref_cache)  # mlx_lm feeds the last one too
            want = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            assert mx.allclose(rows, want, atol=1e-4), f"depth {k}, turn {i}"
        if k == "auto":  # its depths follow measured timings: tokens vary, rows stay exact
            continue
        accepted = sum(s.accepted for _, _, s in runs)
        assert 0 < accepted < sum(s.drafted for _, _, s in runs)  # accepts and rejections
        assert [r[0] for r in run(model.make_cache(), k, 100)] == [r[0] for r in runs]
        assert [r[0] for r in run(model.make_cache(), k, 100, lookahead=False)] == [r[0] for r in runs]
        assert [r[0] for r in run(model.make_cache(), k, 200)] != [r[0] for r in runs]
    # save after turn 1, load, continue: identical turns 2 and 3
    live = run(model.make_cache(), 3, 300, save_after=0)
    loaded_cache = load_prompt_cache(str(tmp_path / "turn.safetensors"))
    again = run(loaded_cache, 3, 300, first=1)
    assert [r[0] for r in again] == [r[0] for r in live[1:]]


def test_save_load_greedy(loaded, tmp_path):
    """mlx_lm's save_prompt_cache / load_prompt_cache round-trip the whole
    MTP cache; the loaded one continues exactly like the live one."""
    model, ref_model, tok = loaded("moe")
    turns = [tok.encode(t) for t in TURNS]
    want, _ = mlx_lm_turns(ref_model, turns)
    cache = model.make_cache()
    assert mtp(model, turns[0], 2, MAX_TOKENS[0], prompt_cache=cache) == want[0]
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache, {"model": "moe"})
    back, meta = load_prompt_cache(path, return_metadata=True)
    assert meta["model"] == "moe" and len(back) == len(cache)
    for c in (cache, back):
        for i in (1, 2):
            drafter = OracleDrafter(want[i], 0.8, model.vocab_size, seed=i)
            assert mtp(model, turns[i], 3, MAX_TOKENS[i], prompt_cache=c, drafter=drafter) == want[i]
    n = len(model.is_linear)
    assert_trunk_equal(back[:n], cache[:n])
    assert_trunk_equal(back[n:-1], cache[n:-1])  # the head's KV
    assert mx.array_equal(back[-1][0], cache[-1][0])  # the last hidden


def test_trunk_only_cache(loaded):
    """A cache mlx_lm filled for its own model (no head entries) is accepted:
    the output stays exact, the head's entries are appended to the list and
    start at the new prompt (the head has no history for the cached prefix)."""
    model, ref_model, tok = loaded("dense")
    turns = [tok.encode(t) for t in TURNS]
    ref_cache = make_prompt_cache(ref_model)
    first = reference(ref_model, turns[0], MAX_TOKENS[0], prompt_cache=ref_cache)
    mine = make_prompt_cache(ref_model)
    reference(ref_model, turns[0], MAX_TOKENS[0], prompt_cache=mine)
    n_trunk = len(mine)
    want, _ = mlx_lm_turns(ref_model, turns[1:], MAX_TOKENS[1:], ref_cache)
    for i, t in enumerate(turns[1:]):
        got = mtp(model, t, 2, MAX_TOKENS[i + 1], prompt_cache=mine,
                  drafter=OracleDrafter(want[i], 0.7, model.vocab_size, seed=i))
        assert got == want[i]
    assert len(mine) == n_trunk + len(model.mtp.layers) + 1
    assert_trunk_equal(mine, ref_cache)
    context = turns[0] + first + turns[1] + want[0] + turns[2] + want[1]
    assert_head_follows(model, mine, context, since=len(turns[0]) + len(first))


def test_mlx_lm_cache_helpers(loaded):
    """make_prompt_cache(model) is mlx_lm's own trunk cache (mlx_lm's
    generation and batching run on the model unchanged); mlx_mtp's first call
    appends the head's entries; trim/can_trim answer as for mlx_lm's own
    hybrid caches (GDN states cannot drop tokens); nbytes counts every entry."""
    model, ref_model, tok = loaded("dense")
    cache = make_prompt_cache(model)
    n_trunk = len(model.is_linear)
    assert len(cache) == n_trunk
    ids = tok.encode(SHORT)
    assert reference(model, ids, 8, prompt_cache=cache) == reference(ref_model, ids, 8)
    prompts = [tok.encode(SHORT), tok.encode(LONG)]
    got = mlx_lm.batch_generate(model, tok, prompts, max_tokens=6, verbose=False)
    assert got.texts == mlx_lm.batch_generate(ref_model, tok, prompts, max_tokens=6,
                                              verbose=False).texts
    assert can_trim_prompt_cache(cache) == can_trim_prompt_cache(make_prompt_cache(ref_model))
    assert not can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 2) == 0
    mtp(model, tok.encode(TURNS[1]), 2, 4, prompt_cache=cache)
    assert len(cache) == n_trunk + len(model.mtp.layers) + 1
    assert sum(c.nbytes for c in cache) > 0


def test_a_second_generation_on_an_open_cache_is_refused(loaded):
    """Two generations on one cache would each write their own state into
    it: while one is open (the caller stopped reading but kept it), a
    second is refused with one line; once the first is closed the cache
    holds what was read, and the next turn equals mlx_lm's."""
    model, ref_model, tok = loaded("dense")
    turns = [tok.encode(t) for t in TURNS[:2]]
    cache, ref_cache = model.make_cache(), make_prompt_cache(ref_model)
    first = reference(ref_model, turns[0], 7, prompt_cache=ref_cache)
    gen = mlx_mtp.generate_step(mx.array(turns[0]), model, max_tokens=30, prompt_cache=cache,
                                draft_tokens=3)
    assert [next(gen)[0] for _ in range(7)] == first
    with pytest.raises(ValueError, match="in use by a generation that is still open"):
        mtp(model, turns[1], 2, 9, prompt_cache=cache)
    with pytest.raises(ValueError, match="still open"):
        list(mlx_mtp.stream_generate(model, tok, turns[1], max_tokens=3, prompt_cache=cache))
    gen.close()
    want = reference(ref_model, turns[1], 9, prompt_cache=ref_cache)
    assert mtp(model, turns[1], 2, 9, prompt_cache=cache) == want
    assert_trunk_equal(cache, ref_cache)


def test_open_generations_are_forgotten(loaded):
    """The loop remembers the generation open on a cache only while both
    live: a finished one is forgotten, and a cache its caller dropped drops
    its entry (no registry grows with requests)."""
    import gc

    from mlx_mtp.held_cache import HeldCache

    model, _, tok = loaded("dense")
    ids = mx.array(tok.encode(TURNS[0]))
    cache = model.make_cache()
    list(mlx_mtp.generate_step(ids, model, max_tokens=4, prompt_cache=cache))
    assert cache[0] not in HeldCache._open
    gen = mlx_mtp.generate_step(ids, model, max_tokens=30, prompt_cache=model.make_cache())
    next(gen)
    assert len(HeldCache._open) == 1
    del gen
    gc.collect()
    assert len(HeldCache._open) == 0


def test_weights_changed_in_place(dense_ckpt):
    """Compiled graphs read the model's weights at every call: after an
    in-place update, output follows the new weights (as mlx_lm's does)."""
    from mlx.utils import tree_flatten, tree_unflatten

    other, tok = mlx_lm.load(str(dense_ckpt))
    model, _ = mlx_mtp.load(dense_ckpt, quiet=True)  # a model of its own: its weights change
    ids = tok.encode(LONG)
    before = reference(other, ids, 12)
    assert mtp(model, ids, 2, 12) == before
    noise = {}
    for m in (model, other):
        new = []
        for k, v in tree_flatten(m.parameters()):
            if k.endswith(("mlp.down_proj.weight", "lm_head.weight")):
                noise.setdefault(k, mx.random.normal(v.shape, key=mx.random.key(len(noise))))
                new.append((k, v + noise[k] * 0.1))
        m.update(tree_unflatten(new))
    after = reference(other, ids, 12)
    assert after != before
    assert mtp(model, ids, 2, 12) == after


def test_bad_prompt_cache(loaded):
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(SHORT)
    with pytest.raises(ValueError, match="entries"):
        mtp(model, ids, 2, 4, prompt_cache=model.make_cache()[:3])
    bad = model.make_cache()
    from mlx_lm.models.cache import RotatingKVCache

    bad[3] = RotatingKVCache(max_size=16)
    with pytest.raises(ValueError, match=r"prompt_cache\[3\] is a RotatingKVCache"):
        mtp(model, ids, 2, 4, prompt_cache=bad)
    with pytest.raises(ValueError, match="max_kv_size"):
        list(mlx_mtp.generate_step(mx.array(ids), model, max_kv_size=64))


def test_cli_prompt_cache_file(loaded, dense_ckpt, tmp_path, capsys, monkeypatch):
    """--prompt-cache-file takes a cache written by mlx_lm's cache_prompt:
    the same text as mlx_lm.generate with that file."""
    import importlib

    from mlx_mtp.cli import main

    lm_cache_prompt = importlib.import_module("mlx_lm.cache_prompt")
    lm_generate = importlib.import_module("mlx_lm.generate")

    f = str(tmp_path / "prefix.safetensors")
    monkeypatch.setattr(sys, "argv", ["cache_prompt", "--model", str(dense_ckpt), "--prompt",
                                      LONG, "--prompt-cache-file", f])
    lm_cache_prompt.main()
    common = ["--prompt", TURNS[1], "--max-tokens", "12", "--prompt-cache-file", f]
    monkeypatch.setattr(sys, "argv", ["generate"] + common)
    capsys.readouterr()
    lm_generate.main()
    want = capsys.readouterr().out
    assert main(common + ["--draft-tokens", "2"]) == 0
    got = capsys.readouterr().out
    assert got.strip() and got == want.split("==========\n")[1]  # mlx_lm is verbose
    assert main(common + ["--model", "/elsewhere"]) == 1
    assert "was made with" in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [False, True])
def test_parked_prefill_skips_the_head(loaded, monkeypatch, quiet):
    """`auto` parked at depth 0 (plain decoding pays): neither the prefill nor
    the plain steps run the head (counted, eager loop), the tokens are
    mlx_lm's; the next turn drafts from a head with a gap (the parked
    prompt) and is still exact. The same turn not parked runs the head.
    quiet: no probe due, so the plain steps run depth 0's graph and write
    no ring (the cache goes back with the head's state as it was)."""
    model, ref_model, tok = loaded("dense")
    turns = [tok.encode(t) for t in TURNS]
    want, _ = mlx_lm_turns(ref_model, turns)


    class Parked(DepthController):
        def next_depth(self):
            return 0

        def quiet_cycles(self):
            return 10 ** 6 if quiet else 0

    # (the first use of a model probes its cache shapes, the head's included)
    mtp(model, turns[0], "auto", 1, compiled=False, controller=Parked(initial=0))
    head = type(model.mtp)
    calls = []
    forward = head.__call__
    monkeypatch.setattr(head, "__call__", lambda self, *a, **kw: (
        calls.append(a[0].shape[1]), forward(self, *a, **kw))[1])

    cache = model.make_cache()
    got = mtp(model, turns[0], "auto", MAX_TOKENS[0], prompt_cache=cache, compiled=False,
              controller=Parked(initial=0))
    assert got == want[0]
    # the cache is written back: the head catches up on the plain steps' ring
    # only (at most MAX_TOKENS[0] pairs), never on the prompt; quiet, no ring
    # was written: the head only follows the tail fed to the cache (one forward)
    assert sum(calls) <= MAX_TOKENS[0] and (len(calls) <= 1 or not quiet), calls
    ahead = turns_ahead(ref_model, turns)
    got = mtp(model, turns[1], 2, MAX_TOKENS[1], prompt_cache=cache, compiled=False,
              drafter=OracleDrafter(ahead[1], 0.7, model.vocab_size, seed=3))
    assert got == want[1]

    calls.clear()  # not parked: the head follows the prompt in the prefill
    mtp(model, turns[0], "auto", 2, compiled=False, controller=DepthController())
    assert sum(calls) >= len(turns[0]) - 1, calls


def test_head_follows_a_prompts_last_head_context_tokens(loaded, monkeypatch):
    """A head whose config records the context it was trained on
    (`mlx_mtp.head_context`) follows only a prompt's last that many tokens
    (its forwards over the prompt counted), and decoding stays exact: one
    row, then two rows prefilled together, drafting from that history."""
    from mlx_mtp.batch import make_batch
    from mlx_mtp.decode import decode_rows

    model, ref_model, tok = loaded("dense")
    ids = [tok.encode(LONG), tok.encode(SHORT + LONG)]
    assert min(len(i) for i in ids) > 20
    mtp(model, ids[0], 2, 1, compiled=False)  # (first use: the cache shapes are probed)
    head = type(model.mtp)
    calls = []
    forward = head.__call__
    monkeypatch.setattr(head, "__call__", lambda self, *a, **kw: (
        calls.append(a[0].shape[1]), forward(self, *a, **kw))[1])
    monkeypatch.setattr(model, "head_context", 6)
    # one token: no cycle drafts, so every head forward is the prompt's
    assert mtp(model, ids[0], 2, 1, compiled=False) == reference(ref_model, ids[0], 1)
    assert sum(calls) == 6, calls
    monkeypatch.setattr(model, "head_context", None)
    calls.clear()
    mtp(model, ids[0], 2, 1, compiled=False)
    assert sum(calls) == len(ids[0]) - 1, calls

    monkeypatch.setattr(model, "head_context", 6)
    want = [reference(ref_model, i, 16) for i in ids]
    got = mtp(model, ids[0], 2, 16, drafter=OracleDrafter(want[0], 0.7, model.vocab_size))
    assert got == want[0]
    batch = make_batch(model, draft_tokens=2, drafter=OracleDrafter(want[1], 0.7,
                                                                    model.vocab_size))
    requests = [batch.prepare(i, None, 16) for i in ids]
    rows = [[] for _ in ids]
    for i, t in row_tokens(decode_rows(batch, requests, 2)):
        rows[i].append(t)
    assert rows == want
    assert requests[1].stats.accepted > 0


def test_head_context_in_config_is_checked(tmp_path):
    """A head_context that is not a positive number of tokens names the file."""
    import json

    from mlx_mtp.checkpoint import CheckpointError
    from mlx_mtp.loader import demo_model_path, head_context

    assert head_context({"mlx_mtp": {"head_context": 256}}, tmp_path) == 256
    assert head_context({}, tmp_path) is None
    for bad in (0, -3, "256", True, 2.5):
        with pytest.raises(CheckpointError, match="config.json: mlx_mtp.head_context must be"):
            head_context({"mlx_mtp": {"head_context": bad}}, tmp_path)
    demo = json.loads((demo_model_path() / "config.json").read_text())
    assert head_context(demo, demo_model_path()) == 512  # trained on 512-token windows
