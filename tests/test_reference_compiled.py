"""The compiled ops references the CPU backend runs are bit-identical to the
eager references (and so to mlx_lm's plain decoding, which the parity tests
check end to end)."""

import mlx.core as mx
import pytest

from mlx_mtp import metal


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("B,Hk,Hv,D", [(1, 2, 4, 16), (2, 1, 3, 128)])
def test_compiled_reference_bitwise(dtype, T, B, Hk, Hv, D):
    ks = mx.random.split(mx.random.key(T * 7 + B), 9)
    q = mx.random.normal((B, T, Hk, D), key=ks[0]).astype(dtype)
    k = mx.random.normal((B, T, Hk, D), key=ks[1]).astype(dtype)
    v = mx.random.normal((B, T, Hv, D), key=ks[2]).astype(dtype)
    a = mx.random.normal((B, T, Hv), key=ks[3]).astype(dtype)
    b = mx.random.normal((B, T, Hv), key=ks[4]).astype(dtype)
    A_log = mx.random.uniform(0, 2, (Hv,), key=ks[5])
    dt_bias = mx.random.normal((Hv,), key=ks[6])
    state = mx.random.normal((B, Hv, D, D), key=ks[7])
    want = metal.gdn_verify_ref(q, k, v, a, b, A_log, dt_bias, state)
    got = metal.gdn_verify_ref_compiled(q, k, v, a, b, A_log, dt_bias, state)
    for x, y in zip(want, got):
        assert x.dtype == y.dtype and mx.array_equal(x, y)
    C = 2 * Hk * D + Hv * D
    conv_state = mx.random.normal((B, 3, C), key=ks[8]).astype(dtype)
    qkv = mx.random.normal((B, T, C), key=ks[0]).astype(dtype)
    w = mx.random.normal((C, 4, 1), key=ks[1]).astype(dtype)
    for x, y in zip(metal.conv_verify_ref(conv_state, qkv, w),
                    metal.conv_verify_ref_compiled(conv_state, qkv, w)):
        assert mx.array_equal(x, y)
