"""The context proposer (mlx_mtp/context_draft.py): what it proposes, against
a brute-force scan of the row, and that its cost per token does not grow
with the row."""

import random
import time

import pytest
from util import slow

from mlx_mtp.context_draft import MAX_RUN, ContextIndex, Proposal


def scan(tokens, sizes, max_len):
    """The definition, by brute force: for the longest size whose suffix
    occurred earlier (followed by a token), the run after its latest such
    occurrence, continued by itself past the row's end."""
    end = len(tokens)
    for n in sorted(sizes, reverse=True):
        if end < n:
            continue
        suffix = tokens[end - n:]
        starts = [i + n for i in range(end - n) if tokens[i:i + n] == suffix]
        if starts:
            ext = list(tokens)
            for i in range(max_len):
                ext.append(ext[starts[-1] + i])
            return Proposal(tuple(ext[end:]), n, starts[-1])
    return Proposal()


@pytest.mark.parametrize("sizes", [(3,), (4, 3), (2, 4, 3), (1,)])
def test_proposals_are_the_scans(sizes):
    """At every length of random rows over small vocabularies (many
    repeats, many near-misses), growing token by token from a prompt: the
    index proposes what the brute-force scan finds."""
    rng = random.Random(len(sizes))
    for vocab in (2, 3, 5):
        tokens = [rng.randrange(vocab) for _ in range(300)]
        index = ContextIndex(tokens[:20], sizes)
        for end in range(20, len(tokens) + 1):
            if end > 20:
                index.append(tokens[end - 1])
            max_len = rng.choice([0, 1, 5, MAX_RUN])
            assert index.propose(max_len) == scan(tokens[:end], sizes, max_len), (vocab, end)


def test_a_copy_from_the_prompt():
    """An edit block re-typing a line of its prompt: after the first few
    tokens of the line, the rest of it (and what followed) is proposed."""
    line = [101, 7, 8, 9, 10, 11, 12, 13, 102]
    prompt = [1, 2, 3] + line + [4, 5, 6]
    index = ContextIndex(prompt + [50, 51] + line[:3])
    got = index.propose(8)
    assert got == Proposal(tuple(line[3:] + [4, 5]), 3, 3 + 3)
    assert len(got) == 8
    assert index.propose(0) == Proposal((), 3, 6)


def test_the_latest_occurrence_and_the_longest_match_win():
    index = ContextIndex([1, 2, 3, 40, 9, 2, 3, 41, 9, 9, 1, 2, 3], sizes=(4, 3, 2))
    # [1, 2, 3] occurred once before (-> 40); [2, 3] last before -> 41: the 3-gram wins
    assert index.propose(1) == Proposal((40,), 3, 3)
    index = ContextIndex([5, 2, 3, 40, 7, 2, 3, 41, 2, 3], sizes=(3, 2))
    assert index.propose(2) == Proposal((41, 2), 2, 7)  # the later of two 2-gram matches


def test_no_match_and_short_rows():
    assert ContextIndex().propose() == Proposal()
    assert ContextIndex([1, 2]).propose() == Proposal()  # shorter than every size
    assert ContextIndex([1, 2, 3, 4, 5]).propose() == Proposal()
    assert not ContextIndex([1, 2, 3, 4, 5]).propose()


def test_a_repeat_continues_itself():
    """A run that reaches the row's end goes on with the run itself: a
    period-2 repeat proposes 16 tokens of it."""
    index = ContextIndex([8, 1, 2, 1, 2, 1, 2])
    assert index.propose() == Proposal((1, 2) * 8, 4, 5)


def test_bad_arguments():
    for sizes in [(), (0,), (3, 3), (2.5,)]:
        with pytest.raises(ValueError, match="n-gram sizes"):
            ContextIndex([], sizes)
    with pytest.raises(ValueError, match="max_len"):
        ContextIndex([1, 2, 3]).propose(-1)


