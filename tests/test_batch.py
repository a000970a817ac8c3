"""Batched decoding is exact per row: each row's tokens are the ones it gets
decoded alone (greedy: mlx_lm's; seeded sampling: mlx_mtp's single-row
decoding with the same seed), with B rows of different lengths, each
accepting its own number of drafts, rows joining and leaving between cycles.

The fixtures' random heads rarely draft right, so a BigramDrafter (drafts
from the rows' known continuations, by each row's own last token) gives
every row its own partial acceptance; verify, per-row commit and rollback run
for real.
"""

import os
from pathlib import Path

import mlx.core as mx

import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_mtp
from mlx_mtp.depth import DepthController
from mlx_mtp.testing.drafters import BigramDrafter
from mlx_mtp.batch import make_batch
from mlx_mtp.decode import decode_rows, generate_tokens
from util import LONG, SHORT, reference, row_tokens, slow

PROMPTS = [SHORT, LONG, "hello world, this is", "a", "x = [1, 2, 3]\nprint(", LONG * 2,
           "The quick brown fox", "if __name__ == '__main__':\n    "]


def run_batch(model, ids, max_tokens, width, k, drafter=None, sampler=None, seeds=None,
              stop=()):
    """decode_rows over these prompts: each row's tokens, finish reasons, stats."""
    batch = make_batch(model, draft_tokens=k, drafter=drafter, sampler=sampler)
    requests = []
    for i, p in enumerate(ids):
        seed = None if seeds is None else seeds[i]
        requests.append(batch.prepare(p, None, max_tokens[i], seed, stop_tokens=stop))
    got, reasons = [[] for _ in ids], [None] * len(ids)
    for i, ev in decode_rows(batch, requests, width):
        got[i].append(ev.token)
        reasons[i] = ev.finish or reasons[i]
    assert not batch.rows and batch.state is None  # every row left
    return got, reasons, [r.stats for r in requests]


@pytest.mark.parametrize("name", [slow("dense"), slow("dense_bf16"), "moe", "q4"])
def test_rows_equal_alone_greedy(loaded, name):
    """B = 1, 2, 3, 8 and a batch narrower than its prompts (rows join as
    others leave), each row with its own max_tokens, fixed depths and auto."""
    model, ref_model, tok = loaded(name)
    ids = [tok.encode(p) for p in PROMPTS]
    want = [reference(ref_model, i, 24) for i in ids]
    drafter = BigramDrafter(want[::2], model.vocab_size)  # odd rows: mostly wrong drafts
    limits = [24, 9, 24, 5, 17, 24, 1, 13]
    cases = [(1, 1), (2, 2), (3, 3), (8, 8), (8, 3)] if name == "dense" else [(3, 3), (8, 3)]
    for n, width in cases:
        for k in ([0, 1, 2, 3, "auto"] if name == "dense" else [2, "auto"]):
            got, reasons, stats = run_batch(model, ids[:n], limits[:n], width, k, drafter)
            for r in range(n):
                assert got[r] == want[r][: limits[r]], f"B={n} width={width} depth {k} row {r}"
                assert reasons[r] == "length"
            if k not in (0, "auto"):
                accepted = [s.accepted for s in stats]
                assert all(s.drafted > 0 for s in stats if s.cycles)
                if n >= 3:  # rows accept different numbers of drafts
                    assert len(set(accepted)) > 1 and max(accepted) > 0


