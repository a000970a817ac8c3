"""M-RoPE (mlx_mtp/families/mrope.py): text positions are mlx_lm's rope
unchanged; an image's three position ids rotate as transformers' Qwen3.5 does."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_mtp.families.mrope import MRoPE, Positions, frequency_axes

SECTIONS = (11, 11, 10)  # the release's mrope_section


def _rope(dims=16, base=10000.0):
    return MRoPE(nn.RoPE(dims, traditional=False, base=base), SECTIONS)


def test_equal_ids_are_the_plain_rope_at_that_offset():
    """A text token (t = h = w) is rotated exactly as mlx_lm's rope at its
    offset, for one offset and for one per row (the batch's PaddedKVCache)."""
    mx.random.seed(0)
    rope = _rope()
    x = mx.random.normal((2, 4, 5, 64))  # [B, heads, L, head_dim]: a quarter rotary
    for offset in (0, 7, mx.array([3, 11])):
        starts = np.broadcast_to(np.array(offset), (2,))
        ids = np.stack([starts[:, None] + np.arange(5)] * 3)  # [3, B, L]
        got = rope(x, Positions(mx.array(ids, dtype=mx.int32)))
        want = rope(x, offset)
        assert np.allclose(np.array(got), np.array(want), atol=2e-5), offset
        assert np.array_equal(np.array(rope(x, offset)), np.array(rope.rope(x, offset=offset)))


def test_frequencies_interleave_as_the_release_config_says():
    """dims 64 (head 256 x 0.25): 32 frequencies, height on 1, 4, ... 31 and
    width on 2, 5, ... 29 (3 x their sections), time on the rest."""
    axes = frequency_axes(32, SECTIONS).tolist()
    assert [i for i, a in enumerate(axes) if a == 1] == list(range(1, 33, 3))
    assert [i for i, a in enumerate(axes) if a == 2] == list(range(2, 30, 3))
    assert axes.count(0) == 32 - 11 - 10


def test_a_token_moves_with_its_own_axis():
    """Changing only a token's width id changes only the width frequencies'
    rotation of that token (the other tokens and frequencies stay put)."""
    mx.random.seed(1)
    rope = _rope()
    x = mx.random.normal((1, 2, 3, 16))
    ids = np.zeros((3, 1, 3), np.int32)
    ids[:, 0] = [[4, 4, 4], [4, 5, 6], [4, 6, 5]]
    moved = ids.copy()
    moved[2, 0, 1] += 3
    a = np.array(rope(x, Positions(mx.array(ids))))
    b = np.array(rope(x, Positions(mx.array(moved))))
    width = frequency_axes(8, SECTIONS) == 2
    changed = ~np.isclose(a, b, atol=1e-6)
    assert not changed[:, :, [0, 2]].any()  # other tokens
    cols = np.concatenate([width, width])  # a frequency rotates dims i and i + half
    assert changed[:, :, 1, :16][..., cols].all() and not changed[:, :, 1, :16][..., ~cols].any()


@pytest.mark.slow
def test_matches_transformers_qwen3_5_rotary():
    """Against transformers' Qwen3_5TextRotaryEmbedding and
    apply_rotary_pos_emb (PyTorch), at random three-axis ids."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=2, head_dim=64,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25,
                                                "mrope_section": list(SECTIONS),
                                                "mrope_interleaved": True})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 40, (3, 2, 6))
    q = rng.standard_normal((2, 2, 6, 64)).astype(np.float32)
    rotary = hf.Qwen3_5TextRotaryEmbedding(config)
    cos, sin = rotary(torch.tensor(q), torch.tensor(ids))
    want, _ = hf.apply_rotary_pos_emb(torch.tensor(q), torch.tensor(q), cos, sin)
    got = _rope()(mx.array(q), Positions(mx.array(ids, dtype=mx.int32)))
    assert np.allclose(np.array(got), want.numpy(), atol=1e-5)
