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
from dataclasses import dataclass, field
from typing import Any, Callable, FrozenSet, List, NamedTuple, Optional

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache

from .cache import MTPCache, fill_empty, head_caches
from .cycle import DecodeState, Spec, ring_order
from .prefill import catch_up, feed
from .sampling import RowSampling


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
class Request:
    """One sequence for `Batch.add` (made by `Batch.prepare`, which checks it)."""

    prompt: List[int]  # the tokens after what the prompt cache holds
    prompt_cache: list
    keep_cache: bool  # the caller holds the cache: write it back when the row finishes
    max_tokens: int  # -1: no limit
    key: Optional[mx.array]  # [1, 2]: a sampled row's key
    stats: Any  # batch.MTPStats: its counters
    sampling: Optional[RowSampling] = field(default_factory=RowSampling)  # None: opaque
    processors: tuple = ()  # mlx_lm logits processors (this row only)
    progress: Optional[Callable[[int, int], None]] = None  # prompt tokens done, total
    stops: tuple = ()  # prompt token counts after which `snapshot(n)` is called
    snapshot: Optional[Callable[[int], None]] = None
    cached_tokens: tuple = ()  # tokens before `prompt` (cached) that the processors see first
    stop_tokens: FrozenSet[int] = frozenset()  # a row ends with the first of these
    feed_tail: bool = True  # see `Batch.finish`


class Finish(NamedTuple):
    """A row's finishing point: where its prompt cache is written from."""

    before: Optional[DecodeState]  # the state before its last read cycle (no KV buffers)
    index: int  # the row's index in `before`
    lens: Any  # batch.Lengths: its lengths then
    y: int  # its y then
    tokens: List[int]  # that cycle's tokens, of which the caller used `Row.used`


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """What the host keeps for one sequence of a batch."""

    held: "HeldCache"  # its prompt cache
    max_tokens: int  # -1: no limit
    stop_tokens: FrozenSet[int]
    feed_tail: bool
    stats: Any  # batch.MTPStats
    lens: Any  # batch.Lengths after the cycles read so far (exact; batch.Ledger writes it)
    sampling: Optional[RowSampling]
    processors: tuple = ()
    landed: int = 0  # tokens read so far
    emitted: int = 0  # tokens handed to the caller (events)
    last: Optional[Finish] = None  # its finishing point
    used: int = 0  # of its last read cycle's tokens, those handed out
    history: Optional[mx.array] = None  # the row's tokens (logits processors)
    bias: Optional[mx.array] = None  # [V]: its logit bias, built once
    done: bool = False



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
    their own state into it. A second is refused while the first is open."""

    # the open generation on each cache, keyed weakly by the cache's first
    # object (a cache its caller dropped drops its entry)
    _open: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, prompt_cache: list, keep: bool):
        self.prompt_cache, self.keep = prompt_cache, keep

    @classmethod
    def hold(cls, prompt_cache: list, owner, gen):
        cls._open[prompt_cache[0]] = (owner, weakref.ref(gen))

    @classmethod
    def release(cls, prompt_cache: list, owner):
        if cls._open.get(prompt_cache[0], (None,))[0] is owner:
            del cls._open[prompt_cache[0]]

    @classmethod
    def refuse_if_open(cls, prompt_cache: list):
        entry = cls._open.get(prompt_cache[0]) if prompt_cache else None
        if entry is not None and entry[1]() is not None:
            raise ValueError("this prompt_cache is in use by a generation that is still open: "
                             "finish iterating it or call its close() first (two generations "
                             "on one cache would each write their own state into it)")

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