def _per_token_seconds(index, tokens, repeats=3):
    """The best of `repeats` timings of appending `tokens` one by one, with a
    proposal after each (a cycle's work), per token."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for tok in tokens:
            index.append(tok)
            index.propose(MAX_RUN)
        best = min(best, (time.perf_counter() - t) / len(tokens))
    return best


def test_cost_per_token_does_not_grow_with_the_row():
    """O(1) amortised per token, no scan of the context: a cycle's work on a
    100K-token row costs what it costs on a 1K-token one (a scan per cycle
    would cost ~100x), and 100K tokens index in well under a second each
    10K (measured ~5 µs per token and proposal)."""
    rng = random.Random(0)
    text = [rng.randrange(50) for _ in range(100_000)]  # copies everywhere
    tail = [rng.randrange(50) for _ in range(500)]
    small = ContextIndex(text[:1000])
    t = time.perf_counter()
    big = ContextIndex(text)
    build = time.perf_counter() - t
    ratio = _per_token_seconds(big, tail) / _per_token_seconds(small, tail)
    print(f"100K-token build {build:.2f} s, per-token cost ratio 100K/1K {ratio:.2f}")
    assert build < 5.0
    assert ratio < 5.0


# -- through the decode loop (ContextDrafter: opt-in, one row) ------------------------------
@pytest.mark.parametrize("name,source,k", [
    ("dense", "copy", 16), ("dense", "natural", "auto"),
    slow("dense", "copy", 2), slow("dense", "copy", "auto"), slow("dense", "natural", 2),
    slow("dense", "natural", 16),
    *[slow("moe", s, k) for s in ("copy", "natural") for k in (2, 16, "auto")]])
def test_greedy_with_context_drafts_is_mlx_lms(loaded, name, source, k):
    """Greedy with context runs drafted in place of the head's wherever the
    row's suffix occurred before: tokens and log-prob rows equal mlx_lm's
    greedy decoding at depths 2, 16 and auto (the default tier: a copy at 16,
    natural text at auto; the rest slow). "copy": the index starts from
    the prompt, the answer, the prompt again (a row re-typing what its
    context holds), so runs of 16 are kept whole; "natural": the prompt
    alone, 1- and 2-grams (the tiny models' random weights repeat little),
    so runs are mostly rejected."""
    from util import SAME, LONG, mtp, reference

    from mlx_mtp.context_draft import ContextDrafter
    from mlx_mtp.stats import MTPStats

    model, ref_model, tok = loaded(name)
    ids = tok.encode(LONG * 2)
    n = 48
    want, want_rows = reference(ref_model, ids, n, rows=True)
    context, sizes = {"copy": (ids + want + ids, (4, 3)), "natural": (ids, (2, 1))}[source]
    stats, drafter = MTPStats(), ContextDrafter(context, sizes)  # (auto: plain steps between cycles too)
    got, rows = mtp(model, ids, k, n, rows=True, stats=stats, drafter=drafter)
    assert got == want, f"{source} depth {k}"
    assert SAME(rows, want_rows), f"log-probs, {source} depth {k}"
    print(name, source, k, drafter.runs, stats.acceptance)
    assert drafter.runs > 0
    if source == "copy":  # runs kept; at a fixed depth also rejected (past the copy's end:
        # auto's depth follows measured costs and may stay short of it)
        assert 0 < stats.accepted <= stats.drafted
        assert k == "auto" or stats.accepted < stats.drafted
    if source == "copy" and k != "auto":  # whole runs of k
        assert stats.accepted_at[k - 1] > 0


# -- in the batch, on the device (context_drafts=True) ----------------------------------------
def test_the_device_index_proposes_what_the_host_index_does(monkeypatch):
    """Two rows of one batch, growing by 1-4 tokens a cycle from prompts of
    different lengths over a small vocabulary (copies everywhere): at every
    cycle each row's device proposal is the host index's (buckets many
    enough that no two n-grams share one; with fewer, a shared bucket only
    loses a run: the n-gram before it is checked)."""
    import mlx.core as mx

    from mlx_mtp import context_draft as cd

    monkeypatch.setattr(cd, "BUCKETS", 1 << 22)
    rng = random.Random(3)
    rows = [[rng.randrange(12) for _ in range(n)] for n in (1500, 1500)]
    starts = [40, 300]
    hosts = [ContextIndex(r[:s]) for r, s in zip(rows, starts)]
    states = [cd.context_state(r[:s]) for r, s in zip(rows, starts)]
    ctx = [mx.concatenate([s[i] for s in states]) for i in range(3)]
    at, checked = list(starts), 0
    while all(a < 1200 for a in at):
        runs, found = cd.propose_runs(*ctx, MAX_RUN)
        for b, host in enumerate(hosts):
            want = host.propose(MAX_RUN)
            assert bool(found[b]) == bool(want), (b, at[b])
            if want:
                assert tuple(runs[b].tolist()) == want.tokens, (b, at[b])
                checked += 1
        counts = [rng.randrange(1, 5) for _ in hosts]
        new = [rows[b][at[b]:at[b] + c] + [0] * (4 - c) for b, c in enumerate(counts)]
        ctx = cd.append_tokens(*ctx, mx.array(new, dtype=mx.int32), mx.array(counts))
        for b, c in enumerate(counts):
            hosts[b].extend(rows[b][at[b]:at[b] + c])
            at[b] += c
    assert checked > 150


def _family_model(tmp_path_factory, name):
    """Qwen3-Next (mlx_lm's model the reference) or qwen4_exp (Flash-Next:
    mlx_lm has none; mlx_lm's generate_step on our model, plain decoding)."""
    import mlx_lm

    import mlx_mtp
    from mlx_mtp.testing.synthetic import write_checkpoint, write_qwen4_exp_checkpoint

    folder = tmp_path_factory.mktemp(name) / name
    path = (write_checkpoint(folder, family="qwen3_next") if name == "next"
            else write_qwen4_exp_checkpoint(folder))
    model, tok = mlx_mtp.load(path, quiet=True)
    return model, mlx_lm.load(str(path))[0] if name == "next" else model, tok


@pytest.mark.parametrize("name,k", [("dense", 2), ("dense", "auto"), slow("moe", 2),
                                    slow("moe", "auto"), slow("next", 2), slow("next", "auto"),
                                    slow("qwen4_exp", 2), slow("qwen4_exp", "auto")])
def test_batched_rows_with_context_runs_are_mlx_lms(loaded, tmp_path_factory, name, k,
                                                    monkeypatch):
    """Three greedy rows in one batch with context drafts on: two re-type
    what their context holds (its index starts from the prompt, the answer,
    the prompt again: `cached_tokens`, what a server's prefix cache passes),
    one copies nothing. Each row's tokens and log-prob rows equal mlx_lm's
    greedy decoding alone; the copying rows draft runs wider than the head's
    chain (up to 16: the policy here sees every width cost the same, as a
    GPU's verify that reads the weights once would), kept whole and cut
    short (past the copy's end)."""
    from util import SAME, LONG, reference

    from mlx_mtp.batch import make_batch
    from mlx_mtp.schedule import ContextPolicy
    from mlx_mtp.stats import MTPStats

    monkeypatch.setattr(ContextPolicy, "_rate", lambda self, w, head, rows:
                        self.expected_tokens(w))

    model, ref_model, tok = (_family_model(tmp_path_factory, name)
                             if name in ("next", "qwen4_exp") else loaded(name))
    prompts = [tok.encode(LONG * 2), tok.encode("def eggs(n):\n    return"),
               tok.encode("import sys\nclass Ham:")]
    ns = [48, 40, 36]
    wants = [reference(ref_model, p, n, rows=True) for p, n in zip(prompts, ns)]
    batch = make_batch(model, draft_tokens=k, context_drafts=True)
    stats = [MTPStats() for _ in prompts]
    cached = [p + w + p if copy else () for p, (w, _), copy in
              zip(prompts, wants, (True, False, True))]
    rows = batch.add([batch.prepare(p, None, n, cached_tokens=c, stats=s)
                      for p, n, c, s in zip(prompts, ns, cached, stats)])
    got = {id(r): ([], []) for r in rows}
    while batch.rows:
        for ev in batch.step():
            got[id(ev.row)][0].append(ev.token)
            got[id(ev.row)][1].append(ev.logprobs)
    for i, (row, (want, want_rows)) in enumerate(zip(rows, wants)):
        tokens, lps = got[id(row)]
        assert tokens == want, (name, k, i)
        assert SAME(mx_stack(lps), want_rows), (name, k, i)
    for s in (stats[0], stats[2]):
        print(name, k, s.usage())
        assert 0 < s.context_accepted < s.context_drafted
        assert len(s.drafted_at) >= 8  # (wider than any head's chain here)


def mx_stack(arrays):
    import mlx.core as mx

    return mx.stack(arrays)


def test_the_context_policy_on_recorded_reads():
    """The width rule, without a model (schedule.ContextPolicy): runs kept
    whole widen the next cycle through CONTEXT_WIDTHS while the measured
    tokens per second say so; a run cut short narrows it to the widest width
    its kept drafts + 1 fill; where wide cycles cost their width (this CPU)
    and runs are kept half the time, the head's depth wins; a plain step
    whose row has a run proposes one even while the head is parked."""
    from mlx_mtp.schedule import CONTEXT_WIDTHS, ContextPolicy

    flat = ContextPolicy(costs={})
    for w in (2, *CONTEXT_WIDTHS):  # a GPU-like verify: every width costs the same
        for _ in range(ContextPolicy.MIN_SAMPLES):
            flat.observe_cost(w, 2, 1, 0.01)
    widths, k = [], 2
    for _ in range(4):
        flat.observe(k, [k], [True])  # (the run kept whole)
        k = flat.choose(2, 1)
        widths.append(k)
    assert widths == [4, 8, 16, 16]
    flat.observe(16, [5], [True])  # cut short after 5: 6 tokens would have done
    assert flat.width == 4 and flat.choose(2, 1) == 4
    flat.observe(4, [1], [True])
    assert flat.width == 0 and flat.choose(2, 1) == 2
    flat.observe(2, [2, 0], [False, False])  # no run: the head's depth
    assert flat.choose(2, 1) == 2

    linear = ContextPolicy(costs={}, keep=0.5)
    for w in (2, *CONTEXT_WIDTHS):
        for _ in range(ContextPolicy.MIN_SAMPLES):
            linear.observe_cost(w, 2, 1, 0.004 * (w + 1))
    linear.width = 16
    assert linear.choose(2, 1) == 2
    unmeasured = ContextPolicy(costs={}, width=8)
    assert unmeasured.choose(2, 1) == 2  # the head's depth measured first, then the widths
    unmeasured.observe_cost(2, 2, 1, 0.01)
    unmeasured.observe_cost(2, 2, 1, 0.01)
    assert unmeasured.choose(2, 1) == 4

    parked = ContextPolicy(costs={})
    parked.observe_plain([False, False])
    assert parked.width == 0
    parked.observe_plain([False, True])
    assert parked.width == CONTEXT_WIDTHS[0]


def test_the_schedule_observes_recorded_reads():
    """`Schedule.observe` on typed read records, without a model: a head
    cycle teaches the `auto` controller its acceptance and cost; a cycle
    with context runs, or wider than the head's chain, teaches the context
    policy and not the controller; a plain step whose row has a run makes
    the policy propose one."""
    from types import SimpleNamespace

    from mlx_mtp.depth import DepthController
    from mlx_mtp.schedule import CONTEXT_WIDTHS, CycleRecord, Schedule

    ctl = DepthController(max_depth=4, initial=2)
    schedule = Schedule("auto", 4, ctl, True)
    spec = SimpleNamespace(context=(4, 3))
    schedule.observe(spec, CycleRecord(2, 2, False, 1, (2,), (False,), (2, 2, 1, 0.01)))
    assert ctl.cycles == 1 and ctl.cost_n == {2: 1}
    schedule.observe(spec, CycleRecord(2, 2, False, 1, (2,), (True,), (2, 2, 1, 0.01)))
    assert ctl.cycles == 1 and schedule.context.width == CONTEXT_WIDTHS[0]  # (kept whole)
    schedule.observe(spec, CycleRecord(8, 2, False, 1, (3,), (True,), (8, 2, 1, 0.03)))
    assert ctl.cycles == 1 and ctl.cost_n == {2: 1}
    assert schedule.context.costs[(8, 2, 1)] == [0.03, 1] and schedule.context.width == 4
    schedule.observe(spec, CycleRecord(2, 2, False, 1, (0,), (False,), None))
    assert schedule.context.width == 0 and ctl.cycles == 2
    schedule.observe(spec, CycleRecord(0, 0, False, 1, (0,), (True,), (0, 0, 1, 0.005)))
    assert schedule.context.width == CONTEXT_WIDTHS[0] and ctl.cycles == 3  # (a plain step)


def test_each_row_trusts_the_source_whose_first_drafts_are_kept():
    """`cycle.trusted`, the per-row choice's averages: a row whose runs are
    rejected stops drafting them once its runs' average falls below the
    head's, a row whose runs are kept goes on, and a run not drafted
    regains trust until it is tried again."""
    import mlx.core as mx

    from mlx_mtp.cycle import TRUST_REGROWTH, trusted

    trust = mx.array([[1.0, 0.5], [1.0, 0.5]])
    for _ in range(4):  # row 0's runs rejected, row 1's kept
        trust = trusted(trust, mx.array([True, True]), mx.array([0, 5]))
    assert trust[0, 0].item() < trust[0, 1].item() and trust[1, 0].item() > 0.99
    before = trust[0, 0].item()
    trust = trusted(trust, mx.array([False, True]), mx.array([3, 5]))  # row 0: the head's, kept
    assert abs(trust[0, 0].item() - (before + TRUST_REGROWTH)) < 1e-6
    assert trust[0, 1].item() > 0.5 and trust[1, 1].item() == 0.5  # (row 1 drafted no head's)
