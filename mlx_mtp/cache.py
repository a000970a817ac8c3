"""Caches: mlx_lm's cache protocol, in the two forms a generation uses.

Between calls a user holds a **prompt cache**, a list of mlx_lm's own cache
objects, so `save_prompt_cache`, `load_prompt_cache`, `trim_prompt_cache` and
`can_trim_prompt_cache` work on it unchanged. mlx_lm's `make_prompt_cache`
(`model.make_cache()`) gives the trunk's entries; mlx_mtp's first call on it
appends the head's:

    [trunk layer caches: KVCache (attention) | ArraysCache (GDN conv, state)]
    + [one KVCache per head layer]                  (head_layers of them)
    + [ArraysCache(2): the trunk's hidden at the last position, and the
       trunk's length when it was taken]

The head's KV holds pairs (h_p, tok_{p+1}); the last hidden pairs with the
next call's first token, if the trunk has not moved on without the head since
(a turn decoded plainly or by mlx_lm).

While decoding, the same contents live in an `MTPCache`: attention KV in
buffers whose lengths are device arrays, one per batch row
(`PaddedKVCache`), and GDN caches that can capture a verify forward
(`CaptureCache`). A cycle then rolls back by lengths and indices computed in
the graph, with no host sync. Conversions: `MTPCache.from_prompt_cache` and
`MTPCache.write_back`. See docs/design.md, "Caches".

A family may use other mlx_lm kinds (qwen4_exp: a `CacheList` of KVCaches
for QSA attention and its indexer's raw and pooled keys, `ArraysCache(4)` for a GDN
layer with PLE; docs/qwen4_exp.md): a CacheList of KVCaches decodes as a
`PaddedCacheList` (trimmed together), an ArraysCache of any size as a
`CaptureCache` (entries past the GDN's two kept by the family's commit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from .metal import GdnTape
from .mlx_lm_compat import BaseCache as _BaseCache

BLOCK = 256  # smallest capacity step of a PaddedKVCache


def capacity_for(n: int, block: Optional[int] = None) -> int:
    """Buffer capacity for n entries: whole blocks, with blocks doubling as the
    length grows (never more than max(block, n/8) spare), so compiled graphs
    see few distinct shapes and attention runs over little padding."""
    block = block or BLOCK
    while block * 16 <= n:
        block *= 2
    return max(block, -(-n // block) * block)


class PaddedKVCache(_BaseCache):
    """Attention KV in a reserved buffer with a length per batch row on the device.

    `keys`/`values` are [B, H, capacity, D]; `lengths` [B] int32. A forward
    writes at `lengths` and masks out everything past it, so a cycle can roll
    back by the accepted count (`trim` with a device scalar) without the host
    knowing it. Masked keys add exact zeros to the softmax. Duck-types
    mlx_lm's KVCache for its attention layers (`offset` for RoPE,
    `update_and_fetch`, `make_mask`).
    """

    def __init__(self, keys: mx.array, values: mx.array, lengths: mx.array):
        self.keys, self.values, self.lengths = keys, values, lengths

    @property
    def offset(self) -> mx.array:
        return self.lengths

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def state(self):
        return self.keys, self.values, self.lengths

    @state.setter
    def state(self, v):
        self.keys, self.values, self.lengths = v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, _, T, _ = keys.shape
        if B == 1:
            start = self.lengths.reshape(1)
            self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
            self.values = mx.slice_update(self.values, values, start, axes=(2,))
        else:  # every row writes at its own length
            idx = (self.lengths[:, None] + mx.arange(T, dtype=mx.int32))[:, None, :, None]
            self.keys = mx.put_along_axis(
                self.keys, mx.broadcast_to(idx, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(
                self.values, mx.broadcast_to(idx, values.shape), values, axis=2)
        self.lengths = self.lengths + T
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # query i of row b (position lengths[b] + i) sees keys 0 .. lengths[b] + i
        visible = self.lengths[:, None, None, None] + mx.arange(N, dtype=mx.int32)[:, None]
        return mx.arange(self.capacity, dtype=mx.int32) <= visible  # [B, 1, N, capacity]

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n entries of every row (n: int, or device array [B] or scalar)."""
        self.lengths = self.lengths - n
        return n

    def grown(self, needed: int) -> "PaddedKVCache":
        """This cache with room for `needed` entries and a capacity of whole
        blocks (`capacity_for`): a buffer from mlx_lm's KVCache, whose length
        is arbitrary, is re-cut once, so compiled graphs see few shapes."""
        capacity = self.capacity
        if needed <= capacity and capacity_for(capacity) == capacity:
            return self
        return self.recut(capacity_for(max(needed, 1)))

    def recut(self, capacity: int) -> "PaddedKVCache":
        """The buffer cut or padded to `capacity` entries (all valid ones fit)."""
        if capacity == self.capacity:
            return self
        B, H, _, _ = self.keys.shape
        keep = min(self.capacity, capacity)

        def cut(x):
            return mx.concatenate(
                [x[..., :keep, :], mx.zeros((B, H, capacity - keep, x.shape[-1]), x.dtype)],
                axis=2)

        return PaddedKVCache(cut(self.keys), cut(self.values), self.lengths)

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        return self.keys.nbytes + self.values.nbytes

    @classmethod
    def from_kv_cache(cls, cache: KVCache, batch: int = 1) -> "PaddedKVCache":
        if cache.keys is None:
            raise ValueError("an empty KVCache has no shape to pad (prefill first)")
        lengths = mx.full((batch,), cache.offset, dtype=mx.int32)
        return cls(cache.keys, cache.values, lengths)

    def write_to(self, cache: KVCache, length: int):
        """Hand the buffer to mlx_lm's KVCache, `length` entries valid."""
        cache.keys, cache.values, cache.offset = self.keys, self.values, int(length)