def test_rows_with_nothing_to_prefill_join_together(loaded):
    """Rows whose prefill feeds nothing join in one batched prefill: one-token
    prompts on fresh caches, and the server's case of prompt caches holding
    all but the last prompt token stored while parked (the head never
    followed them: its caches are empty). Each row equals mlx_lm's alone."""
    import copy

    model, ref_model, tok = loaded("dense")
    ones = [tok.encode("a")[:1], tok.encode("x")[:1]]
    got, _, _ = run_batch(model, ones, [6, 6], 2, 2)
    assert got == [reference(ref_model, i, 6) for i in ones]

    ids = [tok.encode(p) for p in PROMPTS[:2]]
    want = [reference(ref_model, i, 8) for i in ids]

    class Fixed(DepthController):
        def next_depth(self):
            return self.k

    ctl = Fixed(initial=0)  # parked: the prefill runs without the head
    stored = []
    for p in ids:
        cache = model.make_cache()
        batch = make_batch(model, draft_tokens="auto", controller=ctl)
        r = batch.prepare(p, cache, 1)
        r.stops, r.snapshot = (len(p) - 1,), lambda n, c=cache: stored.append(copy.deepcopy(c))
        list(decode_rows(batch, [r], 1))
    ctl.k = 2  # drafting now: the rows join together, their heads empty
    batch = make_batch(model, draft_tokens="auto", controller=ctl)
    requests = [batch.prepare(p[-1:], c, 8) for p, c in zip(ids, stored)]
    got = [[] for _ in ids]
    for i, t in row_tokens(decode_rows(batch, requests, 2)):
        got[i].append(t)
    assert got == want


def test_stop_token_per_row(loaded):
    """A stop token ends its row only (mid-cycle too); the others go on."""
    model, ref_model, tok = loaded("dense")
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    want = [reference(ref_model, i, 20) for i in ids]
    drafter = BigramDrafter(want, model.vocab_size)  # long accepted runs: stops fall mid-cycle
    stop_at = 7
    stop = want[0][stop_at]
    first = want[0].index(stop)
    got, reasons, _ = run_batch(model, ids, [20] * 4, 4, 3, drafter, stop=[stop])
    assert got[0] == want[0][: first + 1] and reasons[0] == "stop"
    for r in range(1, 4):
        cut = want[r].index(stop) + 1 if stop in want[r] else 20
        assert got[r] == want[r][:cut]


@pytest.mark.parametrize("k", [slow(1), 3])
def test_rows_equal_alone_sampled(loaded, k):
    """Seeded sampling: each row of a batch (rows joining too) draws exactly
    what it draws decoded alone with the same seed."""
    model, _, tok = loaded("dense")
    ids = [tok.encode(p) for p in PROMPTS[:5]]
    sampler = mlx_mtp.make_sampler(temp=1.0, top_p=0.95)
    alone = [list(t for t, _ in mlx_mtp.generate_step(mx.array(i), model, max_tokens=16,
                                                       draft_tokens=k, sampler=sampler,
                                                       seed=100 + r))
             for r, i in enumerate(ids)]
    drafter = BigramDrafter(alone, model.vocab_size)
    alone_drafted = [list(t for t, _, _ in generate_tokens(
        mx.array(i), model, max_tokens=16, draft_tokens=k, sampler=sampler, seed=100 + r,
        drafter=drafter)) for r, i in enumerate(ids)]
    for width in (5, 2):
        got, _, stats = run_batch(model, ids, [16] * 5, width, k, drafter, sampler,
                                  seeds=[100 + r for r in range(5)])
        assert got == alone_drafted, f"width {width}"
        assert sum(s.accepted for s in stats) > 0
    assert len({tuple(a) for a in alone}) == 5  # the seeds differ, so do the rows


def test_batch_generate_api(loaded):
    """mlx_lm.batch_generate's counterpart: texts, token ids, per-row
    max_tokens, and prompt caches that continue exactly."""
    model, ref_model, tok = loaded("dense")
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    want = [reference(ref_model, i, 12) for i in ids]
    stats = []
    out = mlx_mtp.batch_generate(model, tok, ids, max_tokens=[12, 5, 12], draft_tokens=2,
                                 return_token_ids=True, return_prompt_caches=True, stats=stats,
                                 completion_batch_size=2)
    assert out.token_ids == [want[0], want[1][:5], want[2]]
    assert out.texts == [tok.decode(t) for t in out.token_ids]
    assert out.stats.generation_tokens == 29 and len(stats) == 3
    # each returned cache holds prompt + tokens, as mlx_lm's would: a second
    # turn on it equals mlx_lm's on its own cache
    follow = tok.encode(" more")
    for r, cache in enumerate(out.caches):
        ref_cache = make_prompt_cache(ref_model)
        reference(ref_model, ids[r], len(out.token_ids[r]), prompt_cache=ref_cache)
        expect = reference(ref_model, follow, 10, prompt_cache=ref_cache)
        got = list(t for t, _ in mlx_mtp.generate_step(mx.array(follow), model, max_tokens=10,
                                                        draft_tokens=2, prompt_cache=cache))
        assert got == expect, f"row {r}"
    with pytest.raises(ValueError, match="seeds has 1 entries for 3 prompts"):
        mlx_mtp.batch_generate(model, tok, ids, seeds=[1])


