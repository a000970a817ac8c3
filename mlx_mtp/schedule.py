"""What the next cycle does, decided in one place (docs/design.md, "One cycle,
file by file").

The batch (batch.py) asks `Schedule.plan` for each cycle and executes the
frozen `Plan` it gets; `Schedule.ahead` says how many it queues before
reading one. The policy is all here: the depth (fixed, or the `auto`
controller of the batch's size, depth.py), the lookahead, the draft budget,
the grammars' forced runs verified alone (jumps) and parked cold steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .cycle import RING, Spec
from .depth import DepthController
from .distributed import agree
from .params import env_flag

# the widths a cycle takes past the head's chain for context runs (a graph each)
CONTEXT_WIDTHS = (4, 8, 16)
# a run the grammars force past the depth is verified alone in one forward
# of one of these lengths (a graph each; what is left of a run goes next cycle)
JUMPS = (2, 3, 4, 6, 8, 12, 16)


@dataclass(frozen=True)
class Plan:
    """The next cycle, as `Schedule.plan` decided it before the batch queues
    it (`Batch._launch`): nothing else decides."""

    k: int  # its depth (drafts verified; a jump's forced run length)
    jump: bool  # it verifies the grammars' forced run alone, no head draft
    catch_up: bool  # the head first catches up on the ring's plain steps
    cold: bool  # a parked plain step on depth 0's graphs (the ring dropped)
    forward_only: bool  # a guided plain step queued ahead: its forward, sampled at its read
    guided: bool  # the rows' grammars mask it now
    runs: Optional[tuple] = None  # each row's forced run, when known
    head: Optional[int] = None  # the head's chain (None: k); past it, a context run's width
    context: bool = False  # rows whose suffix occurred before draft their context run


@dataclass
class ContextPolicy:
    """How wide a cycle is for the rows' context runs (docs/design.md,
    "Context drafts"; whether a row drafts its run is the row's own choice,
    on the device: `cycle.trusted`). The width: a run kept whole
    proposes the next of CONTEXT_WIDTHS, one cut short the widest of them
    that what was kept + 1 fills (none: the head's depth); a proposal is
    taken when its expected tokens per second beat the head's depth's (each run position kept with the measured rate, each
    width's cycle cost measured by batch size), and tried once when its
    cost is not measured yet."""

    ALPHA = 0.2  # the run keep rate's and the costs' weight on a new sample
    MIN_SAMPLES = 2  # cost samples before a width's cost is trusted

    width: int = 0  # the width proposed for the next cycle (0: the head's depth)
    # [seconds, samples] of a cycle by (width, the head's chain, batch-size
    # bucket): the model's (Runtime.width_costs, kept across generations)
    costs: dict = field(default_factory=dict)
    keep: float = 0.9  # how often a run's draft is kept, given those before it were

    def expected_tokens(self, width: int) -> float:
        """A copying row's tokens from a cycle of this width."""
        return sum(self.keep ** i for i in range(width + 1))

    def choose(self, head: int, rows: int) -> int:
        """The next cycle's width, the head's chain being `head` drafts."""
        if self.width <= head:
            return head
        widths = [head] + [w for w in CONTEXT_WIDTHS if head < w <= self.width][-2:]
        rates = [self._rate(w, head, rows) for w in widths]
        if None in rates:
            return widths[rates.index(None)]  # (measure it)
        return widths[rates.index(max(rates))]

    def _rate(self, width: int, head: int, rows: int) -> Optional[float]:
        seconds, n = self.costs.get((width, head, _bucket(rows)), (0.0, 0))
        return None if n < self.MIN_SAMPLES else self.expected_tokens(width) / seconds

    def observe(self, k: int, accepted: Sequence[int], context: Sequence[bool]):
        """A read drafted cycle of width k: each row's drafts kept, and
        whether they were its context run."""
        runs = [a for a, c in zip(accepted, context) if c]
        for a in runs:  # the positions reached
            for j in range(min(k, a + 1)):
                self.keep += self.ALPHA * (float(j < a) - self.keep)
        best = max(runs, default=0)
        wider = [w for w in CONTEXT_WIDTHS if w > k]
        fits = [w for w in CONTEXT_WIDTHS if w <= best + 1]
        self.width = 0 if not runs else (wider[0] if wider else k) if best == k else \
            (fits[-1] if fits else 0)

    def observe_plain(self, available: Sequence[bool]):
        """A read plain step: whether each row has a run to draft now (the
        head parked, a cycle of runs alone may pay)."""
        if any(available) and self.width == 0:
            self.width = CONTEXT_WIDTHS[0]

    def observe_cost(self, width: int, head: int, rows: int, seconds: float):
        """A cycle's measured seconds (`depth.cost_sample`)."""
        key = (width, head, _bucket(rows))
        old, n = self.costs.get(key, (seconds, 0))
        self.costs[key] = [old + max(self.ALPHA, 1 / (n + 1)) * (seconds - old), n + 1]


def _bucket(rows: int) -> int:
    """Batch sizes that share a cost (powers of two, as the `auto` controllers)."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass(frozen=True)
class CycleRecord:
    """A read cycle as the schedule observes it (`Schedule.observe`; the
    batch builds it at each read): what was drafted, by which source, what
    was kept, and what the cycle the host waited on cost."""

    k: int  # drafts per row (0: a plain step)
    head: int  # of them, the head's chain (less than k: a context run's width)
    jump: bool  # the grammars' forced run verified alone
    rows: int  # the batch's size when it was launched
    accepted: Tuple[int, ...]  # per row still in the batch: drafts kept
    # per row: a drafted cycle's row drafted its context run; a plain step's
    # row has one to draft now
    context: Tuple[bool, ...]
    # the cycle the host waited on (`depth.cost_sample`): (k, head's chain,
    # batch size, seconds), or None when the interval measured no one cycle
    cost: Optional[Tuple[int, int, int, float]] = None


def cycles_of(row, in_flight: Sequence) -> list:
    """The cycles in flight that carry this row."""
    return [c for c in in_flight if row in c.rows]


def mtp_disabled_by_env() -> bool:
    return env_flag("MLX_MTP_DISABLE")


class Schedule:
    """A batch's policy: its fixed settings (depth, most drafts, controller,
    whether it may look ahead) and what follows from its rows (`settle`)."""

    @classmethod
    def of(cls, options, has_mtp: bool) -> "Schedule":
        """The schedule `options` (DecodeOptions) ask for on a model with or
        without an MTP head: depth 0 and no controller without a head or
        under MLX_MTP_DISABLE=1; a controller (a test's) only at 'auto'."""
        depth, controller = options.draft_tokens, options.controller
        if mtp_disabled_by_env() or not has_mtp:
            depth = 0
        if depth != "auto":
            controller = None
        return cls(depth, options.max_draft_tokens, controller, options.lookahead)

    @property
    def use_head(self) -> bool:
        """The head drafts (at a fixed depth, or as `auto` decides)."""
        return self.depth != 0

    def __init__(self, depth, max_depth: int, controller: Optional[DepthController],
                 may_look_ahead: bool):
        self.depth, self.max_depth = depth, max_depth
        self.fixed_controller, self.may_look_ahead = controller, may_look_ahead
        self.guided = False  # some row has a grammar
        self.lookahead = 0  # cycles queued before one is read (ungrammared batches)
        self.guided_ahead = False  # a guided batch may queue a plain step's forward ahead
        self.context = ContextPolicy()

    def measures(self, spec: Spec, batch_size: int) -> bool:
        """Whether a read's cost is of use (`CycleRecord.cost`): to an `auto`
        controller, or to the context runs' widths."""
        return spec.context is not None or self.controller(spec, batch_size) is not None

    def observe(self, spec: Spec, read: CycleRecord):
        """A read cycle: the `auto` controller of the batch size it ran at
        learns the head's acceptance and cost from it (a jump, a cycle wider
        than the head's chain or one with context runs is none of its
        depths' samples), the context policy its runs and widths."""
        runs = bool(read.k) and any(read.context)
        if spec.context is not None:
            if read.k and not read.jump:
                self.context.observe(read.k, read.accepted, read.context)
            elif not read.k:
                self.context.observe_plain(read.context)
            if read.cost is not None:
                self.context.observe_cost(*read.cost)
        ctl = self.controller(spec, read.rows)
        if ctl is None or not read.accepted or read.jump or read.head < read.k or runs:
            return
        ctl.update_acceptance(read.k, list(read.accepted))
        if read.cost is not None and read.cost[0] == read.cost[1]:  # (not a widened cycle)
            ctl.update_cost(read.cost[0], read.cost[3])

    def settle(self, spec: Spec, rows: list):
        """The flags the present rows imply. A grammar's masks for a cycle need
        the cycle before it read: a guided batch queues ahead only a plain
        step's forward (`ahead`)."""
        self.context.costs = spec.model.runtime.width_costs
        self.guided = any(r.matcher is not None for r in rows)
        may = self.may_look_ahead and not spec.host_history and spec.trusted_sampler
        self.lookahead = 1 if may and not self.guided else 0
        self.guided_ahead = may and self.guided

    def controller(self, spec: Spec, batch_size: int) -> Optional[DepthController]:
        """The `auto` controller of a batch of `batch_size` rows, or None at a
        fixed depth."""
        if self.depth != "auto":
            return None
        if self.fixed_controller is not None:
            return self.fixed_controller
        return controller_for(spec, self.max_depth, batch_size)

    def parked(self, spec: Spec, batch_size: int) -> bool:
        """Whether `auto` has a batch of this size decoding plainly (depth 0)."""
        ctl = self.controller(spec, batch_size)
        return ctl is not None and ctl.k == 0

    def ahead(self, spec: Spec, rows: list, in_flight: Sequence, starting: bool) -> int:
        """Cycles queued before the oldest is read. None before a batch's first
        read: on MLX's CPU backend queuing one runs most of it, which would
        delay the first token. A guided batch queues one ahead only while its
        next cycle is surely a plain step: then its forward, whose masked
        sample follows once the cycle before is read (`Batch._complete`); a
        drafted cycle's drafts need their masks at once."""
        if starting:
            return 0
        if not self.guided_ahead:
            return self.lookahead
        ctl = self.controller(spec, len(rows))
        if ctl is None:
            return int(self.depth == 0)
        # parked: not when every grammar forces 3 tokens from the last read (the
        # next launch, after this read, may then jump a run of 2 or more), nor
        # when a row has a context run to draft (the next launch may draft it)
        return int(ctl.k == 0 and ctl.quiet_cycles() > 0
                   and not self._may_jump(spec, rows, in_flight, 3)
                   and not (spec.context is not None and self.context.width > 0))

    def plan(self, spec: Spec, rows: list, in_flight: Sequence, ring: int) -> Optional[Plan]:
        """The next cycle (None: a guided batch's next cycle drafts, so it
        waits for the one in flight to be read). `ring`: the plain steps'
        pairs waiting for the head, as launched (rows.Ledger)."""
        ctl = self.controller(spec, len(rows))
        depth = self.depth if ctl is None else ctl.k
        budget = self._draft_budget(spec, rows, in_flight)
        runs = self._forced_runs(spec, rows, in_flight, depth, budget)
        jump = _jump(depth, runs)
        # a jump takes no depth from the controller (its probes wait)
        k = jump or (ctl.next_depth() if ctl is not None else self.depth)
        if budget is not None:
            k = min(k, budget)
        forward_only = self.guided and bool(in_flight)
        if forward_only and k:
            return None
        # parked (depth 0), rows with a run to draft may still draft it: the head
        # drafts none (its chain of 0)
        parked_run = (k == 0 and ctl is not None and spec.context is not None and not forward_only
                      and self.context.width > 0 and (budget is None or budget >= 1))
        head = k
        context = spec.context is not None and (k > 0 or parked_run) and not jump
        if context:  # (a context run's width may pass the head's chain: one of
            # CONTEXT_WIDTHS, within the budget)
            wide = self.context.choose(k, len(rows))
            k = max([k] + [w for w in CONTEXT_WIDTHS if w <= wide and (budget is None
                                                                       or w <= budget)])
        return Plan(k=k, jump=bool(jump), catch_up=k > 0 and ring > 0,
                    cold=self._cold(spec, ctl, k), forward_only=forward_only,
                    guided=self.guided and not forward_only,
                    runs=None if runs is None else tuple(tuple(r) for r in runs),
                    head=head, context=context)

    def _cold(self, spec: Spec, ctl: Optional[DepthController], k: int) -> bool:
        """Whether this plain step of a parked batch may skip the head's part of
        the state: no probe within the ring's length (the ring then holds the
        last plain steps when the head catches up). Parking then costs what
        fixed depth 0 costs (docs/design.md §3, plain_step). Not for sharded
        models (every rank must run the same graphs)."""
        return not (k or ctl is None or ctl.k or spec.group is not None or not spec.use_head
                    or ctl.quiet_cycles() <= RING + max(self.lookahead, int(self.guided_ahead)))

    def _draft_budget(self, spec: Spec, rows: list, in_flight: Sequence) -> Optional[int]:
        """The most drafts a cycle may verify: none past what the rows asked
        for (None: no bound; none while rows sample: a seeded row's draws at a
        fixed depth must not depend on the rows beside it)."""
        if spec.speculative or any(r.max_tokens < 0 for r in rows):
            return None
        return max(max(r.max_tokens - r.landed - len(cycles_of(r, in_flight))
                       for r in rows) - 1, 0)

    def _jumps_allowed(self, spec: Spec, rows: list) -> bool:
        """Whether this batch may verify forced runs alone (`_jump`): every
        row has a grammar, the head is there (not plain decoding at a fixed
        depth 0), and no sampled row at a fixed depth (a sampled row's keys
        per cycle follow its cycles, which there must not depend on the rows
        beside it; under auto they do anyway)."""
        return (self.guided and spec.use_head and spec.drafter is None
                and not (spec.speculative and self.depth != "auto")
                and all(r.matcher is not None for r in rows))

    def _may_jump(self, spec: Spec, rows: list, in_flight: Sequence, n: int) -> bool:
        """Every row's grammar forces at least n tokens from the last read,
        and the rows ask for enough tokens to jump."""
        budget = self._draft_budget(spec, rows, in_flight)
        return (self._jumps_allowed(spec, rows) and (budget is None or budget >= JUMPS[0])
                and all(len(r.matcher.forced(limit=n)) >= n for r in rows))

    def _forced_runs(self, spec: Spec, rows: list, in_flight: Sequence, depth: int,
                     budget: Optional[int]) -> Optional[List[List[int]]]:
        """Each row's run of tokens its grammar forces from here (at most
        `budget`), when every run is longer than `depth` and than 1 (a jump
        may follow) and no cycle is in flight; else None (`Batch._guidance`
        then finds each row's first k). Each run is looked for only as far as
        the shortest so far."""
        if in_flight or not self._jumps_allowed(spec, rows):
            return None
        limit = JUMPS[-1] if budget is None else min(JUMPS[-1], budget)
        runs = []
        for r in rows:
            run = r.matcher.forced(limit=limit)
            if len(run) <= max(depth, 1):
                return None
            runs.append(run)
            limit = len(run)
        return runs


def controller_for(spec: Spec, max_depth: int, batch_size: int) -> DepthController:
    """The adaptive controller for this model, mode and batch size (a verify
    costs more at a larger batch, so each size learns its own depth; sizes
    share a controller within powers of two). Kept on the model across calls."""
    bucket = _bucket(batch_size)
    key = (max_depth, spec.speculative,
           None if spec.draft_vocab is None else spec.draft_vocab.size, bucket)
    controllers = spec.model.runtime.controllers
    ctl = controllers.get(key)
    if ctl is None:
        # sharded: every rank switches depth when rank 0 does (timings differ by rank)
        agreed = None if spec.group is None else (lambda v: agree(v, spec.group))
        # a verify costs more at a larger batch: start no deeper than the
        # largest smaller size settled on
        smaller = [c.k for other, c in controllers.items()
                   if other[:-1] == key[:-1] and other[-1] < bucket]
        ctl = controllers[key] = DepthController(
            max_depth=max_depth, agree=agreed, initial=min([1] + smaller[-1:]))
    return ctl


def needs_more(row, in_flight: Sequence) -> bool:
    """Each cycle emits at least one token for each of its rows."""
    return row.max_tokens < 0 or row.landed + len(cycles_of(row, in_flight)) < row.max_tokens


def _jump(depth: int, runs: Optional[List[List[int]]]) -> int:
    """The depth of a cycle that verifies the grammars' forced tokens alone
    (0: none): when every row's run is longer than `depth`, one forward of a
    JUMPS length takes it, no head draft and no host read mid-cycle
    (docs/design.md §10); parked at depth 0 too (a jump of 2 emits 3 tokens
    from one forward of 3: 1.3 decodes for one row on this CPU, against 3
    plain steps)."""
    if not runs:
        return 0
    fits = [j for j in JUMPS if j <= min(len(r) for r in runs)]
    return fits[-1] if fits and fits[-1] > depth else 0
