"""Rows: what a request brings to a batch, what the host keeps for it while
it decodes, and how it leaves (docs/design.md, "Finishing").

A row's prompt cache (mlx_lm's objects) is held while the row decodes: its
arrays move into the batch's decoding state (`HeldCache.take`), and when the
row finishes the state at its finishing point is written back and the tokens
it emitted up to there are fed (`HeldCache.give_back`), so the cache holds
exactly what mlx_lm's would: the prompt and every token the caller used,
nothing drafted or rejected.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, FrozenSet, List, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList, KVCache

from .cache import MTPCache, fill_empty, head_caches
from .cycle import RING, DecodeState, Forwarded, Spec, ring_order
from .params import env_flag
from .prefill import catch_up, feed
from .sampling import RowSampling

if TYPE_CHECKING:
    from .constraint import Matcher
    from .cycle import Graphs



def mix_seed(seed: int) -> int:
    """splitmix64 of the user's seed. MLX keys of nearby seeds give measurably
    correlated samples; mixing makes runs with seeds 0, 1, 2, ... independent."""
    m = (1 << 64) - 1
    z = (int(seed) + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def row_key(sampling: Optional[RowSampling], seed: Optional[int]) -> Optional[mx.array]:
    """A sampled row's key [1, 2] (None when greedy): from the seed, else
    drawn from mx.random (so mx.random.seed makes runs repeatable too)."""
    if sampling is None or sampling.greedy:
        return None
    key = (mx.random.key(mix_seed(seed)) if seed is not None
           else mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32))
    return key[None]


@dataclass
class MTPStats:
    """Counters of one generation. Acceptance at position i is the fraction of
    cycles that drafted a token at position i and had it accepted."""

    cycles: int = 0
    emitted: int = 0
    drafted_at: List[int] = field(default_factory=list)
    accepted_at: List[int] = field(default_factory=list)
    forced: int = 0  # drafts a grammar forced (they take the head's place)
    jumps: int = 0  # cycles that verified a forced run alone (no head draft)

    def record(self, depth: int, accepted: int):
        self.cycles += 1
        self.emitted += accepted + 1
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < accepted)

    def add(self, other: "MTPStats"):
        """Add another generation's counters to these (benches pool runs)."""
        self.cycles += other.cycles
        self.emitted += other.emitted
        self.forced += other.forced
        self.jumps += other.jumps
        for i, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at)):
            while len(self.drafted_at) <= i:
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += d
            self.accepted_at[i] += a

    @property
    def drafted(self) -> int:
        return sum(self.drafted_at)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)

    @property
    def acceptance(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_cycle(self) -> float:
        return self.emitted / self.cycles if self.cycles else 0.0

    def usage(self) -> dict:
        """As the server reports them (`usage.mtp`; a grammar's forced drafts
        and the runs verified alone when it forced any)."""
        out = {"drafted": self.drafted, "accepted": self.accepted,
               "acceptance": [round(a, 4) for a in self.acceptance],
               "tokens_per_cycle": round(self.tokens_per_cycle, 4), "cycles": self.cycles}
        if self.forced:
            out.update(forced=self.forced, jumps=self.jumps)
        return out


@dataclass
class Lengths:
    """A row's cache lengths and the pairs written to its ring since the head
    caught up, as the host knows them (`Ledger` keeps them)."""

    trunk: int
    head: int
    ring: int = 0

    def flushed(self) -> "Lengths":
        """After the head caught up on the ring (its last RING pairs)."""
        return Lengths(self.trunk, self.head + min(self.ring, RING), 0)

    def after(self, k: int, accepted: int, ring: bool = True) -> "Lengths":
        """After a cycle of depth k: a plain step writes a pair into the ring,
        or (ring False: depth 0's graph, parked) drops the ring."""
        if k == 0:
            return Lengths(self.trunk + 1, self.head, self.ring + 1 if ring else 0)
        return Lengths(self.trunk + accepted + 1, self.flushed().head + accepted + 1, 0)


@dataclass
class Request:
    """One sequence for `Batch.add` (made by `Batch.prepare`, which checks it)."""

    prompt: List[int]  # the tokens after what the prompt cache holds
    prompt_cache: list
    keep_cache: bool  # the caller holds the cache: write it back when the row finishes
    max_tokens: int  # -1: no limit
    key: Optional[mx.array]  # [1, 2]: a sampled row's key
    stats: "MTPStats"  # its counters
    sampling: Optional[RowSampling] = field(default_factory=RowSampling)  # None: opaque
    processors: tuple = ()  # mlx_lm logits processors (this row only)
    progress: Optional[Callable[[int, int], None]] = None  # prompt tokens done, total
    stops: tuple = ()  # prompt token counts after which `snapshot(n)` is called
    snapshot: Optional[Callable[[int], None]] = None
    cached_tokens: tuple = ()  # tokens before `prompt` (cached) that the processors see first
    stop_tokens: FrozenSet[int] = frozenset()  # a row ends with the first of these
    feed_tail: bool = True  # see `Batch.finish`
    matcher: Optional["Matcher"] = None  # the row's grammar (constraint.py), at its start


class FinishPoint(NamedTuple):
    """A row's finishing point: where its prompt cache is written from."""

    before: Optional[DecodeState]  # the state before its last read cycle (no KV buffers)
    index: int  # the row's index in `before`
    lens: "Lengths"  # its lengths then
    y: int  # its y then
    tokens: List[int]  # that cycle's tokens, of which the caller used `Row.used`


class Pending(NamedTuple):
    """A guided plain step queued ahead: its forward only, until the cycle
    before it is read (`Batch._complete` queues its masked sample)."""

    graphs: "Graphs"  # the graphs it runs on (a parked batch's depth 0 ones when cold)
    state: DecodeState  # the state after the forward
    fwd: Forwarded
    cold: bool  # depth 0's graph: the head's part comes from the batch's state


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """What the host keeps for one sequence of a batch."""

    held: "HeldCache"  # its prompt cache
    max_tokens: int  # -1: no limit
    stop_tokens: FrozenSet[int]
    feed_tail: bool
    stats: "MTPStats"
    lens: "Lengths"  # after the cycles read so far (exact; `Ledger` writes it)
    sampling: Optional[RowSampling]
    processors: tuple = ()
    landed: int = 0  # tokens read so far
    emitted: int = 0  # tokens handed to the caller (events)
    last: Optional[FinishPoint] = None  # its finishing point
    used: int = 0  # of its last read cycle's tokens, those handed out
    history: Optional[mx.array] = None  # the row's tokens (logits processors)
    bias: Optional[mx.array] = None  # [V]: its logit bias, built once
    matcher: Optional["Matcher"] = None  # its grammar, at the tokens read so far
    done: bool = False



@dataclass
class Launched:
    """A cycle queued on the device, until the host reads it."""

    k: int
    out: object  # StepOutput
    before: Optional[DecodeState]  # the state it started from, without KV buffers
    traced: bool  # its launch traced a graph (slow: not a cost sample)
    rows: list  # the batch's rows, in order, when it was launched
    stamps: dict  # perf_counter times of its launch
    flush_after: bool = False  # the head caught up right after it (rows joined)
    cold: bool = False  # a parked plain step of depth 0's graph (the ring dropped)
    counts: Optional[dict] = None  # the device's counters after it (Ledger.checking)
    pending: Optional[Pending] = None  # its masked sample not queued yet
    jump: bool = False  # it verified the grammars' forced run alone (Batch._jump)


class Ledger:
    """The host's copies of the device's counters, kept by one object
    (docs/design.md, "One owner per fact") for the batch (batch.py): each row's cache lengths and ring
    pairs after the cycles read (`Row.lens`, exact), and the ring's count
    after the cycles launched (`ring`, the same for every row). The batch
    tells it each change it makes to those counters on the device: a launch,
    a flush, a read. With MLX_MTP_CHECK_COUNTS=1 (the tests set it) each read
    compares them with the device's own."""

    def __init__(self):
        self.ring = 0  # plain steps' pairs waiting for the head, as launched
        self.checking = env_flag("MLX_MTP_CHECK_COUNTS")

    def launched(self, cycle: "Launched", use_head: bool, state: DecodeState):
        """A cycle was queued, leaving the device in `state`."""
        self.ring = 0 if cycle.k or cycle.cold else self.ring + int(use_head)
        if self.checking:
            cycle.counts = _device_counts(state)

    def flushed(self, inflight: deque, rows: List[Row]):
        """The head caught up on the ring (before rows join). The rows' lengths
        count it once the cycles launched before it are read."""
        self.ring = 0
        if inflight:
            inflight[-1].flush_after = True
        else:
            for r in rows:
                r.lens = r.lens.flushed()

    def read(self, row: Row, cycle: "Launched", index: int, accepted: int) -> Lengths:
        """The row's lengths after a read cycle (returns those before it)."""
        before = row.lens
        after = before.after(cycle.k, accepted, ring=not cycle.cold)
        if self.checking:
            _compare(after, cycle.counts, index)
        row.lens = after.flushed() if cycle.flush_after else after
        return before

    def bound(self, row: Row, inflight: Sequence["Launched"]) -> Lengths:
        """The row's lengths after the launched cycles if each accepted every draft."""
        lens = row.lens
        for c in inflight:
            if row in c.rows:
                lens = lens.after(c.k, c.k, ring=not c.cold)
                if c.flush_after:
                    lens = lens.flushed()
        return lens


def _device_counts(state: DecodeState) -> dict:
    """The device's counters the ledger mirrors (lazy: read with the cycle)."""
    def lengths(caches):
        for c in caches:
            c = c.caches[0] if hasattr(c, "caches") else c
            if hasattr(c, "lengths"):
                return c.lengths
        return None
    return {"trunk": lengths(state.cache.trunk), "head": lengths(state.cache.head),
            "ring": state.ring_n}


def _compare(lens: Lengths, counts: dict, index: int):
    device = {name: None if x is None else int(np.array(x).reshape(-1)[index if x.ndim else 0])
              for name, x in counts.items()}
    host = {"trunk": lens.trunk, "head": lens.head, "ring": lens.ring}
    wrong = {n: (host[n], d) for n, d in device.items() if d is not None and d != host[n]}
    if wrong:
        raise AssertionError(f"host counters differ from the device's (host, device): {wrong}")


def _let_go(caches: list):
    """Empty mlx_lm cache objects (their arrays live in the decoding form)."""
    for c in caches:
        if isinstance(c, KVCache):
            c.keys = c.values = None
            c.offset = 0
        elif isinstance(c, CacheList):
            _let_go(list(c.caches))
        else:
            c.cache = [None] * len(c.cache)


class HeldCache:
    """A row's prompt cache (mlx_lm's objects) while the row decodes on it:
    the row takes its arrays into the decoding state, leaving the objects
    empty (an array referenced twice would be copied by every in-place
    write), and gives back the state at its finishing point. `keep`: the
    caller holds the cache (else nobody sees it and nothing is given back).

    One generation at a time may hold a caller's cache: two would each write
    their own state into it. A second is refused while the first is open
    (`claim`; the caller's caches are only ever held by `loop.generate_events`:
    batch_generate decodes on copies, the server on its own)."""

    # the open generation on each cache, keyed weakly by the cache's first
    # object (a cache its caller dropped drops its entry)
    _open: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, prompt_cache: list, keep: bool):
        self.prompt_cache, self.keep = prompt_cache, keep

    @classmethod
    def claim(cls, prompt_cache: list, owner, gen):
        """`gen` holds the caller's cache until `release`: refused while
        another generation that still lives holds it."""
        entry = cls._open.get(prompt_cache[0])
        if entry is not None and entry[1]() is not None:
            raise ValueError("this prompt_cache is in use by a generation that is still open: "
                             "finish iterating it or call its close() first (two generations "
                             "on one cache would each write their own state into it)")
        cls._open[prompt_cache[0]] = (owner, weakref.ref(gen))

    @classmethod
    def release(cls, prompt_cache: list, owner):
        if cls._open.get(prompt_cache[0], (None,))[0] is owner:
            del cls._open[prompt_cache[0]]

    def take(self, model, use_head: bool) -> MTPCache:
        """The decoding form of the cache; its objects let go of the arrays."""
        n_trunk = len(model.is_linear)
        fill_empty(self.prompt_cache, model,
                   n_trunk + (len(model.mtp.layers) if use_head else 0))
        cache = MTPCache.from_prompt_cache(self.prompt_cache, n_trunk, use_head)
        _let_go(self.prompt_cache[:n_trunk] + (
            head_caches(self.prompt_cache, n_trunk) if use_head else []))
        return cache

    def give_back(self, spec: Spec, state: DecodeState, lens, tail: List[int]):
        """Write the row's state at its finishing point back into the cache,
        and feed the tokens it had emitted up to there (the last one used
        included), or none (tail empty)."""
        prompt_cache, n_trunk = self.prompt_cache, len(spec.model.is_linear)
        state.cache.write_back(prompt_cache, n_trunk, lens.trunk, lens.head)
        ring = None
        if spec.use_head and lens.ring:
            order = ring_order(lens.ring)
            ring = (state.ring_h[:, order], state.ring_tok[:, order])
        if tail:
            feed(spec, prompt_cache, tail, ring)
        else:  # the head catches up; the ring's last hidden is the trunk's last one
            catch_up(spec, prompt_cache, ring)  # (no ring: none is kept, a gap)
        mx.eval([c.state for c in prompt_cache])