def test_processors_inside_a_batch(loaded):
    """Rows with logits processors (mlx_lm's, on the host with the row's own
    history) decode in one batch with rows without them: every row equals
    mlx_lm decoding it alone with its own processors (greedy)."""
    from mlx_lm.sample_utils import make_logits_processors

    model, ref_model, tok = loaded("dense")
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    V = model.vocab_size

    def count_up(tokens, logits):  # needs the exact history at every position
        return logits.at[:, (tokens[-1] + 1) % V].add(30.0)

    procs = [[count_up], None,
             make_logits_processors(logit_bias={5: 12.0}, frequency_penalty=4.0), None]
    want = [reference(ref_model, i, 14, processors=p) for i, p in zip(ids, procs)]
    for r in (0, 2):  # the processors change the text
        assert want[r] != reference(ref_model, ids[r], 14), r
    for k in (0, 2, "auto"):
        batch = make_batch(model, draft_tokens=k)
        requests = [batch.prepare(i, None, 14, None, logits_processors=p)
                    for i, p in zip(ids, procs)]
        got = [[] for _ in ids]
        for i, t in row_tokens(decode_rows(batch, requests, 4)):
            got[i].append(t)
        assert got == want, f"depth {k}"


def test_penalties_in_graph_inside_a_batch(loaded):
    """Rows with repetition/presence/frequency penalties decode in the
    compiled, pipelined batch (no host history): greedy rows equal mlx_lm
    decoding them alone with its processors, with drafts accepted (the
    window of each row advances by its own count), at fixed depths and
    auto; a sampled row with penalties equals itself decoded alone."""
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_mtp.sampling import Penalties

    model, ref_model, tok = loaded("dense")
    ids = [tok.encode(PROMPTS[i]) for i in (0, 1, 3, 2, 4)]
    settings = [dict(presence_penalty=3.0, frequency_penalty=2.0, frequency_context_size=30),
                dict(repetition_penalty=1.8, repetition_context_size=6),
                {},
                dict(repetition_penalty=1.3, presence_penalty=1.0, presence_context_size=4,
                     frequency_penalty=4.0),
                dict(presence_penalty=2.5)]
    want = [reference(ref_model, i, 18, processors=make_logits_processors(**kw))
            for i, kw in zip(ids, settings)]
    for r in (0, 1, 3, 4):  # the penalties change the text
        assert want[r] != reference(ref_model, ids[r], 18), r
    drafter = BigramDrafter(want, model.vocab_size)
    for k in (0, 1, 3, "auto"):
        batch = make_batch(model, draft_tokens=k, drafter=drafter)
        requests = [batch.prepare(i, None, 18, None, penalties=Penalties.of(**kw))
                    for i, kw in zip(ids, settings)]
        got = [[] for _ in ids]
        for i, t in row_tokens(decode_rows(batch, requests, 5)):
            got[i].append(t)
            assert batch.schedule.lookahead == 1 and not batch.spec.processors
        assert got == want, f"depth {k}"
        if k in (1, 3):
            assert all(r.stats.accepted > 0 for r in requests), f"depth {k}"
    sampler, pen = mlx_mtp.make_sampler(temp=0.8), Penalties.of(**settings[1])
    batch = make_batch(model, draft_tokens=2)
    alone = [t for _, t in row_tokens(decode_rows(
        batch, [batch.prepare(ids[0], None, 16, 5, sampler=sampler, penalties=pen)], 1))]
    batch = make_batch(model, draft_tokens=2)
    requests = [batch.prepare(ids[0], None, 16, 5, sampler=sampler, penalties=pen),
                batch.prepare(ids[1], None, 16, None, penalties=Penalties.of(**settings[3]))]
    got = [[] for _ in requests]
    for i, t in row_tokens(decode_rows(batch, requests, 2)):
        got[i].append(t)
    assert got[0] == alone
    assert got[1] == reference(ref_model, ids[1], 16,
                               processors=make_logits_processors(**settings[3]))


