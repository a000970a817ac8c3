"""Adaptive draft depth: pick k per cycle from measured acceptance and cost.

Throughput at depth k is E[tokens per cycle](k) / cost(k), with
    E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j
where a_j is the measured acceptance of draft j given drafts 1..j-1 were
accepted, and cost(k) the measured seconds of a depth-k cycle (moving
averages of both). k = 0 (plain decoding, head idle) is a candidate, so the
controller never settles on drafting that does not pay. A neighbouring depth
is probed now and then — and depth 0 too, every third probe, since the step
from drafting to none is not a smooth one (no head runs at 0): a search of
neighbours alone can settle on a depth that only beats its neighbours. The
controller switches only right after a probe, comparing the probe's own
cycles with the current depth's cycles just before it: both fresh, so a
machine whose speed drifts over minutes cannot make a stale measurement look
cheap. A switch needs a clear predicted gain (hysteresis); probes that change
nothing come ever more rarely, and a depth whose probe changed nothing is
not probed again sooner than its measured cost allows (PROBE_BUDGET of the
run's time per depth; a costly look at plain decoding does not delay a
cheap look deeper).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

if TYPE_CHECKING:
    from .rows import Launched


class DepthController:
    PROBE_SAMPLES = 3  # cycles a probe measures (after its first), compared by their median
    PROBE_BUDGET = 0.015  # probes that change nothing cost at most this share of the time

    def __init__(
        self,
        max_depth: int = 4,
        *,
        alpha: float = 0.1,
        probe_every: int = 16,
        max_interval: int = 256,
        hysteresis: float = 0.04,
        initial: int = 1,
        min_samples: int = 2,
        agree=None,
    ):
        self.max_depth = max_depth
        self.alpha = alpha
        self.probe_every = probe_every
        self.max_interval = max_interval
        self.interval = probe_every
        self.hysteresis = hysteresis
        self.min_samples = min_samples
        # sharded models: takes this rank's decision, returns rank 0's
        self.agree = agree or (lambda decision: decision)
        self.k = min(initial, max_depth)
        # acceptance of position j given 1..j-1 accepted; optimistic prior
        self.accept: List[float] = [0.7] * max_depth
        self.accept_n: List[int] = [0] * max_depth
        self.cost: Dict[int, float] = {}
        self.cost_n: Dict[int, int] = {}
        self.cycles = 0
        # the first probe comes early: a head that cannot draft this text
        # should cost only a few cycles before depth 0 is measured
        self.since_probe = max(0, probe_every - 4)
        self._probing = self.k
        self._probe_left = 0
        self._probe_side = 1  # the first probe looks shallower (plain decoding is cheap to try)
        self._keep_side = False
        self._probe_seen = False
        self._probe_costs: List[float] = []
        self._probe_first = 0.0  # the cost of a probe's first cycle (the switch's)
        self._probe_samples = self.PROBE_SAMPLES  # plain decoding, cheap, gets a longer look
        self._probes = 0
        # a depth whose probe changed nothing is not probed again before this
        # cycle: its probe's measured cost spaced by PROBE_BUDGET (per depth,
        # since a costly look at plain decoding says nothing of a deeper one)
        self._not_before: Dict[int, int] = {}

    # -- model -----------------------------------------------------------------
    def expected_tokens(self, k: int) -> float:
        e, p = 1.0, 1.0
        for j in range(k):
            p *= self.accept[j]
            e += p
        return e

    def estimated_cost(self, k: int) -> Optional[float]:
        if self.cost_n.get(k, 0) >= self.min_samples:
            return self.cost[k]
        known = sorted(d for d, n in self.cost_n.items() if n >= self.min_samples)
        if len(known) < 2:
            return None
        # least-squares line through the measured depths, never decreasing in k
        # (noise must not make a deeper cycle look cheaper than a measured one)
        xs, ys = known, [self.cost[d] for d in known]
        mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx_) ** 2 for x in xs)
        slope = max(slope, 0.0)
        est = my + slope * (k - mx_)
        floor = max((self.cost[d] for d in known if d < k), default=0.0)
        return max(est, floor)

    def throughput(self, k: int) -> Optional[float]:
        c = self.estimated_cost(k)
        return None if c is None or c <= 0 else self.expected_tokens(k) / c

    # -- feedback ----------------------------------------------------------------
    def update(self, k: int, accepted: int, seconds: float):
        """Record one cycle of depth k that accepted `accepted` drafts in `seconds`."""
        self.update_acceptance(k, accepted)
        self.update_cost(k, seconds)

    def update_acceptance(self, k: int, accepted: Union[int, List[int]]):
        """One cycle's acceptance: one count, or one per batch row."""
        self.cycles += 1
        self.since_probe += 1
        for a in accepted if isinstance(accepted, list) else [accepted]:
            for j in range(min(k, a + 1)):  # positions reached this cycle
                self.accept_n[j] += 1
                hit = 1.0 if j < a else 0.0
                self.accept[j] = self._average(self.accept[j], hit, self.accept_n[j], prior=1)

    def update_cost(self, k: int, seconds: float):
        if self._probe_left > 0 and k == self._probing:
            if not self._probe_seen:  # the switch's own cycle (e.g. the head catching
                self._probe_seen = True  # up on plain steps) is no sample of the depth
                self._probe_first = seconds
                return
            self._probe_costs.append(seconds)
        n = self.cost_n.get(k, 0) + 1
        self.cost_n[k] = n
        self.cost[k] = self._average(self.cost.get(k, 0.0), seconds, n)

    def _average(self, old: float, x: float, n: int, prior: int = 0) -> float:
        """Running mean for the first samples, then an exponential moving
        average, so a few cycles already give a usable estimate."""
        w = max(self.alpha, 1.0 / (n + prior))
        return (1 - w) * old + w * x

    # -- decision ----------------------------------------------------------------
    def quiet_cycles(self) -> int:
        """Launches before which no probe starts, for a controller at depth 0
        (a lower bound: a probe blocked by its spacing waits for a later
        interval; 0 while one runs). Parked, the loop runs depth 0's own graph
        until then and fills the head's ring only for the last cycles before
        it (schedule.py, `Schedule._cold`); an early or late probe costs acceptance, never
        exactness."""
        if self._probe_left > 0:
            return 0
        blocked = min((self._not_before.get(c, 0) for c in (self.k - 1, self.k + 1)
                       if 0 <= c <= self.max_depth), default=0)
        return max(0, self.interval - self.since_probe, blocked - self.cycles)

    def next_depth(self) -> int:
        if self._probe_left > 0:  # finish a probe: cycles at a neighbour depth until it
            # has min_samples new cost samples (they may arrive a cycle late, or be
            # skipped, e.g. a cycle that compiled its graph), a bounded number of times
            self._probe_left -= 1
            if len(self._probe_costs) < self._probe_samples and self._probe_left > 0:
                return self._probing
            self._probe_left = 0
            self._decide()
            return self.k
        if self.cost_n.get(self.k, 0) < self.min_samples:  # measure the current depth
            return self.k
        if self.since_probe >= self.interval:  # try a neighbour, or plain decoding
            self.since_probe = 0
            self._probes += 1
            if not self._keep_side:
                self._probe_side = -self._probe_side
            if self.k > 0 and self.accept[self.k - 1] < 0.5:
                self._probe_side = -1  # drafts at depth k mostly fail: look shallower
            cands = (self.k + self._probe_side, self.k - self._probe_side)
            if self.k > 1 and self._probes % 3 == 0 and not self._keep_side:
                cands = (0,)
            for cand in cands:
                if 0 <= cand <= self.max_depth and self.cycles >= self._not_before.get(cand, 0):
                    self._probing, self._probe_left = cand, 2 * self.PROBE_SAMPLES + 2
                    self._probe_costs, self._probe_seen = [], False
                    self._probe_samples = self.PROBE_SAMPLES + (2 if cand == 0 else 0)
                    return cand
        return self.k

    def _decide(self):
        """After a probe: switch to the probed depth if it is clearly faster,
        its cost from the probe's cycles alone, the current depth's from its
        moving average (the cycles just before the probe). Shallower only
        needs to be no slower: on a tie, less drafting is less work (room for
        more rows, less heat) and less exposed to a noisy measurement."""
        j, samples = self._probing, sorted(self._probe_costs)
        t_cur = self.throughput(self.k)
        t_new = self.expected_tokens(j) / samples[len(samples) // 2] if samples else None
        margin = self.hysteresis if j > self.k else 0.0
        switch = t_new is not None and t_cur is not None and t_new > t_cur * (1 + margin)
        if self.agree(int(switch)):
            self._probe_side = 1 if j > self.k else -1  # it paid: look further that way
            self._keep_side = True
            self.k = j
            self.interval = self.probe_every
            self._not_before.clear()  # a new depth: what its neighbours cost is unknown
        else:
            self._keep_side = False
            self.interval = min(2 * self.interval, self.max_interval)
            self._not_before[j] = self.cycles + self._spacing(samples)

    def _spacing(self, samples: List[float]) -> int:
        """Cycles between probes for this one's cost (its cycles beyond what
        the current depth would have taken, tokens considered) to stay within
        PROBE_BUDGET of the time."""
        cur = self.estimated_cost(self.k)
        if not cur or not samples:
            return 0
        e_cur, e_new = self.expected_tokens(self.k), self.expected_tokens(self._probing)
        spent = self._probe_first + sum(samples)
        # the same tokens at the current depth would have cost
        worth = (1 + len(samples)) * e_new / e_cur * cur
        return int(max(0.0, spent - worth) / (self.PROBE_BUDGET * cur))


def cost_sample(read: "Launched", newest: "Launched", *, lookahead: bool, distributed: bool,
                first: bool, launches: int, since: float, now: float
                ) -> Optional[Tuple["Launched", float]]:
    """The (cycle, seconds) that the time between two reads measured, or None
    when it measured no one cycle. `read`: the cycle just read; `newest`: the
    last one queued (`read` itself without lookahead); `since`: the previous
    read's end; `launches`: cycles queued since then."""
    # the sample goes to the cycle the host waited on: on MLX's CPU backend
    # async_eval itself runs most queued work (at most ~10 tasks in flight),
    # so there it is the one just launched
    t0, t1 = newest.stamps["build0"], newest.stamps["queued"]
    waited_on = newest if lookahead and t1 - t0 > now - t1 else read
    if distributed:  # which depth gets the sample must not differ by rank
        waited_on = read
    # the interval spans both cycles: a sample only when they ran the same
    # rows, and when it held one launch (a batch's second read follows
    # two: the lookahead's, and would count as a cycle twice as slow);
    # not a batch's first read (its cycle also finishes the prompt's work)
    if first or read.traced or newest.traced or len(newest.rows) != len(read.rows) \
            or launches != 1:
        return None
    return waited_on, now - since
