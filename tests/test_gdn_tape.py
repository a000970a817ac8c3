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
                                           ("emu-cuda", False), ("emu-cuda", True)],
                         ids=["metal-exact", "metal-fused", "twin-exact", "twin-fused"])
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


# Qwen3.6-27B's GDN shapes (its config.json's text_config)
QWEN36_27B = dict(num_hidden_layers=64, full_attention_interval=4, linear_num_value_heads=48,
                  linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, hidden_size=5120)


def test_rollback_of_a_run_of_16_at_27b_fits_64mb():
    """48 GDN layers: the tape and conv input of 17 positions, 33.3 MB per row
    (the 17 captured states were 2.59 GB)."""
    from mlx_mtp.cache import rollback_bytes

    assert rollback_bytes(QWEN36_27B, 16) == 33_265_152 <= 64 * 2**20
    assert rollback_bytes(QWEN36_27B, 16, tape=False) == 2_586_574_848


@pytest.mark.parametrize("mode", ["tape", "capture"])
def test_rollback_bytes_are_what_a_verify_keeps(loaded, dense_bf16_ckpt, monkeypatch, mode):
    """A verify of 16 drafts on the tiny bf16 model (two rows) keeps, for its
    GDN layers' rollback, exactly `rollback_bytes` per row."""
    import json

    from mlx_mtp import cache as cache_mod
    from mlx_mtp.cache import CaptureCache, MTPCache, rollback_bytes
    from mlx_mtp.checkpoint import text_config

    monkeypatch.setattr(cache_mod, "_FORCE_ROLLBACK", mode)
    model, _, _ = loaded("dense_bf16")
    B, run = 2, 16
    prompt_cache = model.make_cache()
    model.trunk_hidden(mx.zeros((B, 5), mx.int32), prompt_cache)
    cache = MTPCache.from_prompt_cache(prompt_cache, len(prompt_cache), use_head=False, batch=B)
    CaptureCache.start(cache.trunk)
    model.trunk_hidden(mx.ones((B, run + 1), mx.int32), cache.trunk)
    captures = CaptureCache.take_all(cache.trunk)
    assert all((c.tape is not None) == (mode == "tape") for c in captures)
    config = text_config(json.loads((dense_bf16_ckpt / "config.json").read_text()))
    kept = sum(c.nbytes for c in captures)
    assert kept == B * rollback_bytes(config, run, act_bytes=2, tape=mode == "tape")