class PaddedCacheList(_BaseCache):
    """Decoding form of mlx_lm's `CacheList` of KVCaches (qwen4_exp's QSA
    layer: attention K/V, the indexer's raw and pooled keys): one PaddedKVCache each,
    written and trimmed together, so they share one length per row."""

    def __init__(self, caches):
        self.caches = list(caches)

    def __getitem__(self, i):
        return self.caches[i]

    @property
    def lengths(self) -> mx.array:
        return self.caches[0].lengths

    @property
    def offset(self) -> mx.array:
        return self.lengths

    @property
    def state(self):
        return [c.state for c in self.caches]

    @state.setter
    def state(self, v):
        self.caches = [PaddedKVCache(*s) for s in v]

    def is_trimmable(self):
        return True

    def trim(self, n):
        for c in self.caches:
            c.trim(n)
        return n

    def grown(self, needed: int) -> "PaddedCacheList":
        return PaddedCacheList([c.grown(needed) for c in self.caches])

    def empty(self):
        return self.caches[0].empty()

    @property
    def nbytes(self):
        return sum(c.nbytes for c in self.caches)

    @classmethod
    def from_cache_list(cls, cache: CacheList, batch: int = 1) -> "PaddedCacheList":
        return cls([PaddedKVCache.from_kv_cache(c, batch) for c in cache.caches])

    def write_to(self, cache: CacheList, length: int):
        for c, dst in zip(self.caches, cache.caches):
            c.write_to(dst, length)


@dataclass
class Capture:
    """What one GDN layer's verify forward keeps for the commit: the conv
    input [B, K-1+T, C]; for the recurrent state either the state after every
    position [B, T, Hv, Dv, Dk] (`states`) or a tape to replay the accepted
    prefix from (`tape`, metal.GdnTape), as `rollback_by_tape` decides; and a
    family's own (qwen4_exp's PLE conv input and n-gram ids)."""

    conv_input: mx.array
    states: Optional[mx.array] = None
    tape: Optional[GdnTape] = None
    ple: Optional[Tuple[mx.array, mx.array]] = None

    @property
    def nbytes(self) -> int:
        """Bytes the verify keeps for the rollback (the state before the
        cycle, which a tape refers to, is the cache's own)."""
        return (self.conv_input.nbytes + (self.states.nbytes if self.states is not None else 0)
                + (self.tape.nbytes if self.tape is not None else 0)
                + sum(x.nbytes for x in self.ple or ()))

    def tree(self) -> dict:
        return {"states": self.states, "conv_input": self.conv_input,
                "tape": None if self.tape is None else self.tape.tree(),
                "ple": None if self.ple is None else list(self.ple)}

    @classmethod
    def from_tree(cls, tree: dict) -> "Capture":
        return cls(tree["conv_input"], tree["states"],
                   None if tree["tape"] is None else GdnTape.from_tree(tree["tape"]),
                   None if tree["ple"] is None else tuple(tree["ple"]))


