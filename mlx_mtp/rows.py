"""Rows: what a request brings to a batch (`Request`), what the host keeps
for it while it decodes (`Row`, its `Lengths`), the cycles queued on the
device (`Launched`) and the host's copies of the device's counters
(`Ledger`); where a row finishes (`FinishPoint`). Its prompt cache while it
decodes: held_cache.py; its counters: stats.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, FrozenSet, List, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np

from .cycle import RING, DecodeState, Forwarded
from .params import env_flag
from .sampling import RowSampling

if TYPE_CHECKING:
    from .constraint import Matcher
    from .cycle import Graphs
    from .held_cache import HeldCache
    from .stats import MTPStats


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


@dataclass(frozen=True)
class Media:
    """A prompt's images as the text model takes them (docs/design.md,
    "Images"; built by vision.py): the features of its image pads after the
    `start` tokens a prompt cache holds, in place of the pads' embeddings;
    each token's three M-RoPE position ids; the shift of every position
    after the prompt."""

    features: mx.array  # [pads, H]: the images' after `start`, in order
    pads: np.ndarray  # their pads' indices in the whole prompt
    positions: np.ndarray  # [3, T] int: the whole prompt's tokens, from position 0
    delta: int  # a later token's position: its index + delta (all three axes)
    start: int = 0  # the tokens a prompt cache holds before the row's prompt

    def __post_init__(self):
        if len(self.pads) != self.features.shape[0]:
            raise ValueError(f"{len(self.pads)} image pads for {self.features.shape[0]} "
                             "image feature rows")

    def embeddings(self, model, prompt: List[int], lo: int, hi: int) -> mx.array:
        """The input embeddings [1, hi - lo, H] of the row's prompt's tokens
        lo..hi (the prompt: the tokens from `start` on): the tokens', the
        features at the pads (one piece at a time: a long prompt's whole
        embeddings are never held at once)."""
        emb = model.embed(mx.array([prompt[lo:hi]], dtype=mx.int32))
        at = np.nonzero((self.pads >= self.start + lo) & (self.pads < self.start + hi))[0]
        if len(at):
            emb[0, mx.array(self.pads[at] - self.start - lo)] = \
                self.features[mx.array(at)].astype(emb.dtype)
        return emb


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
    media: Optional[Media] = None  # its prompt's images (prefilled alone, from position 0)


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



@dataclass(frozen=True)
class Launched:
    """A cycle queued on the device, until the host reads it (the batch's
    `current` or `next`)."""

    k: int
    out: object  # StepOutput
    before: Optional[DecodeState]  # the state it started from, without KV buffers
    traced: bool  # its launch traced a graph (slow: not a cost sample)
    rows: tuple  # the batch's rows, in order, when it was launched
    stamps: dict  # perf_counter times of its launch
    flush_after: bool = False  # the head caught up right after it (rows joined)
    cold: bool = False  # a parked plain step of depth 0's graph (the ring dropped)
    counts: Optional[dict] = None  # the device's counters after it (Ledger.checking)
    pending: Optional[Pending] = None  # its masked sample not queued yet
    jump: bool = False  # it verified the grammars' forced run alone (schedule.py)
    head: Optional[int] = None  # the head's chain, when shorter than k (a context run's width)

    @property
    def widened(self) -> bool:
        return self.head is not None and self.head < self.k


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

    def launched(self, k: int, cold: bool, use_head: bool, state: DecodeState
                 ) -> Optional[dict]:
        """A cycle of depth k was queued, leaving the device in `state`; the
        device's counters to check at its read (Launched.counts), if checking."""
        self.ring = 0 if k or cold else self.ring + int(use_head)
        return _device_counts(state) if self.checking else None

    def flushed(self, rows: List[Row], in_flight: bool):
        """The head caught up on the ring (before rows join). With cycles in
        flight the rows' lengths count it once the newest is read (the batch
        marks it `flush_after`)."""
        self.ring = 0
        if not in_flight:
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

    def bound(self, row: Row, in_flight: Sequence["Launched"]) -> Lengths:
        """The row's lengths after the launched cycles if each accepted every draft."""
        lens = row.lens
        for c in in_flight:
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