def test_make_logits_processors_run_in_graph(loaded):
    """`mlx_mtp.make_logits_processors` is mlx_lm's (same list, same tokens
    under mlx_lm) and tells the decoder its bias and penalties, which then
    run in the compiled cycle: no host processors, tokens equal mlx_lm's.
    A list changed after it was made, or a context only the host keeps,
    stays on the host, still exact."""
    from mlx_lm.sample_utils import make_logits_processors

    model, ref_model, tok = loaded("dense")
    ids = tok.encode(PROMPTS[0])
    kw = dict(logit_bias={5: 2.0}, presence_penalty=3.0, frequency_penalty=2.0,
              frequency_context_size=30)
    ours = mlx_mtp.make_logits_processors(**kw)
    want = reference(ref_model, ids, 16, processors=make_logits_processors(**kw))
    assert want != reference(ref_model, ids, 16)
    assert reference(ref_model, ids, 16, processors=ours) == want  # mlx_lm's processors
    batch = make_batch(model, draft_tokens=2, logits_processors=ours)
    request = batch.prepare(ids, None, 16)
    assert request.processors == () and request.sampling.penalties.presence == (3.0, 20)
    assert request.sampling.logit_bias == ((5, 2.0),)
    assert [t for _, t in row_tokens(decode_rows(batch, [request], 1))] == want
    got = [t for t, _ in mlx_mtp.generate_step(mx.array(ids), model, max_tokens=16,
                                                draft_tokens=2, logits_processors=ours)]
    assert got == want
    changed = mlx_mtp.make_logits_processors(**kw)
    changed.append(lambda tokens, logits: logits)
    whole = mlx_mtp.make_logits_processors(repetition_penalty=1.5, repetition_context_size=0)
    for procs in (changed, whole):
        request = make_batch(model, draft_tokens=2).prepare(ids, None, 16,
                                                            logits_processors=procs)
        assert request.processors, procs
    got = [t for t, _ in mlx_mtp.generate_step(mx.array(ids), model, max_tokens=16,
                                                draft_tokens=2, logits_processors=changed)]
    assert got == want


def test_mixed_samplers_in_one_batch(loaded):
    """Greedy rows, rows sampling with different temperatures / top-p / min-p /
    XTC / seeds and a row with a logit bias decode in ONE batch (one trunk forward
    per cycle): greedy rows equal mlx_lm alone, sampled rows equal themselves
    decoded alone with the same seed at the same fixed depth."""
    model, ref_model, tok = loaded("dense")
    ids = [tok.encode(p) for p in PROMPTS[:7]]
    samplers = [None, mlx_mtp.make_sampler(temp=0.7, top_p=0.9), None,
                mlx_mtp.make_sampler(temp=1.0), mlx_mtp.make_sampler(temp=0.9, min_p=0.05),
                None, mlx_mtp.make_sampler(temp=0.9, xtc_probability=0.5, xtc_threshold=0.05,
                                           xtc_special_tokens=[3])]
    biases = [None, None, {5: 3.0, 7: -1.5}, None, None, None, None]
    seeds = [None, 11, None, 12, 13, None, 14]
    from mlx_lm.sample_utils import make_logits_processors

    for k in (1, 3):
        alone = []
        for i, s, b, seed in zip(ids, samplers, biases, seeds):
            batch = make_batch(model, draft_tokens=k)
            req = batch.prepare(i, None, 16, seed, sampler=s, logit_bias=b)
            alone.append([t for _, t in row_tokens(decode_rows(batch, [req], 1))])
        batch = make_batch(model, draft_tokens=k)
        requests = [batch.prepare(i, None, 16, seed, sampler=s, logit_bias=b)
                    for i, s, b, seed in zip(ids, samplers, biases, seeds)]
        got = [[] for _ in ids]
        for i, t in row_tokens(decode_rows(batch, requests, 7)):
            got[i].append(t)
        assert got == alone, f"depth {k}"
        assert batch.spec.sampler is None and requests[6].sampling.xtc_probability == 0.5
        for r in (0, 5):  # greedy rows: mlx_lm's tokens
            assert got[r] == reference(ref_model, ids[r], 16)
        bias = make_logits_processors(logit_bias=biases[2])
        assert got[2] == reference(ref_model, ids[2], 16, processors=bias)
        assert len({tuple(got[r]) for r in (1, 3, 4)}) == 3
    with pytest.raises(ValueError, match="share the batch"):
        batch = make_batch(model, draft_tokens=1)
        reqs = [batch.prepare(ids[0], None, 4, 1, sampler=mlx_mtp.make_sampler(1.0, top_k=5)),
                batch.prepare(ids[1], None, 4, 2, sampler=mlx_mtp.make_sampler(1.0, top_k=9))]
        list(decode_rows(batch, reqs, 2))


