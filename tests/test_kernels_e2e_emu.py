"""A simulated Apple GPU, end to end.

Plain decoding runs mlx_lm's own Metal GDN decode kernel (the packed Dk=128
kernel plain decoding uses on a Mac) and MTP's verify/commit run
gdn_verify.metal (the verify keeping a tape, the commit replaying it), all
through the Linux emulator; greedy MTP
in bf16 must stay token-identical to plain decoding. The rest of the model
(projections, conv, attention) runs MLX CPU ops in both, as on the real device
it runs the same MLX GPU ops in both.
"""

import inspect

import mlx.core as mx
import pytest

import mlx_lm
from mlx_lm.generate import generate_step
import mlx_lm.models.gated_delta as gd
import mlx_lm.models.qwen3_5 as q35
from mlx_mtp.metal import emu
from mlx_mtp.testing.synthetic import write_checkpoint


def _emulated_update(counter):
    src = inspect.getsource(gd._make_gated_delta_packed_kernel).split('source = r"""')[1]
    kern = emu.metal_kernel("mlx_lm_packed", ["q", "k", "v", "g", "beta", "state_in", "T"],
                            ["y", "state_out"], src.split('"""')[0])
    original = gd.gated_delta_update

    def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        if mask is not None or Dk != 128 or kw.get("lower_bound") is not None:
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)
        counter.append(T)
        beta = mx.sigmoid(b)
        g = gd.compute_g(A_log, a, dt_bias)
        if state is None:
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        return kern(
            inputs=[q, k, v, g, beta, state, T],
            template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv),
                      ("Hk", Hk), ("Hv", Hv)],
            grid=(32, Dv // 8, B * Hv), threadgroup=(32, 2, 1),
            output_shapes=[(B, T, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype],
        )

    return update


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(
        tmp_path_factory.mktemp("gpu_sim"), dtype="bfloat16", seed=5,
        text_overrides={"linear_key_head_dim": 128, "linear_value_head_dim": 128,
                        "linear_num_key_heads": 1, "linear_num_value_heads": 2},
    )


def test_simulated_metal_mtp_is_token_identical(ckpt, monkeypatch):
    from mlx_mtp.testing.drafters import OracleDrafter
    from mlx_mtp.decode import generate_tokens

    import mlx_mtp

    calls = []
    monkeypatch.setattr(q35, "gated_delta_update", _emulated_update(calls))
    monkeypatch.setenv("MLX_MTP_KERNELS", "emu-metal")
    verify_calls = []
    from mlx_mtp.metal import launch

    real, real_replay = launch.gdn_verify, launch.gdn_replay
    monkeypatch.setattr(launch, "gdn_verify",
                        lambda *a, **k: verify_calls.append(1) or real(*a, **k))
    replay_calls = []
    monkeypatch.setattr(launch, "gdn_replay",
                        lambda *a, **k: replay_calls.append(1) or real_replay(*a, **k))

    model, tok = mlx_mtp.load(ckpt)
    ref_model, _ = mlx_lm.load(str(ckpt))
    prompt = mx.array(tok.encode("def f(x):\n    return"))
    n = 24
    ref = [t for t, _ in generate_step(prompt, ref_model, max_tokens=n)]
    assert calls, "plain decoding did not run the emulated mlx_lm kernel"
    V = model.language_model.args.vocab_size
    for k, rate in [(2, 0.6), (3, 1.0), (8, 0.8)]:  # (8: a verify of 9 keeps a tape)
        got = [t for t, _, _ in generate_tokens(
            prompt, model, max_tokens=n, draft_tokens=k,
            drafter=OracleDrafter(ref, rate, V, seed=k))]
        assert got == ref, f"depth {k}"
    assert verify_calls, "MTP verify did not run gdn_verify.metal"
    assert replay_calls, "the commit did not replay the tape in gdn_verify.metal"
    from mlx_mtp.metal import selfcheck  # (the calls above include the self-check's)

    assert selfcheck.paths()["gdn_verify"].startswith("emu-metal kernel"), selfcheck.paths()
