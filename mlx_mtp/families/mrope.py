"""Qwen3.5 / 3.6's multimodal RoPE (M-RoPE) for the trunk's and the head's
attention (docs/design.md, "Images").

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
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class Positions:
    """Each token's (time, height, width) position ids: int32 [3, B, L]."""

    ids: mx.array


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
        self._inv_freq = rope.base ** (-mx.arange(0, rope.dims, 2, dtype=mx.float32) / rope.dims)
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
