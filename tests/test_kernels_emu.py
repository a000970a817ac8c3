"""Every Metal kernel (and its CUDA twin) executed on Linux by metal/emu and
compared with the ops references (`*_ref` in metal/__init__.py).

Emulated twins are selected with `-k twin`; tests on a real CUDA device live in
test_kernels_cuda.py (`-k cuda`)."""

import inspect
import re

import mlx.core as mx
import numpy as np
import pytest

import mlx_mtp.metal as K
from mlx_mtp.metal import emu, gdn_verify_ref, launch

from kernel_checks import (CONV_CASES, DRAFT_CASES, GDN_CASES, _np, check_commit, check_conv,
                           check_draft, check_gdn, close, gdn_inputs)

METAL = "emu-metal"
TWIN = "emu-cuda"


def test_emulator_simd_barrier_poison():
    src = """
        uint i = thread_position_in_grid.x;
        uint lane = thread_index_in_simdgroup;
        threadgroup float sh[64];
        float v = x[i];
        float s = simd_sum(v);
        float nb = simd_shuffle_xor(v, 3u);
        float dn = simd_shuffle_down(v, 1u);
        sh[thread_index_in_threadgroup] = v;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float other = sh[(thread_index_in_threadgroup + 32) % 64];
        if (i % 5 != 4) {
          out[i * 4 + 0] = s;
          out[i * 4 + 1] = nb;
          out[i * 4 + 2] = dn;
          out[i * 4 + 3] = other;
        }
    """
    kern = emu.metal_kernel("t", ["x"], ["out"], src)
    x = np.arange(128, dtype=np.float32)
    (out,) = kern(inputs=[mx.array(x)], grid=(128, 1, 1), threadgroup=(64, 1, 1),
                  output_shapes=[(128, 4)], output_dtypes=[mx.float32])
    out = np.array(out)
    i = np.arange(128)
    sg = i // 32
    w = i % 5 != 4
    exp_sum = np.array([x[s * 32:(s + 1) * 32].sum() for s in sg])
    lane = i % 32
    exp_dn = np.where(lane < 31, x[np.minimum(i + 1, 127)], x)
    exp_other = x[(i // 64) * 64 + ((i % 64) + 32) % 64]
    np.testing.assert_array_equal(out[w, 0], exp_sum[w])
    np.testing.assert_array_equal(out[w, 1], x[sg * 32 + (lane ^ 3)][w])
    np.testing.assert_array_equal(out[w, 2], exp_dn[w])
    np.testing.assert_array_equal(out[w, 3], exp_other[w])
    assert np.isnan(out[~w]).all()  # unwritten outputs stay poisoned


def test_emulator_reports_divergent_simd_ops():
    src = """
        float v = x[thread_position_in_grid.x];
        if (thread_index_in_simdgroup < 16) { v = simd_sum(v); } else { v = simd_max(v); }
        out[thread_position_in_grid.x] = v;
    """
    kern = emu.metal_kernel("div", ["x"], ["out"], src)
    with pytest.raises(RuntimeError, match="divergent"):
        kern(inputs=[mx.zeros((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
             output_shapes=[(32,)], output_dtypes=[mx.float32])


@pytest.mark.parametrize("index,where", [("i + 1", "past the end of `out`"), ("i", None)])
def test_emulator_catches_out_of_bounds(index, where):
    src = f"uint i = thread_position_in_grid.x; out[{index}] = x[i];"
    kern = emu.metal_kernel("oob", ["x"], ["out"], src)
    call = lambda: kern(inputs=[mx.ones((1024,))], grid=(1024, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[(1024,)], output_dtypes=[mx.float32])
    if where is None:
        assert np.array(call()[0]).sum() == 1024
    else:
        with pytest.raises(RuntimeError, match=re.escape(where)):
            call()


def test_emulator_runs_mlx_lm_gdn_kernels():
    """mlx_lm's own Metal GDN kernels through the emulator: packed == xtree
    bitwise (their documented contract) and both match the ops path."""
    import mlx_lm.models.gated_delta as gd

    def body(fn, marker):
        return inspect.getsource(fn).split(marker)[1].split('"""')[0]

    names = ["q", "k", "v", "g", "beta", "state_in", "T"]
    packed = emu.metal_kernel("packed", names, ["y", "state_out"],
                              body(gd._make_gated_delta_packed_kernel, 'source = r"""'))
    xtree = emu.metal_kernel("xtree", names, ["y", "state_out"],
                             body(gd._make_gated_delta_kernel_xtree, 'source = """'))
    B, T, Hk, Hv, D = 1, 3, 1, 2, 128
    mx.random.seed(3)
    q = mx.random.normal((B, T, Hk, D)) * 0.1
    k = mx.random.normal((B, T, Hk, D)) * 0.1
    v = mx.random.normal((B, T, Hv, D))
    g = mx.random.uniform(shape=(B, T, Hv))
    beta = mx.random.uniform(shape=(B, T, Hv))
    st = mx.random.normal((B, Hv, D, D))
    tmpl = [("InT", mx.float32), ("StT", mx.float32), ("Dk", D), ("Dv", D), ("Hk", Hk), ("Hv", Hv)]
    common = dict(inputs=[q, k, v, g, beta, st, T], template=tmpl,
                  output_shapes=[(B, T, Hv, D), st.shape], output_dtypes=[mx.float32] * 2)
    y1, s1 = packed(grid=(32, D // 8, B * Hv), threadgroup=(32, 2, 1), **common)
    y2, s2 = xtree(grid=(32, D, B * Hv), threadgroup=(32, 4, 1), **common)
    assert np.array_equal(np.array(y1), np.array(y2))
    assert np.array_equal(np.array(s1), np.array(s2))
    yr, sr = gd.gated_delta_ops(q, k, v, g, beta, st)
    close(y1, yr, 1e-5)
    close(s1, sr, 1e-5)


# ------------------------------------------------------------------ GDN
def _gdn_id(c):
    return "-".join(map(str, c[:6])) + str(c[6]).split(".")[-1]


@pytest.mark.parametrize("fused", [False, True], ids=["exact", "fused"])
@pytest.mark.parametrize("case", GDN_CASES, ids=_gdn_id)
def test_gdn_verify_metal(case, fused):
    check_gdn(case, METAL, fused)


@pytest.mark.parametrize("fused", [False, True], ids=["exact", "fused"])
@pytest.mark.parametrize("case", [GDN_CASES[1], GDN_CASES[2], GDN_CASES[6]], ids=_gdn_id)
def test_gdn_verify_twin_emulated(case, fused):
    check_gdn(case, TWIN, fused)


@pytest.mark.parametrize("case", [GDN_CASES[2], (2, 3, 1, 2, 32, 32, mx.float32)], ids=_gdn_id)
def test_gdn_verify_exact_is_bitwise_plain_decoding(case):
    """Exact mode vs mlx_lm's own Metal decode kernel (packed for Dk=128, the
    xtree comparator otherwise) run one token at a time, as plain decoding
    does on an Apple GPU: every y and every captured state bit-identical."""
    import mlx_lm.models.gated_delta as gd

    B, T, Hk, Hv, Dk, Dv, dt = case
    q, k, v, a, b, A_log, dt_bias, state = gdn_inputs(*case)
    y, states = launch.gdn_verify(q, k, v, a, b, A_log, dt_bias, state, backend=METAL)
    qn, kn = gd.normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    g, beta = gd.compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    packed = Dk == 128
    fn = gd._make_gated_delta_packed_kernel if packed else gd._make_gated_delta_kernel_xtree
    src = inspect.getsource(fn).split('source = r"""' if packed else 'source = """')[1].split('"""')[0]
    kern = emu.metal_kernel("mlx_lm_step", ["q", "k", "v", "g", "beta", "state_in", "T"],
                            ["y", "state_out"], src)
    st = state
    for t in range(T):
        sl = slice(t, t + 1)
        yt, st = kern(
            inputs=[qn[:, sl], kn[:, sl], v[:, sl], g[:, sl], beta[:, sl], st, 1],
            template=[("InT", dt), ("StT", mx.float32), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
            grid=(32, Dv // 8, B * Hv) if packed else (32, Dv, B * Hv),
            threadgroup=(32, 2, 1) if packed else (32, 4, 1),
            output_shapes=[(B, 1, Hv, Dv), st.shape], output_dtypes=[dt, mx.float32],
        )
        assert np.array_equal(_np(yt), _np(y[:, sl])), f"y at position {t}"
        assert np.array_equal(np.array(st), np.array(states[:, t])), f"state at position {t}"


# ------------------------------------------------------------------ conv
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv_verify_metal(case):
    check_conv(case, METAL)


def test_conv_verify_twin_emulated():
    check_conv(CONV_CASES[1], TWIN)


# ------------------------------------------------------------------ commit
@pytest.mark.parametrize("consumed", [1, 2, 4])  # all rejected (only the bonus) .. all accepted
def test_commit_metal(consumed):
    check_commit(METAL, L=3, B=2, T=4, Hv=2, D=128, C=320, Kw=4, consumed=consumed)


def test_commit_metal_single_token():
    check_commit(METAL, L=2, B=1, T=1, Hv=3, D=32, C=40, Kw=4, consumed=1, dt=mx.float32)


def test_commit_twin_emulated():
    check_commit(TWIN, L=2, B=2, T=3, Hv=1, D=128, C=96, Kw=4, consumed=3)


# ------------------------------------------------------------------ draft head
@pytest.mark.parametrize("case", DRAFT_CASES, ids=lambda c: "-".join(map(str, c[:3])) + f"-{c[4]}b-ids{c[5]}-k{c[6]}")
def test_draft_project_metal(case):
    check_draft(METAL, *case)


def test_draft_project_splits_many_rows():
    check_draft(METAL, 10, 64, 300, mx.float32, 0, 0, 2)


@pytest.mark.parametrize("case", [DRAFT_CASES[1], DRAFT_CASES[5]])
def test_draft_project_twin_emulated(case):
    check_draft(TWIN, *case)


# ------------------------------------------------------------------ mutations
def _mutate(name, dial, old, new):
    src = launch.load_source(name, dial)
    assert src.count(old) >= 1, old
    return src.replace(old, new, 1)


@pytest.mark.parametrize("dial,backend,fused", [("metal", METAL, False), ("metal", METAL, True),
                                                ("cuda", TWIN, False)],
                         ids=["metal-exact", "metal-fused", "twin-exact"])
def test_mutation_in_delta_update_is_caught(dial, backend, fused):
    """Flip the first '+' of the delta update: the comparison must fail."""
    case = GDN_CASES[1]
    bad = _mutate("gdn_verify", dial, "st[i] = st[i] + kv[i] * delta;", "st[i] = st[i] - kv[i] * delta;")
    with launch.override_source("gdn_verify", dial, bad):
        with pytest.raises(AssertionError, match="max err"):
            check_gdn(case, backend, fused)
    check_gdn(case, backend, fused)  # and the real source passes again


def test_mutation_in_conv_and_draft_is_caught():
    bad = _mutate("conv_verify", "metal", "acc += xv *", "acc -= xv *")
    with launch.override_source("conv_verify", "metal", bad):
        with pytest.raises(AssertionError, match="max err"):
            check_conv(CONV_CASES[0], METAL)
    bad = _mutate("draft_project", "metal", "acc[n] += s * qx + bb * xs;", "acc[n] += s * qx - bb * xs;")
    with launch.override_source("draft_project", "metal", bad):
        with pytest.raises(AssertionError):
            check_draft(METAL, *DRAFT_CASES[4])


# ------------------------------------------------------------------ dispatch
def test_cpu_dispatches_to_reference(monkeypatch):
    monkeypatch.delenv("MLX_MTP_KERNELS", raising=False)
    if mx.default_device() == mx.cpu:
        assert K.backend() == "ref"
    monkeypatch.setenv("MLX_MTP_KERNELS", METAL)
    assert K.backend() == METAL
    case = (1, 2, 1, 1, 32, 32, mx.float32)
    args = gdn_inputs(*case)
    yr, sr = gdn_verify_ref(*args)
    calls = []
    real = launch.gdn_verify
    monkeypatch.setattr(launch, "gdn_verify", lambda *a, **k: calls.append(k) or real(*a, **k))
    y, s = K.gdn_verify(*args)  # via the env switch
    close(y, yr, 2e-5)
    assert calls[-1] == {"backend": METAL, "fused": False}
    monkeypatch.setenv("MLX_MTP_FAST_KERNELS", "1")
    K.gdn_verify(*args)
    assert calls[-1]["fused"] is True
    monkeypatch.setenv("MLX_MTP_KERNELS", TWIN)  # CUDA default: the ops path
    monkeypatch.delenv("MLX_MTP_FAST_KERNELS")
    n = len(calls)
    K.gdn_verify(*args)
    K.conv_verify(mx.zeros((1, 3, 8)), mx.ones((1, 2, 8)), mx.ones((8, 4, 1)))
    assert len(calls) == n
