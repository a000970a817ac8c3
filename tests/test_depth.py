"""The adaptive depth controller, driven by simulated costs and acceptance."""

import random

from mlx_mtp.depth import DepthController


def simulate(accept, verify_cost, draft_cost, cycles=600, seed=0, decode=1.0):
    """accept[j]: P(draft j+1 right | earlier right); cost of depth k cycle =
    verify_cost(k+1) + k*draft_cost (in decode units). Returns (controller,
    achieved tokens/time, best fixed-depth tokens/time)."""
    rng = random.Random(seed)
    ctl = DepthController(max_depth=4)
    toks = time = 0.0
    for _ in range(cycles):
        k = ctl.next_depth()
        a = 0
        while a < k and rng.random() < accept[a]:
            a += 1
        cost = decode * (verify_cost(k + 1) if k else 1.0) + k * draft_cost
        cost *= 1 + rng.uniform(-0.05, 0.05)  # timing noise
        ctl.update(k, a, cost)
        toks += a + 1
        time += cost

    def fixed(k):
        e, p = 1.0, 1.0
        for j in range(k):
            p *= accept[j]
            e += p
        return e / ((verify_cost(k + 1) if k else 1.0) + k * draft_cost)

    return ctl, toks / time, max(fixed(k) for k in range(5))


def test_high_acceptance_cheap_verify_drafts_deep():
    ctl, got, best = simulate([0.9, 0.85, 0.8, 0.75], lambda t: 1 + 0.1 * (t - 1), 0.05)
    assert ctl.k >= 3
    assert got >= 0.9 * best


def test_unpredictable_text_falls_back_to_plain_decoding():
    ctl, got, best = simulate([0.02, 0.01, 0.0, 0.0], lambda t: 1 + 0.1 * (t - 1), 0.1)
    assert ctl.k == 0
    assert got >= 0.93 * best  # probes cost a little


def test_expensive_verify_backend_chooses_plain():
    # a 2-token verify costs nearly 2 decodes (reference BLAS on CPU)
    ctl, got, best = simulate([0.7, 0.6, 0.5, 0.4], lambda t: 0.95 * t, 0.1)
    assert ctl.k == 0
    assert got >= 0.93 * best


def test_expected_tokens_formula():
    ctl = DepthController(max_depth=3)
    ctl.accept = [0.5, 0.5, 0.5]
    assert ctl.expected_tokens(0) == 1.0
    assert ctl.expected_tokens(3) == 1 + 0.5 + 0.25 + 0.125


def test_plain_decoding_found_beyond_the_neighbours():
    """Where drafting at any depth costs a jump over plain decoding (the head
    runs at all), depth 2 can beat its neighbours 1 and 3 while 0 beats it:
    the controller still finds 0 (it probes it directly)."""
    def cost(t):  # verify of t tokens: a head's fixed cost once drafting
        return 1.0 if t == 1 else 1.6 + 0.3 * t

    ctl, got, best = simulate([0.75, 0.7, 0.5, 0.4], cost, 0.15, cycles=1500)
    assert ctl.k == 0
    assert got >= 0.9 * best


def test_probes_cost_at_most_the_budget():
    """Once settled, probes that change nothing take about PROBE_BUDGET of the time."""
    ctl, got, best = simulate([0.5, 0.3, 0.2, 0.1], lambda t: 1.0 if t == 1 else 2.5 + 0.3 * t,
                              0.3, cycles=6000)
    assert ctl.k == 0
    assert got >= 0.97 * best


def test_no_probe_starts_within_quiet_cycles():
    """Parked (plain decoding pays), the controller says how many launches
    pass before a probe may start, its spacing after probes that changed
    nothing included: no probe starts sooner (the loop fills the head's
    ring only for the last cycles before one)."""
    rng = random.Random(1)
    ctl = DepthController(max_depth=4)
    promised = 0  # the launch before which no probe may start
    probes, parked, far = 0, 0, 0
    for n in range(6000):
        k = ctl.next_depth()
        if k and ctl.k == 0:
            assert n >= promised, (n, promised)
            probes += 1
        a = sum(1 for _ in range(k) if rng.random() < 0.6)
        ctl.update(k, a, (1.0 if k == 0 else 2.2 + 0.4 * k) * (1 + rng.uniform(-0.05, 0.05)))
        if ctl.k == 0 and ctl._probe_left == 0:
            promised = max(promised, n + 1 + ctl.quiet_cycles())
            parked, far = parked + 1, far + (ctl.quiet_cycles() > 17)
    assert ctl.k == 0 and probes >= 10  # parked, probing now and then
    assert far > 0.8 * parked  # mostly far from the next probe: depth 0's graph
