"""What MLX's one-row quantized matmul computes for each row, in NumPy.

The qmv_rows kernels must give every row the bits MLX's one-row kernel gives
it alone (that is the decode step's arithmetic). On a GPU the self-check
compares them with `mx.quantized_matmul` row by row; in the emulator this
module is that row-by-row reference, written from MLX's sources (0.32):

- `cuda_qmv`: mlx/backend/cuda/quantized/qmm/qmv.cu (`qmv_kernel_impl`);
- `metal_qmv_fast`: mlx/backend/metal/kernels/quantized.h (`qmv_fast_impl`,
  `load_vector`, `qdot`), with the emulator's arithmetic: fp16 + fp16 rounds to
  fp16 but bf16 + bf16 adds in float (Metal rounds it to bf16: a difference
  both kernels share on a Mac), simd_sum as the xor-butterfly 1, 2, 4, 8, 16,
  no fma contraction.

Every operation rounds as the kernel's does: float32 in float32 and fma with a
single rounding (formed in long double), bf16 and fp16 from an exact double.
"""

from __future__ import annotations

import numpy as np

import mlx.core as mx


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def round_to(v: np.ndarray, dtype) -> np.ndarray:
    """float64 values rounded once (nearest-even) to dtype, back as float64."""
    if dtype == mx.float32:
        return v.astype(np.float32).astype(np.float64)
    if dtype == mx.float16:
        return v.astype(np.float16).astype(np.float64)
    # bf16: round to odd in float32 (exact for the second rounding), then to 8 bits
    f = v.astype(np.float32)
    back = f.astype(np.float64)
    inexact = back != v
    u = f.view(np.uint32).copy()
    u[inexact & (np.abs(back) > np.abs(v))] -= 1
    u[inexact] |= 1
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32).astype(np.float64)


def _fma(a, b, c, dtype):
    if dtype == mx.float32:
        ld = np.longdouble
        return (a.astype(ld) * b.astype(ld) + c.astype(ld)).astype(np.float32).astype(np.float64)
    return round_to(a * b + c, dtype)


def _f32(v):
    return v.astype(np.float32).astype(np.float64)


def unpack(w: mx.array, bits: int) -> np.ndarray:
    """[N, K*bits/32] uint32 -> [N, K] integer values (value j of a word at bits*j)."""
    words = np.array(w).astype(np.uint64)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint64) * bits)
    q = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(words.shape[0], -1).astype(np.float64)


def cuda_elems_per_thread(dtype, bits: int) -> int:
    return 16 if dtype != mx.float32 and bits <= 4 else 8


def cuda_qmv(x, w, scales, biases, group_size: int, bits: int, dq_fma: bool = True) -> mx.array:
    """MLX CUDA qmv for each row of x [M, K] on its own; returns [M, N] in x.dtype.
    dq_fma: whether `w * scale + bias` ran as one fma (see qmv_rows.cu)."""
    dt = x.dtype
    E = cuda_elems_per_thread(dt, bits)
    acc_dt = mx.float32 if bits >= 8 else dt
    X, S, Bi = _np(x), _np(scales), _np(biases)
    q = unpack(w, bits)
    M, K = X.shape
    N = q.shape[0]
    gidx = np.arange(K) // group_size
    s_full, b_full = S[:, gidx], Bi[:, gidx]
    if dq_fma:
        wdq = _fma(q, s_full, b_full, dt)
    else:
        wdq = round_to(round_to(q * s_full, dt) + b_full, dt)
    step = 32 * E
    sums = np.zeros((M, N, 32, E))
    lanes = np.arange(32)[:, None] * E + np.arange(E)[None, :]  # [32, E]

    def tile(idx, valid):
        xs = X[:, idx]                 # [M, 32, E]
        ws = wdq[:, idx]               # [N, 32, E]
        new = _fma(xs[:, None], ws[None], sums, acc_dt)
        return np.where(valid[None, None], new, sums)

    for r in range(K // step):
        sums = tile(lanes + r * step, np.ones((32, E), bool))
    rest = K % step
    if rest:
        start = np.arange(32) * E + K - rest
        valid = np.repeat((start < K)[:, None], E, axis=1)
        idx = np.minimum(start[:, None] + np.arange(E)[None, :], K - 1)
        sums = tile(idx, valid)
    s = np.zeros((M, N, 32))
    for j in range(E):
        s = _f32(s + sums[..., j])
    for m in (16, 8, 4, 2, 1):
        s = _f32(s + s[..., np.arange(32) ^ m])
    out = round_to(s[..., 0], dt)
    return mx.array(out.astype(np.float32)).astype(dt)


def metal_qmv_fast(x, w, scales, biases, group_size: int, bits: int) -> mx.array:
    """MLX Metal qmv_fast for each row of x [M, K] on its own (as emulated)."""
    dt = x.dtype
    vpt = (32 // bits) * 2
    block = 32 * vpt
    X, S, Bi = _np(x), _np(scales), _np(biases)
    q = unpack(w, bits)
    M, K = X.shape
    N = q.shape[0]
    if bits == 4:
        q = q * np.tile(np.array([1.0, 16.0, 256.0, 4096.0]), K // 4)  # the masked, unshifted values
        div = np.tile(np.array([1.0, 16.0, 256.0, 4096.0]), K // 4)
    else:
        div = np.ones(K)
    result = np.zeros((M, N, 32))
    for k0 in range(0, K, block):
        idx = k0 + np.arange(32)[:, None] * vpt + np.arange(vpt)[None, :]  # [32, vpt]
        xs = X[:, idx]                                  # [M, 32, vpt]
        xt = _f32(xs / div[idx])
        xsum = np.zeros((M, 32))
        step = 4 if bits == 4 else 1
        for i in range(0, vpt, step):
            part = xs[..., i]
            for t in range(1, step):  # x's own type adds them: fp16 rounds, bf16 is float here
                part = round_to(part + xs[..., i + t], mx.float16 if dt == mx.float16 else mx.float32)
            xsum = _f32(xsum + part)
        acc = np.zeros((M, N, 32))
        qs = q[:, idx]                                  # [N, 32, vpt]
        for i in range(0, vpt, step):
            part = _f32(xt[:, None, :, i] * qs[None, :, :, i])
            for t in range(1, step):
                part = _f32(part + _f32(xt[:, None, :, i + t] * qs[None, :, :, i + t]))
            acc = _f32(acc + part)
        g = idx[:, 0] // group_size                     # [32]
        sc, bi = S[:, g], Bi[:, g]                      # [N, 32]
        val = _f32(_f32(sc[None] * acc) + _f32(xsum[:, None] * bi[None]))
        result = _f32(result + val)
    for m in (1, 2, 4, 8, 16):
        result = _f32(result + result[..., np.arange(32) ^ m])
    out = round_to(result[..., 0], dt)
    return mx.array(out.astype(np.float32)).astype(dt)