class CaptureCache(ArraysCache):
    """A GDN layer's ArraysCache ([conv window, recurrent state], and any
    entries a family adds after them) whose verify forward captures what the
    commit needs: the model's GDN layer fills `captured_*` while `capturing`
    (the one way out of mlx_lm's forward), and the cycle takes them at once
    as a `Capture` (`take`). `state` is mlx_lm's."""

    def __init__(self, conv=None, state=None, *extra):
        super().__init__(size=2 + len(extra))
        self.cache = [conv, state, *extra]
        self.capturing = False
        self.captured_states: Optional[mx.array] = None  # [B, T, Hv, Dv, Dk]
        self.captured_tape: Optional[GdnTape] = None  # (instead of the states)
        self.captured_conv_input: Optional[mx.array] = None  # [B, K-1+T, C]
        self.captured_ple: Optional[tuple] = None  # ([B, S+T, W], [B, n-1+T] ids)

    @property
    def state(self):  # a new list: a state is a value, shared by no other cache
        return list(self.cache), self.left_padding, self.lengths

    @state.setter
    def state(self, v):
        cache, self.left_padding, self.lengths = v
        self.cache = list(cache)
        self._clear()

    def _clear(self):
        self.capturing = False
        self.captured_states = self.captured_conv_input = self.captured_ple = None
        self.captured_tape = None

    def take(self) -> Capture:
        """What the verify forward captured (the layer forgets it)."""
        capture = Capture(self.captured_conv_input, self.captured_states, self.captured_tape,
                          self.captured_ple)
        self._clear()
        return capture

    def commit(self, window: mx.array, state: mx.array, consumed: mx.array, capture: Capture):
        """Keep the state after `consumed` [B] verify tokens: the GDN's conv
        window and state (picked by the cycle), and a PLE layer's conv window
        and n-gram context, cut from what its verify captured at the same
        place (the last S / n-1 entries of the first S+consumed / n-1+consumed)."""
        self.cache[0], self.cache[1] = window, state
        if capture.ple is not None:
            n = consumed.astype(mx.int32)[:, None]
            for slot, full in zip((2, 3), capture.ple):
                width = self.cache[slot].shape[1]
                at = n + mx.arange(width, dtype=mx.int32)
                if full.ndim == 3:
                    at = at[..., None]
                self.cache[slot] = mx.take_along_axis(full, at, axis=1)

    @staticmethod
    def start(trunk: list):
        """The next trunk forward is a verify: its GDN layers capture what the
        commit needs."""
        for c in trunk:
            if isinstance(c, CaptureCache):
                c.capturing = True

    @staticmethod
    def take_all(trunk: list) -> List[Capture]:
        """Every GDN layer's capture, in layer order."""
        return [c.take() for c in trunk if isinstance(c, CaptureCache)]

    @classmethod
    def from_arrays_cache(cls, cache: ArraysCache) -> "CaptureCache":
        return cls(*cache.cache)

    def write_to(self, cache: ArraysCache, length: Optional[int] = None):
        """(`length` is the attention caches' argument: a GDN state has none.)"""
        cache.cache = list(self.cache)


def _kind(c):
    """A decoding-form cache's kind, for `MTPCache.layout`."""
    if isinstance(c, PaddedKVCache):
        return "kv"
    if isinstance(c, PaddedCacheList):
        return ("list", len(c.caches))
    return "arrays"


