"""A verify reads each quantized weight once: qmv_rows (metal/qmv_rows.cu,
.metal) in the emulator.

Each row of qmv_rows must be bit for bit what MLX's one-row kernel gives that
row alone, on each backend, so a verify row equals the decode step's. Here
both twins run in the emulator against NumPy models of MLX's one-row kernels
(metal/emu/qmv.py, written from MLX's sources), and a simulated CUDA GPU
decodes greedily with MTP token for token as plain decoding. On a real GPU the
self-check holds the kernel to MLX's own op (tests/test_kernels_cuda.py).
"""

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import mlx_mtp
from mlx_mtp import metal
from mlx_mtp.metal import launch, selfcheck
from mlx_mtp.metal.emu import qmv
from mlx_mtp.quantized import SharedReadQuantizedLinear, share_weight_reads
from kernel_checks import QMV_CASES, check_qmv_rows, qmv_inputs

CUDA, METAL = "emu-cuda", "emu-metal"


@pytest.fixture(autouse=True)
def _fresh_checks():
    selfcheck.reset()
    yield
    selfcheck.reset()


@pytest.mark.parametrize("case", QMV_CASES, ids=str)
def test_cuda_twin_gives_each_row_the_one_row_kernels_bits(case):
    for dq_fma in (True, False):
        check_qmv_rows(CUDA, qmv.cuda_qmv, *case, dq_fma=dq_fma)


@pytest.mark.parametrize("case", [c for c in QMV_CASES if c[4] % 8 == 0 and c[5] % 512 == 0],
                         ids=str)
def test_metal_twin_gives_each_row_the_one_row_kernels_bits(case):
    check_qmv_rows(METAL, metal.qmv_row_reference(METAL), *case)


def test_the_two_dequantizations_differ():
    """Rounding `q * scale + bias` once or twice changes some bits, so the
    self-check tells MLX's form apart."""
    x, w, s, b = qmv_inputs(mx.bfloat16, 4, 64, 3, 16, 512)
    assert not mx.array_equal(qmv.cuda_qmv(x, w, s, b, 64, 4, dq_fma=True),
                              qmv.cuda_qmv(x, w, s, b, 64, 4, dq_fma=False)).item()


_FMA = "sums[c][m][j] = __hfma2(xv.v[j], wdq[j], sums[c][m][j]);"
_MUL_ADD = "sums[c][m][j] = __hadd2_rn(__hmul2_rn(xv.v[j], wdq[j]), sums[c][m][j]);"


@pytest.mark.parametrize("dial,dtype,old,new", [
    ("cuda", mx.float32,
     "s = s + __shfl_xor_sync(0xffffffffu, s, 16);\n      s = s + __shfl_xor_sync(0xffffffffu, s, 8);",
     "s = s + __shfl_xor_sync(0xffffffffu, s, 8);\n      s = s + __shfl_xor_sync(0xffffffffu, s, 16);"),
    ("cuda", mx.bfloat16, _FMA, _MUL_ADD),
    ("metal", mx.float32, "sum += x[i] + x[i + 1] + x[i + 2] + x[i + 3];",
     "sum += x[i] + (x[i + 1] + (x[i + 2] + x[i + 3]));"),
    ("metal", mx.bfloat16, "xt[i + 1] = x[i + 1] / 16.0f;", "xt[i + 1] = x[i + 1] * 0.0625f;"),
], ids=["cuda-reduction-order", "cuda-rounded-accumulation", "metal-sum-order",
        "metal-no-change"])
def test_a_change_of_rounding_is_caught(dial, dtype, old, new):
    """A change that rounds differently (an order equal in exact arithmetic,
    a product rounded before its add) fails the bitwise comparison; one that
    computes the same bits (x / 16 is x * 0.0625) passes."""
    be = CUDA if dial == "cuda" else METAL
    ref = metal.qmv_row_reference(be)
    src = launch.load_source("qmv_rows", dial)
    assert old in src
    with launch.override_source("qmv_rows", dial, src.replace(old, new, 1)):
        if old.endswith("/ 16.0f;"):
            check_qmv_rows(be, ref, dtype, 4, 64, 4, 16, 1024)
        else:
            with pytest.raises(AssertionError, match="differ"):
                check_qmv_rows(be, ref, dtype, 4, 64, 4, 16, 1024)


def test_dispatch(monkeypatch):
    """1 row, more than 8, the CPU and shapes without a kernel run MLX's op
    (the same array ops: bitwise); 2..8 rows on a GPU backend run the kernel."""
    x, w, s, b = qmv_inputs(mx.bfloat16, 4, 64, 8, 24, 512)
    x16 = mx.concatenate([x, x])
    calls = []
    real = launch.qmv_rows
    monkeypatch.setattr(launch, "qmv_rows", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))

    def run(rows, be):
        return metal.quantized_matmul(x16[None, :rows], w, s, b, group_size=64, bits=4, backend=be)

    for rows, be in [(1, CUDA), (9, CUDA), (3, "ref")]:
        want = mx.quantized_matmul(x16[None, :rows], w, s, b, transpose=True, group_size=64, bits=4)
        assert mx.array_equal(run(rows, be), want).item()
    assert calls == []
    run(3, CUDA)
    run(8, METAL)
    # the self-checks' own 2-D calls, then these
    assert [c for c in calls if len(c) == 3] == [(1, 3, 512), (1, 8, 512)]
    assert "emu-metal kernel (self-checked)" == selfcheck.paths()["qmv_rows"]


