"""CUDA twins on a real MLX CUDA device (`pytest -k cuda`); skipped elsewhere.

The same checks as test_kernels_emu.py, with backend "cuda" and the default
device set to the GPU (the references then run on the GPU too)."""

import mlx.core as mx
import pytest

import mlx_mtp.metal as K
from kernel_checks import (
    CONV_CASES, DRAFT_CASES, GDN_CASES, QMV_CASES, check_commit, check_conv, check_draft,
    check_gdn, check_qmv_rows,
)

pytestmark = pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="needs MLX's CUDA backend"
)


@pytest.fixture(autouse=True)
def _gpu():
    prev = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(prev)


def test_cuda_dispatch():
    assert K.backend() == "cuda"


@pytest.mark.parametrize("case", GDN_CASES, ids=str)
def test_cuda_gdn_verify(case):
    check_gdn(case, "cuda")


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_cuda_conv_verify(case):
    check_conv(case, "cuda")


@pytest.mark.parametrize("consumed", [1, 2, 4])
def test_cuda_commit(consumed):
    check_commit("cuda", L=3, B=2, T=4, Hv=2, D=128, C=320, Kw=4, consumed=consumed)


@pytest.mark.parametrize("case", DRAFT_CASES, ids=str)
def test_cuda_draft_project(case):
    check_draft("cuda", *case)


# Qwen3.6-27B's projections (N, K): attention q/o, GDN in_proj_qkv/out, MLP up/down
QMV_27B = [(12288, 5120), (5120, 6144), (10240, 5120), (5120, 6144), (17408, 5120), (5120, 17408)]


@pytest.mark.parametrize("case", QMV_CASES + [(mx.bfloat16, bits, 64, rows, N, K)
                                              for bits in (4, 8) for rows in (2, 4)
                                              for N, K in QMV_27B[-2:]], ids=str)
def test_cuda_qmv_rows_is_mlx_row_by_row(case):
    """One of the kernel's two forms gives each row MLX's one-row bits; the
    dispatch's self-check finds it and runs the kernel."""
    one_row = K.qmv_row_reference("cuda")
    errors = []
    for dq_fma in (True, False):
        try:
            check_qmv_rows("cuda", one_row, *case, dq_fma=dq_fma)
            break
        except AssertionError as e:
            errors.append(f"dq_fma={dq_fma}: {e}")
    else:
        raise AssertionError("; ".join(errors))
    dtype, bits, gs, rows, N, Kd = case
    x = mx.random.normal((1, rows, Kd)).astype(dtype)
    w, s, b = mx.quantize(mx.random.normal((N, Kd)).astype(dtype), group_size=gs, bits=bits)
    y = K.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
    assert K.selfcheck.paths()["qmv_rows"].startswith("cuda kernel"), K.selfcheck.paths()
    assert mx.array_equal(y, one_row(x[0], w, s, b, gs, bits, True)[None]).item()
