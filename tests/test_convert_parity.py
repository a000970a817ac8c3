"""Greedy MTP decoding of converted 8-bit and 4-bit folders is token-identical
to mlx_lm greedy decoding of the same folder (MLX CPU), depths 1-3."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_mtp.convert import convert
from mlx_mtp.testing.synthetic import write_checkpoint

N_TOKENS = 24
PROMPT = [3, 17, 99, 42, 7, 7, 150, 201, 12, 64, 88]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("parity")
    dense = write_checkpoint(base / "hf", seed=11)
    moe = write_checkpoint(base / "hf_moe", seed=12, moe=True)
    out = {}
    for name, src, bits, head in [("q8", dense, 8, 8), ("q4", dense, 4, 8), ("q4h4", dense, 4, 4),
                                  ("moe_q4", moe, 4, 8)]:
        out[name] = convert(src, base / name, quantize=True, q_bits=bits, mtp_bits=head)["output"]
    return out


def reference(path):
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tok = mlx_lm.load(path)
    gen = generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS)
    return [t for t, _ in gen], model, tok


@pytest.mark.parametrize("name", ["q8", "q4", "q4h4", "moe_q4"])
def test_greedy_parity_with_mlx_lm(converted, name):
    import mlx_mtp
    from mlx_mtp.testing.drafters import OracleDrafter
    from mlx_mtp.decode import generate_tokens
    from mlx_mtp.stats import MTPStats

    ref, _, _ = reference(converted[name])
    model, _ = mlx_mtp.load(converted[name], quiet=True)
    assert model.has_mtp
    depths = (1, 2, 3) if name != "moe_q4" else (2,)
    for k in depths:
        stats = MTPStats()
        got = [t for t, _ in mlx_mtp.generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS,
                                                    draft_tokens=k, stats=stats)]
        assert got == ref, f"{name}: head drafts, depth {k}"
        assert stats.drafted > 0
        # drafts that are often right exercise the accept/commit paths (a random
        # head is almost never right)
        oracle = OracleDrafter(ref, accept_rate=0.7, vocab_size=259, seed=k)
        stats = MTPStats()
        got = [t for t, _, _ in generate_tokens(mx.array(PROMPT), model, max_tokens=N_TOKENS,
                                                 draft_tokens=k, stats=stats, drafter=oracle)]
        assert got == ref, f"{name}: oracle drafts, depth {k}"
        assert stats.accepted > 0


def test_text_parity_generate(converted):
    """The user-level call: mlx_mtp.generate vs mlx_lm.generate on the same folder."""
    import mlx_lm

    import mlx_mtp

    path = converted["q4"]
    lm_model, lm_tok = mlx_lm.load(path)
    want = mlx_lm.generate(lm_model, lm_tok, "The quick brown fox", max_tokens=16)
    model, tok = mlx_mtp.load(path, quiet=True)
    for k in (1, 3):
        assert mlx_mtp.generate(model, tok, "The quick brown fox", max_tokens=16, draft_tokens=k) == want