def test_a_kernel_that_disagrees_warns_once_and_mlx_runs(caplog, monkeypatch):
    """Both CUDA forms wrong (a reference that rounds differently from either):
    one warning naming both, and MLX's op from then on."""
    x, w, s, b = qmv_inputs(mx.bfloat16, 4, 64, 3, 16, 512)
    monkeypatch.setattr(metal, "qmv_row_reference",
                        lambda be: lambda x, w, s, b, gs, bits, dq_fma: qmv.cuda_qmv(
                            x.astype(mx.float32), w, s.astype(mx.float32), b.astype(mx.float32),
                            gs, bits).astype(x.dtype))
    calls = []
    real = launch.qmv_rows
    monkeypatch.setattr(launch, "qmv_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        for _ in range(2):
            y = metal.quantized_matmul(x, w, s, b, group_size=64, bits=4, backend=CUDA)
    warnings = [r.message for r in caplog.records if "qmv_rows" in r.message]
    assert len(warnings) == 1 and "fused dequantization" in warnings[0] \
        and "rounded twice" in warnings[0]
    assert len(calls) == 2  # the check's two forms, never a real call
    assert mx.array_equal(y, mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64,
                                                 bits=4)).item()
    assert selfcheck.paths()["qmv_rows"].startswith("reference (the emu-cuda kernel failed")


def test_the_self_check_keeps_the_form_mlx_computes(monkeypatch):
    """A backend whose one-row kernel rounds the dequantization twice gets
    that form of the kernel."""
    x, w, s, b = qmv_inputs(mx.bfloat16, 4, 64, 3, 16, 512)
    monkeypatch.setattr(metal, "qmv_row_reference",
                        lambda be: lambda x, w, s, b, gs, bits, dq_fma: qmv.cuda_qmv(
                            x, w, s, b, gs, bits, dq_fma=False))
    y = metal.quantized_matmul(x, w, s, b, group_size=64, bits=4, backend=CUDA)
    assert "rounded twice" in selfcheck.paths()["qmv_rows"]
    assert mx.array_equal(y, qmv.cuda_qmv(x, w, s, b, 64, 4, dq_fma=False)).item()


def test_share_weight_reads_keeps_the_layers(q4_ckpt, monkeypatch):
    """Every quantized layer becomes the subclass with the same arrays; on the
    CPU the model's output is unchanged, bit for bit."""
    model, tok = mlx_mtp.load(q4_ckpt, quiet=True)
    assert not any(isinstance(m, SharedReadQuantizedLinear) for _, m in model.named_modules())
    ids = mx.array([tok.encode("def f(x):\n    return x")])
    before = model(ids)
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    n = sum(type(m) in quantized for _, m in model.named_modules())
    weights = {k: v for k, v in tree_flatten(model.parameters())}
    assert share_weight_reads(model) == n > 0
    assert all(type(m) not in quantized for _, m in model.named_modules())
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == weights.keys() and all(after[k] is weights[k] for k in weights)
    assert mx.array_equal(model(ids), before).item()
    monkeypatch.setenv("MLX_MTP_KERNELS", CUDA)
    loaded, _ = mlx_mtp.load(q4_ckpt, quiet=True)  # a GPU backend: swapped at load
    assert sum(isinstance(m, quantized) and type(m) not in quantized
               for _, m in loaded.named_modules()) == n


# ------------------------------------------------------------ a simulated CUDA GPU
def _simulated_cuda_qmm(x, w, scales=None, biases=None, transpose=True, group_size=64, bits=4,
                        mode="affine", **kw):
    """mx.quantized_matmul as MLX's CUDA backend computes a row at a time (qmv),
    for plain decoding, prefill and every one-row product."""
    K = x.shape[-1]
    y = qmv.cuda_qmv(x.reshape(-1, K), w, scales, biases, group_size, bits)
    return y.reshape(*x.shape[:-1], w.shape[0])


@pytest.fixture(scope="module")
def bf16_q4(tmp_path_factory, dense_bf16_ckpt):
    from mlx_mtp.convert import convert

    out = tmp_path_factory.mktemp("bf16q4") / "q4"
    return convert(dense_bf16_ckpt, out, quantize=True, q_bits=4)["output"]


def test_simulated_cuda_mtp_is_token_identical(bf16_q4, monkeypatch):
    """Plain decoding and MTP both compute one-row products as MLX's CUDA qmv
    does; MTP's verify runs qmv_rows in the emulator. Greedy MTP must give
    plain decoding's tokens (depth 3, drafts partly accepted), with the
    kernel in every verify."""
    import mlx_lm
    from mlx_lm.generate import generate_step

    from mlx_mtp.decode import generate_tokens
    from mlx_mtp.testing.drafters import OracleDrafter

    monkeypatch.setattr(mx, "quantized_matmul", _simulated_cuda_qmm)
    monkeypatch.setenv("MLX_MTP_KERNELS", CUDA)
    rows = []
    real = launch.qmv_rows
    monkeypatch.setattr(launch, "qmv_rows", lambda x, *a, **k: rows.append(x.size // x.shape[-1])
                        or real(x, *a, **k))
    model, tok = mlx_mtp.load(bf16_q4, quiet=True)
    ref_model, _ = mlx_lm.load(str(bf16_q4))
    prompt = mx.array(tok.encode("def f(x):\n    return"))
    n = 10  # every product runs in NumPy: about a second a token here
    ref = [t for t, _ in generate_step(prompt, ref_model, max_tokens=n)]
    V = model.vocab_size
    for k, rate in [(3, 0.6)]:
        rows.clear()
        got = [t for t, _, _ in generate_tokens(prompt, model, max_tokens=n, draft_tokens=k,
                                                drafter=OracleDrafter(ref, rate, V, seed=k))]
        assert got == ref, f"depth {k}"
        assert k + 1 in rows, f"depth {k}: no verify of {k + 1} rows ran the kernel"
    assert selfcheck.paths()["qmv_rows"] == "emu-cuda kernel (self-checked, fused dequantization)"
