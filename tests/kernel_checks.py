"""Kernel checks shared by the emulator tests and the CUDA-device tests:
each runs a kernel on a backend and compares it with the ops reference."""

import mlx.core as mx
import numpy as np

from mlx_mtp.metal import commit_ref, conv_verify_ref, draft_project_ref, gdn_verify_ref, launch

def _np(a):
    return np.array(a.astype(mx.float32))


def close(got, ref, tol):
    """max |got - ref| <= tol * (1 + max |ref|), and nothing left poisoned."""
    g, r = _np(got), _np(ref)
    assert g.shape == r.shape, (g.shape, r.shape)
    assert np.isfinite(g).all(), "non-finite (poisoned) output"
    err = float(np.abs(g - r).max()) if g.size else 0.0
    assert err <= tol * (1.0 + float(np.abs(r).max())), f"max err {err}"


TOL = {mx.float32: 2e-5, mx.bfloat16: 3e-2, mx.float16: 5e-3}


# ------------------------------------------------------------------ emulator


def gdn_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)).astype(dtype)
    k = mx.random.normal((B, T, Hk, Dk)).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    a = mx.random.normal((B, T, Hv)).astype(dtype)
    b = mx.random.normal((B, T, Hv)).astype(dtype)
    A_log = mx.random.uniform(-1.0, 1.0, (Hv,))
    dt_bias = mx.random.normal((Hv,)).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state


GDN_CASES = [
    # B, T, Hk, Hv, Dk, Dv, dtype
    (1, 1, 1, 1, 128, 128, mx.float32),
    (2, 4, 1, 2, 128, 128, mx.float32),
    (1, 8, 1, 3, 128, 128, mx.bfloat16),
    (4, 2, 2, 2, 128, 128, mx.float32),
    (3, 5, 1, 3, 128, 128, mx.float16),
    (2, 3, 1, 2, 32, 32, mx.float32),
    (1, 6, 2, 4, 16, 16, mx.bfloat16),
]


def check_gdn(case, backend, fused=False):
    B, T, Hk, Hv, Dk, Dv, dt = case
    args = gdn_inputs(B, T, Hk, Hv, Dk, Dv, dt)
    yr, sr = gdn_verify_ref(*args)
    y, s = launch.gdn_verify(*args, backend=backend, fused=fused)
    assert y.dtype == yr.dtype and s.dtype == mx.float32
    close(y, yr, TOL[dt])
    close(s, sr, TOL[dt])


CONV_CASES = [(1, 1, 96, 4, mx.float32), (2, 5, 300, 4, mx.bfloat16), (4, 8, 160, 3, mx.float32)]


def check_conv(case, backend):
    B, T, C, Kw, dt = case
    mx.random.seed(1)
    cs = mx.random.normal((B, Kw - 1, C)).astype(dt)
    x = mx.random.normal((B, T, C)).astype(dt)
    w = mx.random.normal((C, Kw, 1)).astype(dt)
    o_r, ci_r = conv_verify_ref(cs, x, w)
    o, ci = launch.conv_verify(cs, x, w, backend=backend)
    assert o.dtype == o_r.dtype and ci.dtype == ci_r.dtype
    assert np.array_equal(_np(ci), _np(ci_r))
    close(o, o_r, TOL[dt])


def check_commit(backend, L, B, T, Hv, D, C, Kw, consumed, dt=mx.bfloat16):
    mx.random.seed(2)
    states = [mx.random.normal((B, T, Hv, D, D)) for _ in range(L)]
    convs = [mx.random.normal((B, Kw - 1 + T, C)).astype(dt) for _ in range(L)]
    n = mx.array(consumed, dtype=mx.int32)
    ref = commit_ref(states, convs, n, Kw)
    got = launch.commit(states, convs, n, Kw, backend=backend)
    assert len(got) == L
    for (w1, s1), (w2, s2) in zip(ref, got):
        assert w1.dtype == w2.dtype and s1.shape == s2.shape
        assert np.array_equal(_np(w1), _np(w2))
        assert np.array_equal(np.array(s1), np.array(s2))


