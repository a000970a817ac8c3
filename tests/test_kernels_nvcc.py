"""The CUDA twin of qmv_rows compiles for an H100 (sm_90a) as
`mx.fast.cuda_kernel` would build it, with no register spills, before any
GPU runs it. Skipped where nvcc is not installed.

The source is assembled the way MLX's custom_kernel.cpp assembles it: the
header at file scope, then the body inside `__global__ void ...` in
`mlx::core::cu`, template arguments as `constexpr` / `using` at its top.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from mlx_mtp.metal import launch
from util import slow

NVCC = shutil.which("nvcc") or next(
    (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc")

CTYPE = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}


def mlx_source(dtype: str, **tmpl) -> str:
    header, body = launch.split_source(launch.load_source("qmv_rows", "cuda"))
    t = CTYPE[dtype]
    consts = "\n".join(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = "
                       f"{str(v).lower() if isinstance(v, bool) else v};" for k, v in tmpl.items())
    return (f"#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"
            f"{launch.load_source('cuda_compat', 'cuda')}{header}\n"
            "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
            f"__global__ void custom_kernel_mtp_qmv_rows(const {t}* x, const uint32_t* w, "
            f"const {t}* scales, const {t}* biases, {t}* y) {{\n  using InT = {t};\n{consts}\n"
            f"{body}\n}}\n}} // namespace mlx::core::cu\n")


# (dtype, rows, N, K, group size, bits): 27B shapes and the odd ones
CASES = [("bf16", 4, 17408, 5120, 64, 4)] + [slow(c) for c in [("fp32", 2, 40, 520, 64, 4),
    ("bf16", 8, 5120, 17408, 64, 4), ("bf16", 2, 248320, 5120, 64, 4), ("bf16", 5, 12288, 5120, 32, 8),
    ("fp16", 3, 1000, 640, 128, 4), ("fp32", 6, 1000, 640, 64, 8)]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_qmv_rows_compiles_for_sm90_without_spills(case, tmp_path):
    dtype, rows, N, K, gs, bits = case
    E = 16 if dtype != "fp32" and bits <= 4 else 8
    cols = 4 if rows <= 2 else (2 if rows <= 4 else 1)
    for dq_fma in (True, False):
        src = tmp_path / "k.cu"
        src.write_text(mlx_source(dtype, M=rows, N=N, K=K, GS=gs, BITS=bits, E=E, COLS=cols,
                                  DQ_FMA=dq_fma))
        r = subprocess.run([NVCC, "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o",
                            str(tmp_path / "k.cubin"), str(src)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "0 bytes spill stores" in r.stderr, r.stderr[-1500:]