def _rebuild(c, kv):
    """c's structure with each PaddedKVCache replaced by kv(that cache)."""
    if isinstance(c, PaddedKVCache):
        return kv(c)
    if isinstance(c, PaddedCacheList):
        return PaddedCacheList([kv(x) for x in c.caches])
    return c


def _decoding(c, batch: int):
    """The decoding form of one of mlx_lm's cache objects (buffers shared)."""
    if isinstance(c, KVCache):
        return PaddedKVCache.from_kv_cache(c, batch)
    if isinstance(c, CacheList):
        return PaddedCacheList.from_cache_list(c, batch)
    return CaptureCache.from_arrays_cache(c)



def entry_length(c) -> int:
    """Tokens in one attention entry of a prompt cache (a KVCache, or a
    CacheList whose first is the attention's)."""
    return c[0].offset if isinstance(c, CacheList) else c.offset


class MTPCache:
    """Trunk + head caches of one generation, in decoding form.

    `trunk[i]` is a PaddedKVCache (attention layer) or a CaptureCache (GDN
    layer); `head[j]` a PaddedKVCache per head layer (empty list without a
    head). `state` is the flat list of every layer's state: a compiled cycle
    takes and returns exactly that.
    """

    def __init__(self, trunk: list, head: list):
        self.trunk, self.head = trunk, head

    @property
    def layers(self) -> list:
        return self.trunk + self.head

    @property
    def state(self):
        return [c.state for c in self.layers]

    @state.setter
    def state(self, v):
        for c, s in zip(self.layers, v):
            c.state = s

    @property
    def layout(self) -> tuple:
        """What `from_state` needs to rebuild the objects: each trunk and
        head layer's kind."""
        return tuple(_kind(c) for c in self.trunk), tuple(_kind(c) for c in self.head)

    @classmethod
    def from_state(cls, state: list, layout: tuple) -> "MTPCache":
        """Cache objects of `layout` over the arrays of `state`."""
        trunk_kinds, head_kinds = layout
        objs = []
        for kind, s in zip(trunk_kinds + head_kinds, state):
            if kind == "kv":
                c = PaddedKVCache(None, None, None)
            elif kind == "arrays":
                c = CaptureCache()
            else:
                c = PaddedCacheList([])
            c.state = s
            objs.append(c)
        return cls(objs[: len(trunk_kinds)], objs[len(trunk_kinds):])

    def copy(self) -> "MTPCache":
        """New cache objects over the same arrays (the arrays are values)."""
        return MTPCache.from_state(self.state, self.layout)

    def grown(self, trunk_capacity: int, head_capacity: int) -> "MTPCache":
        """Room for `trunk_capacity` / `head_capacity` entries (whole blocks)."""
        grow = lambda c, n: c if isinstance(c, CaptureCache) else c.grown(n)
        return MTPCache([grow(c, trunk_capacity) for c in self.trunk],
                        [grow(c, head_capacity) for c in self.head])

    def room(self) -> tuple:
        """The smallest KV capacity of the trunk's and of the head's layers:
        what every dynamic write (at a row's length) must stay within."""
        def capacity(c):
            return min(x.capacity for x in c.caches) if isinstance(c, PaddedCacheList) \
                else c.capacity
        trunk = [capacity(c) for c in self.trunk if not isinstance(c, CaptureCache)]
        return (min(trunk, default=1 << 62), min(map(capacity, self.head), default=1 << 62))

    def trimmed_head(self, n: int) -> "MTPCache":
        """The head's caches without their last n entries."""
        cut = lambda c: PaddedKVCache(c.keys, c.values, c.lengths - n)
        return MTPCache(self.trunk, [_rebuild(c, cut) for c in self.head])

    def with_buffers_of(self, newer: "MTPCache") -> "MTPCache":
        """This cache's lengths and GDN states over `newer`'s KV buffers.

        Everything written after this cache was taken lies past its lengths
        (cycles only write at or after the current length), so this is the
        state it had, without keeping its own copy of the buffers alive."""
        def one(old, new):
            if isinstance(old, PaddedKVCache):
                return PaddedKVCache(new.keys, new.values, old.lengths)
            if isinstance(old, PaddedCacheList):
                return PaddedCacheList([one(o, n) for o, n in zip(old.caches, new.caches)])
            return old
        return MTPCache([one(o, n) for o, n in zip(self.trunk, newer.trunk)],
                        [one(o, n) for o, n in zip(self.head, newer.head)])

    def without_buffers(self) -> "MTPCache":
        """Lengths and GDN states only (see `with_buffers_of`)."""
        drop = lambda c: PaddedKVCache(None, None, c.lengths)
        return MTPCache([_rebuild(c, drop) for c in self.trunk],
                        [_rebuild(c, drop) for c in self.head])

    def take_rows(self, rows: mx.array) -> "MTPCache":
        """These batch rows only (rows: int32 indices)."""
        def kv(c):
            if c.keys is None:  # a state kept without its buffers
                return PaddedKVCache(None, None, c.lengths[rows])
            return PaddedKVCache(c.keys[rows], c.values[rows], c.lengths[rows])

        def one(c):
            if isinstance(c, CaptureCache):
                return CaptureCache(*[x[rows] for x in c.cache])
            return _rebuild(c, kv)
        return MTPCache([one(c) for c in self.trunk], [one(c) for c in self.head])

    @staticmethod
    def concat(a: "MTPCache", b: "MTPCache") -> "MTPCache":
        """a's rows, then b's (KV buffers cut to one capacity)."""
        def kv(x, y):
            capacity = capacity_for(max(x.capacity, y.capacity))
            x, y = x.recut(capacity), y.recut(capacity)
            return PaddedKVCache(mx.concatenate([x.keys, y.keys]),
                                 mx.concatenate([x.values, y.values]),
                                 mx.concatenate([x.lengths, y.lengths]))

        def one(x, y):
            if isinstance(x, PaddedKVCache):
                return kv(x, y)
            if isinstance(x, PaddedCacheList):
                return PaddedCacheList([kv(p, q) for p, q in zip(x.caches, y.caches)])
            return CaptureCache(*[mx.concatenate([p, q]) for p, q in zip(x.cache, y.cache)])
        return MTPCache([one(x, y) for x, y in zip(a.trunk, b.trunk)],
                        [one(x, y) for x, y in zip(a.head, b.head)])

    @classmethod
    def from_prompt_cache(cls, prompt_cache: list, n_trunk: int, use_head: bool,
                          batch: int = 1) -> "MTPCache":
        """Decoding form of a filled prompt cache (buffers shared, not copied)."""
        trunk = [_decoding(c, batch) for c in prompt_cache[:n_trunk]]
        head = ([_decoding(c, batch) for c in head_caches(prompt_cache, n_trunk)]
                if use_head else [])
        return cls(trunk, head)

    def write_back(self, prompt_cache: list, n_trunk: int, trunk_len: int,
                   head_len: Optional[int]):
        """Store this state in the prompt cache's mlx_lm objects (in place);
        the host knows the exact lengths by then."""
        for c, dst in zip(self.trunk, prompt_cache[:n_trunk]):
            c.write_to(dst, trunk_len)
        if self.head:
            for c, dst in zip(self.head, head_caches(prompt_cache, n_trunk)):
                c.write_to(dst, head_len)