def test_depth_learned_per_batch_size(loaded):
    """Auto depth keeps one controller per batch-size bucket (a verify costs
    more at a larger batch), each fed by its own cycles' measurements."""
    model, _, tok = loaded("dense")
    model.runtime.controllers.clear()
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    run_batch(model, ids[:1], [12], 1, "auto")
    run_batch(model, ids, [12] * 4, 4, "auto")
    buckets = sorted(key[-1] for key in model.runtime.controllers)
    assert buckets == [1, 4]
    for key, ctl in model.runtime.controllers.items():
        assert ctl.cycles > 0 and sum(ctl.cost_n.values()) > 0, key
    # acceptance counts every row, the probe schedule counts cycles
    four = model.runtime.controllers[next(k for k in model.runtime.controllers if k[-1] == 4)]
    assert sum(four.accept_n) >= four.cycles


class Scheduled(DepthController):
    """Parked at depth 0; a probe due (no quiet cycles) in the launches
    `warm`; depth `k` from launch `drafting` on."""

    def __init__(self, warm, drafting, k):
        super().__init__(initial=0)
        self.launches, self.warm, self.drafting, self.k_draft = 0, warm, drafting, k

    def next_depth(self):
        self.launches += 1
        return self.k_draft if self.launches > self.drafting else 0

    def quiet_cycles(self):
        return 0 if self.launches in self.warm else 10 ** 6


@pytest.mark.parametrize("drafted,compiled", [("head", True), ("bigram", True),
                                              ("head", False)])
def test_parked_steps_run_depth_zeros_graph(loaded, monkeypatch, drafted, compiled):
    """Parked with no probe due, a batch's plain steps run depth 0's graph
    (the head's state set aside and its ring dropped, no pair written);
    before a probe they write the ring again, and the head catches up on
    exactly those pairs (eager: the ring's count checked at the catch-up).
    A warm stretch that no probe follows is dropped by the next cold step.
    Every row (three, of different lengths) stays mlx_lm's, drafts accepted
    or not."""
    from mlx_mtp import cycle

    model, ref_model, tok = loaded("dense")
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    want = [reference(ref_model, i, 60) for i in ids]
    steps, rings = [], []
    step, catch_up_ring = cycle.Graphs.step, cycle.catch_up_ring
    monkeypatch.setattr(cycle.Graphs, "step", lambda self, state, k, catch_up=False, *rest: (
        steps.append((self.spec.use_head, k, catch_up)), step(self, state, k, catch_up, *rest))[1])
    monkeypatch.setattr(cycle, "catch_up_ring", lambda model_, state, head: (
        rings.append(state.ring_n), catch_up_ring(model_, state, head))[1])
    drafter = BigramDrafter(want, model.vocab_size) if drafted == "bigram" else None
    warm = set(range(20, 26)) | set(range(36, 46))  # then drafting: a probe
    batch = make_batch(model, draft_tokens="auto", drafter=drafter, compiled=compiled,
                       controller=Scheduled(warm, drafting=45, k=2))
    limits = [60, 52, 44]
    requests = [batch.prepare(p, None, n) for p, n in zip(ids, limits)]
    got = [[] for _ in ids]
    for i, t in row_tokens(decode_rows(batch, requests, 3)):
        got[i].append(t)
    assert got == [w[:n] for w, n in zip(want, limits)]
    kinds = ["cold" if not use_head else "warm" if k == 0 else "drafted"
             for use_head, k, _ in steps]
    assert kinds[:19] == ["cold"] * 19 and kinds[19:25] == ["warm"] * 6
    assert kinds[25:35] == ["cold"] * 10 and kinds[35:45] == ["warm"] * 10
    assert kinds[45] == "drafted" and steps[45][2]  # the head catches up on the ring
    if not compiled:
        assert int(rings[0]) == 10  # the last warm stretch only: the first was dropped
    if drafter is not None:
        assert sum(r.stats.accepted for r in requests) > 0


