"""Caches that let a verify forward roll back without re-running the trunk.

Attention layers use mlx_lm's KVCache and roll back by `trim`. A Gated-DeltaNet
layer overwrites its recurrent state, so during a verify forward it captures
the state after every position and its conv input (DESIGN.md §3, "capture");
`commit_gdn` then installs the state after the accepted prefix. Outside a
verify (prefill, plain decoding, mlx_lm.generate) the layer is mlx_lm's own.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet

from . import metal as kernels


class RollbackArraysCache(ArraysCache):
    """ArraysCache ([conv window, state]) that can hold one verify's capture."""

    def __init__(self):
        super().__init__(size=2)
        self.capturing = False
        self.captured_states: Optional[mx.array] = None  # [B, T, Hv, Dv, Dk]
        self.captured_conv_input: Optional[mx.array] = None  # [B, K-1+T, C]

    def clear_capture(self):
        self.captured_states = None
        self.captured_conv_input = None


class VerifyingGatedDeltaNet(GatedDeltaNet):
    """mlx_lm's GatedDeltaNet that, in a capturing cache, keeps every state.

    Same parameters and same arithmetic as the parent: the projections are the
    parent's modules and the recurrence is mlx_lm's single-token update (via the
    kernels' reference), so an accepted position is bit-identical to plain
    decoding.
    """

    def __call__(self, inputs, mask=None, cache=None):
        if not (isinstance(cache, RollbackArraysCache) and cache.capturing):
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), inputs.dtype)
        state = cache[1]
        if state is None:
            state = mx.zeros(
                (B, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32
            )
        conv_out, conv_input = kernels.conv_verify(conv_state, qkv, self.conv1d.weight)
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        y, states = kernels.gdn_verify(q, k, v, a, b, self.A_log, self.dt_bias, state)
        cache.captured_states = states
        cache.captured_conv_input = conv_input
        out = self.norm(y, z)
        return self.out_proj(out.reshape(B, S, -1))


def make_trunk_cache(model) -> list:
    return [RollbackArraysCache() if l.is_linear else KVCache() for l in model.layers]


def set_capturing(cache: list, on: bool):
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.capturing = on
            if not on:
                c.clear_capture()


def commit(cache: list, consumed: mx.array, verified: int, conv_kernel: int):
    """Keep the first `consumed` of the `verified` tokens of the last verify.

    `consumed` is a device scalar (GDN layers select by index, no sync);
    `verified - consumed` is needed on the host to trim attention KV.
    """
    gdn = [c for c in cache if isinstance(c, RollbackArraysCache)]
    picked = kernels.commit(
        [c.captured_states for c in gdn],
        [c.captured_conv_input for c in gdn],
        consumed,
        conv_kernel,
    )
    for c, (window, state) in zip(gdn, picked):
        c[0], c[1] = window, state
        c.clear_capture()
    return picked


def trim_attention(cache: List, n):
    """Drop the last n attention entries: n is an int (exact-length KVCache),
    or a device scalar for PaddedKVCaches (no host sync)."""
    if isinstance(n, mx.array):
        for c in cache:
            if isinstance(c, PaddedKVCache):
                c.trim(n)
    elif n > 0:
        for c in cache:
            if isinstance(c, (KVCache, PaddedKVCache)):
                c.trim(n)


class PaddedKVCache:
    """Attention KV cache whose length lives on the device (pipelined decoding).

    Keys and values sit in buffers of reserved capacity (grown in blocks) and
    `offset` is a device scalar, so a cycle can roll back by the accepted count
    without the host knowing it: the next cycle writes at `offset` and masks
    out everything past it. Masked keys add exact zeros to the softmax, so on
    MLX's CPU backend attention over the buffer equals attention over the
    exact-length keys bit for bit with the bundled BLAS (tests check it);
    other BLAS libraries may round the padded matmuls differently (~1e-7).
    Duck-types mlx_lm's KVCache for its attention layers (rope offset,
    update_and_fetch, make_mask).
    """

    block = 256

    def __init__(self, keys: mx.array, values: mx.array, length: int):
        self.keys, self.values = keys, values  # [B, H, capacity, D]
        self.offset = mx.array(length, dtype=mx.int32)
        self.bound = length  # host-side upper bound on `offset`

    @classmethod
    def from_kv_cache(cls, cache: KVCache, reserve: int = 0) -> "PaddedKVCache":
        n = cache.offset
        out = cls(cache.keys[..., :n, :], cache.values[..., :n, :], n)
        out.reserve(n + reserve)
        return out

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, length: int):
        """Make room for `length` entries (whole blocks; the shape only ever
        changes here, so compiled graphs see a new shape once per block)."""
        if length <= self.capacity:
            return
        cap = -(-length // self.block) * self.block
        B, H, n, _ = self.keys.shape
        pad = lambda x: mx.concatenate(
            [x, mx.zeros((B, H, cap - n, x.shape[-1]), x.dtype)], axis=2)
        self.keys, self.values = pad(self.keys), pad(self.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        L = keys.shape[2]
        if self.bound + L > self.capacity:
            raise RuntimeError("PaddedKVCache: reserve() capacity before the forward")
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        self.offset = self.offset + L
        self.bound += L
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # query i (at position offset + i) sees keys 0..offset + i
        visible = mx.arange(N, dtype=mx.int32)[:, None] + self.offset
        return mx.arange(self.capacity, dtype=mx.int32)[None] <= visible

    def trim(self, n):
        """Drop the last n entries; n may be a device scalar."""
        self.offset = self.offset - n
        if isinstance(n, int):
            self.bound -= n

    def set_bound(self, length: int):
        """The host learned the exact length (a late read)."""
        self.bound = length

    @property
    def state(self):
        return self.keys, self.values, self.offset

    def __bool__(self):  # mlx_lm tests `if cache and hasattr(cache, "make_mask")`
        return True


def to_padded(cache: list, reserve: int = 0) -> list:
    """Replace the KVCaches of a filled cache list by PaddedKVCaches."""
    return [PaddedKVCache.from_kv_cache(c, reserve) if isinstance(c, KVCache) else c
            for c in cache]