# -- the prompt-cache list (mlx_lm objects) ----------------------------------------
def head_entries(head_layers: int, head: Optional[list] = None) -> list:
    """What mlx_mtp appends to a trunk's prompt cache (see the module
    docstring); `head`: the head's own fresh caches when not KVCaches."""
    return (head if head is not None else [KVCache() for _ in range(head_layers)]) + [
        ArraysCache(size=2)]


def _same_kind(c, want) -> bool:
    if type(c) is not type(want):
        return False
    if isinstance(want, ArraysCache):
        return len(c.cache) == len(want.cache)
    if isinstance(want, CacheList):
        return [type(x) for x in c.caches] == [type(x) for x in want.caches]
    return True


def _kind_name(c) -> str:
    if isinstance(c, CacheList):  # e.g. a qwen4_exp cache saved before its pooled keys
        return f"CacheList({', '.join(type(x).__name__ for x in c.caches)})"
    return type(c).__name__


def head_caches(prompt_cache: list, n_trunk: int) -> list:
    """The head's KVCaches of a prompt cache (empty for a trunk-only one)."""
    return prompt_cache[n_trunk:-1]


def last_hidden(prompt_cache: list, is_linear: List[bool]) -> Optional[mx.array]:
    """The trunk's hidden at the cached context's last position, if it was
    kept at the trunk's present length."""
    n_trunk = len(is_linear)
    if len(prompt_cache) <= n_trunk:
        return None
    hidden, length = prompt_cache[-1][0], prompt_cache[-1][1]
    if hidden is None or length is None or length.item() != cache_length(prompt_cache, is_linear):
        return None
    return hidden


