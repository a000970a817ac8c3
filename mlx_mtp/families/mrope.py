"""Qwen3.5 / 3.6's and qwen4_exp's multimodal RoPE (M-RoPE) for the trunk's
and the head's attention (docs/design.md, "Images"; docs/qwen4_exp.md,
"Images").

A text token's three position ids (time, height, width) are equal, and then
M-RoPE is the plain rotary embedding at that position: mlx_lm's rope, at the
cache's offset, shifted by the row's `rope_delta` once an image came before.
Only an image's own tokens have three different ids. `MRoPE` wraps a layer's
rope: called with an integer or per-row offset it is that rope, unchanged;
called with `Positions` it rotates each token by its own three ids, the
frequencies interleaved between the axes as transformers'
`Qwen3_5TextRotaryEmbedding.recomposition_frequencies` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class Positions:
    """Each token's (time, height, width) position ids: int32 [3, B, L];
    `before` [3, B, S]: those of the S tokens the cache holds before them
    (a layer that ropes earlier tokens: qwen4_exp's indexer, at a block's
    first token)."""

    ids: mx.array
    before: Optional[mx.array] = None


def frequency_axes(frequencies: int, sections: Sequence[int], interleaved: bool = True
                   ) -> np.ndarray:
    """Which axis (0 time, 1 height, 2 width) each rotary frequency takes its
    angle from, as transformers' Qwen3.5 text rotary embedding assigns them:
    interleaved (`mrope_interleaved`), frequency j is height's when
    j % 3 == 1 and j < 3 * sections[1], width's when j % 3 == 2 and
    j < 3 * sections[2], else time's; not interleaved, consecutive blocks of
    sections[0], sections[1], sections[2]. The angle of frequency j at token
    i is positions[axes[j], i] * inv_freq[j]."""
    axes = np.zeros(frequencies, np.int32)
    if interleaved:
        for axis in (1, 2):
            axes[axis:3 * sections[axis]:3] = axis
    else:
        axes[sections[0]:sections[0] + sections[1]] = 1
        axes[sections[0] + sections[1]:sum(sections[:3])] = 2
    return axes


class MRoPE(nn.Module):
    """A layer's rope (mlx_lm's `nn.RoPE`, not traditional) that also takes
    `Positions`."""

    def __init__(self, rope: nn.RoPE, sections: Sequence[int], interleaved: bool = True):
        super().__init__()
        if rope.traditional:
            raise ValueError("M-RoPE rotates halves (traditional=False)")
        self.rope = rope
        # (from NumPy: the model is built on one thread and may decode on another,
        # where a lazy array of the first thread's stream cannot be evaluated)
        self._inv_freq = mx.array(
            rope.base ** (-np.arange(0, rope.dims, 2, dtype=np.float32) / rope.dims))
        self._axes = mx.array(frequency_axes(rope.dims // 2, sections, interleaved))

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if not isinstance(offset, Positions):
            return self.rope(x, offset=offset)
        dims, half = self.rope.dims, self.rope.dims // 2
        ids = offset.ids.astype(mx.float32)  # [3, B, L]
        # each frequency at its axis' position: [B, L, half]
        pos = mx.take(ids, self._axes, axis=0).transpose(1, 2, 0)
        angles = (pos * self._inv_freq * self.rope.scale)[:, None]  # [B, 1, L, half]
        cos, sin = mx.cos(angles), mx.sin(angles)
        x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
        rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        return mx.concatenate(rotated + [rest], axis=-1).astype(x.dtype)


class PositionedCache:
    """An attention layer's cache as its layer sees it for one forward, with
    the positions RoPE takes in place of the cache's own offset: `Positions`
    (a prefill over an image), or the offset shifted by each row's delta (text
    after an image). Everything else is the cache's own (writes, masks)."""

    def __init__(self, cache, offset):
        self._cache, self.offset = cache, offset

    @property
    def wrapped(self):
        """The cache itself (a layer that unwraps a list of caches)."""
        return self._cache

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _is_attention(cache) -> bool:
    """An attention layer's cache: a KV cache, or a list of them (qwen4_exp's
    QSA layer: mlx_lm's CacheList, mlx_mtp's PaddedCacheList)."""
    return hasattr(cache, "update_and_fetch") or hasattr(cache, "caches")


def _offset(cache):
    return cache.offset if hasattr(cache, "offset") else cache[0].offset


def positioned(caches: list, offset) -> list:
    """`caches` (a layer stack's) with each attention cache's RoPE offset
    replaced: `offset(cache)` gives it (None: the list unchanged)."""
    if offset is None:
        return caches
    return [PositionedCache(c, offset(c)) if _is_attention(c) else c for c in caches]


def shifted(caches: list, delta) -> list:
    """Text positions after an image: each row at its cache's offset plus its
    own delta ([B] int32; None: no row saw an image, the caches unchanged)."""
    return positioned(caches, None if delta is None else (lambda c: _offset(c) + delta))


def at(caches: list, positions: Positions) -> list:
    """Every token of this forward at its own three position ids."""
    return positioned(caches, lambda c: positions)


def install(attention_layers, rope_parameters: dict) -> bool:
    """Wrap each attention layer's rope in MRoPE when the text config names
    an `mrope_section` (Qwen3.5/3.6): text decodes through it unchanged.
    Returns whether it did."""
    sections = (rope_parameters or {}).get("mrope_section")
    if not sections:
        return False
    for attn in attention_layers:
        if not isinstance(attn.rope, MRoPE):
            attn.rope = MRoPE(attn.rope, sections,
                              bool(rope_parameters.get("mrope_interleaved", False)))
    return True