def test_each_cycle_is_queued_as_its_plan_says(loaded, monkeypatch):
    """One place decides the next cycle (`Schedule.plan`, a frozen Plan) and
    `Batch._launch` only executes it: the depth controller is asked only while
    planning, and each cycle queued runs the graph, depth and catch-up its
    plan named (parked cold steps, warm ones, drafted ones with a catch-up)."""
    import inspect

    from mlx_mtp import cycle
    from mlx_mtp.schedule import Schedule

    model, ref_model, tok = loaded("dense")
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    plans, graphs = [], []
    plan, step = Schedule.plan, cycle.Graphs.step
    monkeypatch.setattr(Schedule, "plan", lambda self, *a: (plans.append(plan(self, *a)),
                                                            plans[-1])[1])
    monkeypatch.setattr(cycle.Graphs, "step", lambda self, state, k, catch_up=False, *rest: (
        graphs.append((self.spec.use_head, k, catch_up)), step(self, state, k, catch_up, *rest))[1])

    class Asked(Scheduled):
        def next_depth(self):
            callers = [(Path(f.filename).name, f.function) for f in inspect.stack()[1:4]]
            assert ("schedule.py", "plan") in callers, callers
            assert ("batch.py", "_launch") not in callers[:1], callers
            return super().next_depth()

    batch = make_batch(model, draft_tokens="auto", compiled=False,
                       controller=Asked(set(range(20, 26)), drafting=25, k=2))
    requests = [batch.prepare(p, None, 40) for p in ids]
    got = [[] for _ in ids]
    for i, t in row_tokens(decode_rows(batch, requests, 2)):
        got[i].append(t)
    assert got == [reference(ref_model, i, 40) for i in ids]
    planned = [(not p.cold, p.k, p.catch_up) for p in plans if p is not None]
    assert planned == graphs
    assert {"cold", "warm", "drafted"} <= {"cold" if p.cold else "drafted" if p.k else "warm"
                                          for p in plans}
    assert any(p.catch_up for p in plans)


def test_catch_up_has_room_at_a_block_boundary(loaded, monkeypatch):
    """A catch-up runs the head over all RING ring slots at the head's
    length before trimming the unwritten ones: the head's buffer must have
    RING entries of room there even when only two pairs wait, also where
    the head's length nears the end of a capacity block (a write past it
    would corrupt memory). Checked at every catch-up, eager loop, the head
    crossing a block boundary; the tokens stay mlx_lm's."""
    from mlx_mtp import cycle
    from mlx_mtp.cache import BLOCK

    model, ref_model, tok = loaded("dense")
    ids = tok.encode(LONG * 40)[: BLOCK - 20]  # the head follows it: its length nears BLOCK

    class TwoPlainOneDrafted(DepthController):
        def __init__(self):
            super().__init__(initial=1)
            self.launches = 0

        def next_depth(self):
            self.launches += 1
            return 1 if self.launches % 3 == 0 else 0

        def quiet_cycles(self):
            return 0

    lengths = []
    catch_up_ring = cycle.catch_up_ring

    def checked(model_, state, head_cache):
        for c in head_cache:
            lengths.append(int(c.lengths.max()))
            assert c.capacity >= lengths[-1] + cycle.RING, (c.capacity, lengths[-1])
        return catch_up_ring(model_, state, head_cache)

    monkeypatch.setattr(cycle, "catch_up_ring", checked)
    got = list(t for t, *_ in generate_tokens(mx.array(ids), model, max_tokens=48,
                                              draft_tokens="auto", compiled=False,
                                              controller=TwoPlainOneDrafted()))
    assert got == reference(ref_model, ids, 48)
    assert min(lengths) < BLOCK - cycle.RING < max(lengths)  # near the block end and past it