def set_last_hidden(prompt_cache: list, hidden: Optional[mx.array], is_linear: List[bool]):
    length = cache_length(prompt_cache, is_linear)
    prompt_cache[-1][0] = hidden
    prompt_cache[-1][1] = None if hidden is None else mx.array(length, dtype=mx.int32)


def check_prompt_cache(prompt_cache: list, is_linear: List[bool], head_layers: int,
                       trunk: Optional[list] = None, head: Optional[list] = None) -> list:
    """Validate a user's prompt cache against the model; a trunk-only list
    gets the head's entries appended (in place). Returns the list. `trunk` /
    `head`: fresh caches of the model (`model.make_cache()`,
    `model.mtp.make_cache()`) whose kinds each entry must have; by default
    KVCache (attention) and ArraysCache (GDN), KVCache per head layer."""
    n = len(is_linear)
    if not isinstance(prompt_cache, list):
        raise ValueError("prompt_cache must be the list from make_prompt_cache(model)")
    if len(prompt_cache) not in (n, n + head_layers + 1) or (
            len(prompt_cache) > n and not head_layers):
        raise ValueError(
            f"prompt_cache has {len(prompt_cache)} entries; this model needs {n} "
            f"(trunk only) or {n + head_layers + 1 if head_layers else n} "
            "(from make_prompt_cache(model))")
    if trunk is None:
        trunk = [ArraysCache(size=2) if linear else KVCache() for linear in is_linear]
    for i, (c, want) in enumerate(zip(prompt_cache, trunk)):
        if not _same_kind(c, want):
            raise ValueError(
                f"prompt_cache[{i}] is a {_kind_name(c)}; mlx_mtp needs mlx_lm's "
                f"{_kind_name(want)} there (no max_kv_size / kv_bits caches)")
    if head_layers:
        if len(prompt_cache) == n:
            prompt_cache.extend(head_entries(head_layers, head))
        extra = prompt_cache[n:]
        want = head if head is not None else [KVCache() for _ in range(head_layers)]
        if not all(_same_kind(c, w) for c, w in zip(extra[:-1], want)) \
                or type(extra[-1]) is not ArraysCache or len(extra[-1].cache) != 2:
            names = " ... ".join(dict.fromkeys(type(w).__name__ for w in want))
            raise ValueError(f"prompt_cache's head entries are not {names} ... ArraysCache(2); "
                             "build it with make_prompt_cache(model)")
    return prompt_cache


def check_model_cache(prompt_cache: list, model) -> list:
    """`check_prompt_cache` against a loaded model's own kinds of cache."""
    head_layers = len(model.mtp.layers) if model.has_mtp else 0
    return check_prompt_cache(prompt_cache, model.is_linear, head_layers, model.make_cache(),
                              model.mtp.make_cache() if head_layers else None)


def fill_empty(prompt_cache: list, model, n_layers: int):
    """Give the first n_layers entries of a prompt cache that never saw a token
    empty arrays of the shapes and dtypes mlx_lm's layers give them (KV with
    no entries, zero GDN states: what mlx_lm starts from), so the decoding
    form can take them. The shapes come from one token fed through a fresh
    cache, once per model."""
    if all(not c.empty() for c in prompt_cache[:n_layers]):
        return
    template = getattr(model.runtime, "cache_template", None)
    if template is None:
        probe = model.make_cache()
        heads = model.mtp.make_cache() if model.has_mtp else []
        h = model.trunk_hidden(mx.array([[0]], dtype=mx.int32), probe)
        if heads:
            model.mtp(h, model.embed(mx.array([[0]], dtype=mx.int32)), heads)
        template = [_template(c) for c in probe + heads]
        model.runtime.cache_template = template
    for c, t in zip(prompt_cache[:n_layers], template):
        if not c.empty():
            continue
        _fill(c, t, model)


