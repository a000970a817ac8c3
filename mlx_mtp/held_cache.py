"""A row's prompt cache while the row decodes on it (docs/design.md,
"Finishing"): its arrays move into the batch's decoding state
(`HeldCache.take`), and when the row finishes the state at its finishing
point is written back and the tokens it emitted up to there are fed
(`HeldCache.give_back`), so the cache holds exactly what mlx_lm's would: the
prompt and every token the caller used, nothing drafted or rejected."""

from __future__ import annotations

import weakref
from typing import List

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache

from .cache import MTPCache, fill_empty, head_caches
from .cycle import DecodeState, Spec, ring_order
from .prefill import catch_up, feed


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