def test_cycles_count_for_the_batch_size_they_ran(loaded):
    """A cycle launched with two rows and read after one left is the two-row
    controller's sample: a cycle's cost and acceptance go to the controller of
    the rows it ran, never to the size the batch has when it is read."""
    from mlx_mtp.schedule import controller_for

    model, _, tok = loaded("dense")
    model.runtime.controllers.clear()
    batch = make_batch(model, draft_tokens="auto")
    rows = batch.add([batch.prepare(tok.encode(p), None, 30, None) for p in PROMPTS[:2]])
    for _ in range(4):
        list(batch.step())
    two, one = (controller_for(batch.spec, batch.schedule.max_depth, n) for n in (2, 1))
    assert [len(c.rows) for c in batch.in_flight] == [2]  # queued before the row leaves
    batch.finish(rows[0])
    before = (two.cycles, one.cycles, dict(one.cost_n))
    list(batch.step())  # reads the two-row cycle; launches a one-row one
    assert (two.cycles, one.cycles, one.cost_n) == (before[0] + 1, before[1], before[2])
    list(batch.step())
    assert one.cycles == before[1] + 1
    batch.finish(rows[1])


def test_cost_samples_cover_one_cycle(loaded):
    """A cost sample is the interval between two reads that held exactly one
    launch: not a batch's first read (its one cycle, read before another is
    queued, also finishes the prompt's work), nor its second (the lookahead
    launched two cycles before it, which would count as one cycle twice as
    slow), nor a read at the end when nothing new was launched (a cycle that
    looks free)."""
    model, _, tok = loaded("dense")
    costs = []

    class Recording(DepthController):
        def update_cost(self, k, seconds):
            costs.append(seconds)
            super().update_cost(k, seconds)

    batch = make_batch(model, draft_tokens="auto", controller=Recording(initial=0))
    [row] = batch.add([batch.prepare(tok.encode(PROMPTS[0]), None, 6, None)])
    launched = []
    while batch.rows and row.landed < 6:
        before = len(costs)
        n = len(batch.in_flight)
        list(batch.step())
        launched.append(len(batch.in_flight) - n + 1)  # launches in this step
        # a sample exactly when this step (not the first) launched one cycle
        assert len(costs) - before == int(launched[-1] == 1 and len(launched) > 1), launched
    assert launched[:2] == [1, 2] and launched[-1] == 0 and costs  # every edge was seen
    batch.finish(row)


def test_memory_flat_across_batches(loaded):
    """Rows joining and leaving leave nothing behind: active memory is flat
    over batch_generate calls with gc off."""
    import gc

    from mlx_lm.generate import generation_stream

    model, _, tok = loaded("dense")
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    readings = []
    gc.disable()
    try:
        for _ in range(6):
            mlx_mtp.batch_generate(model, tok, ids, max_tokens=[30, 8, 20, 40], draft_tokens=2,
                                   completion_batch_size=3)
            mx.synchronize(generation_stream)
            readings.append(mx.get_active_memory())
    finally:
        gc.enable()
    assert readings[-1] - readings[1] < 1 << 20, readings