def _template(c):
    if isinstance(c, KVCache):
        return ("kv", c.keys.shape, c.keys.dtype, c.values.shape[-1])
    if isinstance(c, CacheList):
        return ("list", [_template(x) for x in c.caches])
    return ("arrays", [(x.shape, x.dtype) for x in c.cache])


def _fill(c, t, model):
    if t[0] == "kv":
        _, shape, dtype, dv = t
        c.keys = mx.zeros((1, shape[1], 0, shape[3]), dtype)
        c.values = mx.zeros((1, shape[1], 0, dv), dtype)
        c.offset = 0
    elif t[0] == "list":
        for x, tx in zip(c.caches, t[1]):
            _fill(x, tx, model)
    else:  # what the family's layer starts from (zeros; qwen4_exp's n-gram context: EOS)
        c.cache = [model.empty_entry(shape, dtype) for shape, dtype in t[1]]


def cache_length(prompt_cache: list, is_linear: List[bool]) -> int:
    """Tokens in a prompt cache's trunk (0 when fresh), as this rank's
    attention layers count them: 0 on a pipeline stage holding only GDN
    layers (distributed.trunk_length asks the other stages)."""
    for c, linear in zip(prompt_cache, is_linear):
        if not linear:
            return entry_length(c)
    return 0


# -- GDN rollback ------------------------------------------------------------------------
_FORCE_ROLLBACK: Optional[str] = None  # "tape" / "capture": the bench and the tests' oracle


# verifies of more positions than this keep a tape: the head's depths (up
# to 4 drafts) capture, as before; context runs of 8 and 16 replay
TAPE_AFTER = 5


def rollback_by_tape(positions: int) -> bool:
    """Whether a GDN layer's verify of `positions` tokens keeps a tape
    (replayed at the commit) rather than every position's state. A
    position's tape entry (k, v, g, beta) is far smaller than the state
    [Hv, Dv, Dk] fp32 a capture writes for it, so wide verifies (context
    runs) take the tape: a run of 16 keeps 33 MB a row at 27B shapes, not
    2.6 GB. At the head's depths a capture stays: on the CPU's ops path the
    replay's extra steps cost lone requests ~8% (bench/ab.py, `single`,
    2026-12-08; docs/design.md §3, "Rollback")."""
    if _FORCE_ROLLBACK is not None:
        return _FORCE_ROLLBACK == "tape"
    return positions > TAPE_AFTER


def rollback_bytes(text_config: dict, run: int, act_bytes: int = 2, tape: bool = True) -> int:
    """Bytes per row a verify of `run` drafts (T = run + 1 positions) keeps
    for the rollback of a Qwen3.5-shaped trunk's GDN layers (every layer but
    each full_attention_interval-th): each layer's conv input [K-1+T, C] in
    the activations' dtype (`act_bytes` each), and its tape (k [T, Hk, Dk],
    v [T, Hv, Dv] and beta [T, Hv] in the activations' dtype, g [T, Hv]
    fp32), or with tape=False every position's state [T, Hv, Dv, Dk] fp32.
    (Not counted: the state before the cycle, the cache's own.)"""
    c = text_config
    layers = c["num_hidden_layers"] - c["num_hidden_layers"] // c["full_attention_interval"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    T = run + 1
    conv = (c["linear_conv_kernel_dim"] - 1 + T) * (2 * hk * dk + hv * dv) * act_bytes
    if tape:
        kept = T * ((hk * dk + hv * dv + hv) * act_bytes + hv * 4)
    else:
        kept = T * hv * dv * dk * 4
    return layers * (conv + kept)
