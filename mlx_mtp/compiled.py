"""One compiled graph per draft depth for pipelined cycles.

`MTPDecoder._launch_drafted(k)` (and the plain step) is ordinary MLX code over
cache objects. Here it is traced once per depth by `mx.compile` as a pure
function of the decoder's state arrays (last token, first draft, head hidden,
random key, every cache array), so later cycles skip Python graph building.
Shapes only change when a PaddedKVCache grows by a block, and
`start_pipeline` reserves the whole generation up front when max_tokens is
known: one trace per depth per generation (`traces` counts them).
"""

from __future__ import annotations

from typing import Dict, List

import mlx.core as mx

from .caches import PaddedKVCache, RollbackArraysCache


def _slots(dec) -> List[tuple]:
    """(object, attribute-or-index) of every array the cycle reads or writes."""
    slots = [(dec, "y"), (dec, "g")]
    if not dec.speculative:
        slots.append((dec, "d1"))
    else:
        slots.append((dec, "key"))
    if dec.oracle is not None:
        slots.append((dec, "position"))
    for c in list(dec.cache) + list(dec.head_cache or []):
        if isinstance(c, RollbackArraysCache):
            slots += [(c, 0), (c, 1)]
        elif isinstance(c, PaddedKVCache):
            slots += [(c, "keys"), (c, "values"), (c, "offset")]
    return slots


def _get(obj, where):
    return obj[where] if isinstance(where, int) else getattr(obj, where)


def _set(obj, where, value):
    if isinstance(where, int):
        obj[where] = value
    else:
        setattr(obj, where, value)


class CompiledCycles:
    """launch(k) through a graph compiled for depth k (and for plain steps)."""

    def __init__(self, dec):
        self.dec = dec
        self.fns: Dict[int, object] = {}
        self.traces: Dict[int, int] = {}

    def _fn(self, k: int):
        if k not in self.fns:
            dec = self.dec

            def cycle(*state):
                self.traces[k] = self.traces.get(k, 0) + 1
                slots = _slots(dec)
                for (obj, where), value in zip(slots, state):
                    _set(obj, where, value)
                n_pending = len(dec._pending)
                p = dec._launch_plain() if k == 0 else dec._launch_drafted(k)
                # a plain step's (hidden, token) for the head: returned, not kept
                extra = [x for pair in dec._pending[n_pending:] for x in pair]
                del dec._pending[n_pending:]
                outs = [_get(obj, where) for obj, where in slots]
                return outs + [p.packed, p.logprobs, p.out] + extra

            self.fns[k] = mx.compile(cycle)
        return self.fns[k]

    def launch(self, k: int):
        from .decode import PendingCycle

        dec = self.dec
        dec._reserve(k + 1 + len(dec._pending))
        if k > 0:
            dec._catch_up_head()  # eager: its length varies (plain steps since)
        caches = list(dec._padded_caches())
        bounds = [c.bound for c in caches]
        slots = _slots(dec)
        traces = sum(self.traces.values())
        outs = self._fn(k)(*[_get(obj, where) for obj, where in slots])
        traced = sum(self.traces.values()) > traces
        for (obj, where), value in zip(slots, outs):
            _set(obj, where, value)
        for c, b in zip(caches, bounds):  # host bookkeeping the replay skips
            c.bound = b + k + 1
        packed, logprobs, out, *extra = outs[len(slots):]
        if extra:
            dec._pending.append(tuple(extra))
        keep = [packed, logprobs] + list(outs[: len(slots)])
        return PendingCycle(k, packed, logprobs, out, keep, traced=traced)