def test_host_counters_are_checked_against_the_device(loaded, monkeypatch):
    """Under MLX_MTP_CHECK_COUNTS (set for the tests) every read compares the
    host's copy of each row's lengths and ring count with the device's: a
    host mirror that drifts fails at the next read, not at a write past a
    buffer's end later."""

    assert os.environ.get("MLX_MTP_CHECK_COUNTS") == "1"
    model, ref_model, tok = loaded("dense")
    ids = tok.encode(PROMPTS[0])
    want = reference(ref_model, ids, 12)
    got, _, _ = run_batch(model, [ids], [12], 1, "auto")
    assert got == [want]  # the check passes on the real bookkeeping
    from mlx_mtp.rows import Lengths

    after = Lengths.after
    monkeypatch.setattr(Lengths, "after", lambda self, k, accepted, ring=True: (
        lambda n: Lengths(n.trunk, n.head + 1, n.ring))(after(self, k, accepted, ring)))
    with pytest.raises(AssertionError, match="host counters differ"):
        run_batch(model, [ids], [12], 1, 2)


def test_rows_with_host_processors_get_a_batch_of_their_own(loaded):
    """A row running logits processors on the host (a forced call's reasoning
    budget; a grammar when sharded) makes its whole batch eager: the server's
    lane never puts it beside compiled rows, joining or decoding, and either
    kind waits for the other's batch to drain."""
    from mlx_mtp.sampling import RowSampling
    from mlx_mtp.server.lane import _Lane, _Settings

    model, _, tok = loaded("dense")
    lane = _Lane.__new__(_Lane)
    lane.depth, lane.rows = 2, {}
    lane.batch = make_batch(model, draft_tokens=2)
    free = _Settings(2, RowSampling.of(None), ())
    host = _Settings(2, RowSampling.of(None), (lambda tokens, logits: logits,))
    assert lane.accepts(free, [], 8) and lane.accepts(host, [], 8)  # an empty batch
    assert not lane.accepts(free, [host], 8) and not lane.accepts(host, [free], 8)
    assert lane.accepts(host, [host], 8) and not lane.accepts(free, [free] * 8, 8)
    (row,) = lane.batch.add([lane.batch.prepare(tok.encode(SHORT), None, 4)])
    lane.rows[row] = None
    assert lane.accepts(free, [], 8) and not lane.accepts(host, [], 8)
    assert not lane.accepts(_Settings(3, RowSampling.of(None), ()), [], 8)  # another depth
    lane.batch.rows.clear()
    lane.rows = {}
    (row,) = lane.batch.add([lane.batch.prepare(tok.encode(SHORT), None, 4,
                                                logits_processors=host.processors)])
    lane.rows[row] = None
    assert lane.accepts(host, [], 8) and not lane.accepts(free, [], 8)


def test_a_prefix_fed_piece_by_piece_is_the_prefix_fed_at_once(loaded):
    """The server's idle-time prefill (`Batch.feed_prefix`, pieces sharing a
    token: each piece's last is the next one's first) leaves the prompt
    cache as one prefill of the whole prefix does: the trunk holds every
    token, the head one position behind it, and the states agree up to
    rounding (the pieces are other matmul shapes)."""
    import numpy as np

    from mlx_mtp.cache import entry_length, head_caches
    from mlx_mtp.distributed import trunk_length

    model, _, tok = loaded("dense")
    batch = make_batch(model, draft_tokens=2)
    tokens = tok.encode(LONG)[:45]
    whole = model.make_cache()
    batch.add([batch.prepare(tokens, whole, 0)])
    pieces = model.make_cache()
    done = 0
    for end in (8, 17, 30):
        batch.feed_prefix(pieces, tokens[done:end + 1])
        done = end
    batch.add([batch.prepare(tokens[done:], pieces, 0)])
    n_trunk = len(model.is_linear)
    for cache in (whole, pieces):
        assert trunk_length(cache, model) == len(tokens)
        assert entry_length(head_caches(cache, n_trunk)[0]) == len(tokens) - 1
    for a, b in zip(whole, pieces):
        for x, y in zip(a.state, b.state):
            if isinstance(x, mx.array):
                np.testing.assert_allclose(np.array(x, dtype=np.float32),
                                           np.array(y, dtype=np.float32), rtol=1e-4, atol=1e-4)
