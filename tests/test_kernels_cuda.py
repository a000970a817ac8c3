"""CUDA twins on a real MLX CUDA device (`pytest -k cuda`); skipped elsewhere.

The same checks as test_kernels_emu.py, with backend "cuda" and the default
device set to the GPU (the references then run on the GPU too)."""

import mlx.core as mx
import pytest

import mlx_mtp.metal as K
from kernel_checks import (
    CONV_CASES, DRAFT_CASES, GDN_CASES, check_commit, check_conv, check_draft, check_gdn,
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