def check_draft(backend, N, H, V, dt, bits, n_ids, top_k, gs=64, seed=4):
    mx.random.seed(seed)
    h = mx.random.normal((N, H)).astype(dt)
    w = mx.random.normal((V, H)) * 0.05
    ids = None
    if n_ids:
        rng = np.random.default_rng(seed)
        ids = mx.array(np.sort(rng.choice(V, n_ids, replace=False)).astype(np.int32))
    if bits:
        qw, sc, bi = mx.quantize(w, group_size=gs, bits=bits)
        sc, bi = sc.astype(dt), bi.astype(dt)
        args = (qw, sc, bi)
        # MLX CPU's low-precision quantized matmul is itself off by a few
        # ulps; the oracle is the fp32 reference on the same (exact) values.
        oracle = (h.astype(mx.float32), qw, sc.astype(mx.float32), bi.astype(mx.float32))
    else:
        w = w.astype(dt)
        args = (w, None, None)
        oracle = (h, w, None, None)
    kw = dict(group_size=gs, bits=bits, vocab_ids=ids)
    vals, got = launch.draft_project(h, *args, top_k=top_k, backend=backend, **kw)
    assert vals.shape == (N, top_k) and got.shape == (N, top_k) and got.dtype == mx.int32
    # full oracle logits over the scored rows, in full-vocabulary ids
    rv, rid = draft_project_ref(*oracle, top_k=min(V if ids is None else n_ids, 32), **kw)
    rv, rid = _np(rv), np.array(rid)
    vals, got = _np(vals), np.array(got)
    assert np.isfinite(vals).all()
    tol = 1e-5 if dt == mx.float32 else 2 ** -7  # ~1 bf16 ulp relative
    for n in range(N):
        lut = dict(zip(rid[n].tolist(), rv[n].tolist()))
        scale = 1.0 + abs(rv[n, 0])
        for j in range(top_k):
            i = int(got[n, j])
            assert i in lut, f"row {n}: id {i} not among the oracle's best"
            assert abs(lut[i] - vals[n, j]) <= tol * scale
            assert abs(rv[n, j] - vals[n, j]) <= 2 * tol * scale  # j-th best value
        assert list(vals[n]) == sorted(vals[n], reverse=True)
    if dt == mx.float32 and not bits:  # unambiguous: exact ids and order
        np.testing.assert_array_equal(got, rid[:, :top_k])


DRAFT_CASES = [
    # N, H, V, dtype, bits, n_ids, top_k
    (1, 256, 1000, mx.float32, 0, 0, 1),
    (3, 128, 700, mx.float32, 0, 200, 5),
    (2, 256, 900, mx.bfloat16, 0, 0, 4),
    (1, 256, 800, mx.bfloat16, 4, 0, 1),
    (4, 128, 600, mx.float32, 4, 150, 3),
    (2, 256, 640, mx.bfloat16, 8, 300, 2),
    (1, 128, 300, mx.float32, 2, 0, 2),
    (1, 1024, 8192, mx.bfloat16, 4, 0, 1),  # real hidden size, trimmed-vocab scale
]


# -------------------------------------------------------- quantized matmul rows
QMV_CASES = [
    # dtype, bits, group_size, rows, N, K
    (mx.bfloat16, 4, 64, 4, 24, 1024),
    (mx.bfloat16, 4, 32, 2, 40, 512 + 256),   # a K tail, a partly filled block
    (mx.bfloat16, 8, 128, 8, 16, 1024),
    (mx.float16, 4, 128, 5, 16, 512),
    (mx.float16, 8, 64, 3, 16, 768),
    (mx.float32, 4, 64, 7, 8, 512),
    (mx.float32, 8, 32, 2, 24, 1024),
]


def qmv_inputs(dtype, bits, gs, rows, N, K, seed=0):
    ks = mx.random.split(mx.random.key(seed), 2)
    x = mx.random.normal((rows, K), key=ks[0]).astype(dtype)
    w = mx.random.normal((N, K), key=ks[1]).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=gs, bits=bits)
    return x, wq, scales, biases


def check_qmv_rows(backend, one_row, dtype, bits, gs, rows, N, K, dq_fma=True):
    """qmv_rows equals `one_row` (each row alone through the backend's one-row
    kernel) bit for bit, in every row."""
    x, w, s, b = qmv_inputs(dtype, bits, gs, rows, N, K)
    got = launch.qmv_rows(x, w, s, b, group_size=gs, bits=bits, backend=backend, dq_fma=dq_fma)
    want = one_row(x, w, s, b, gs, bits, dq_fma)
    assert got.shape == want.shape and got.dtype == want.dtype
    bad = mx.sum(got != want).item()
    assert bad == 0, f"{bad} of {want.size} values differ from the one-row kernel's"
