"""Run `mx.fast.metal_kernel` / `mx.fast.cuda_kernel` bodies on a Linux CPU.

`metal_kernel(...)` and `cuda_kernel(...)` take the same arguments as MLX's
and return a callable with MLX's call signature. The body is wrapped in the
function MLX would generate (inputs as `const device T*`, template arguments
as `constexpr` / `using`, `*_shape` / `*_strides` / `*_ndim` where the source
names them), compiled with g++ into a shared object cached under
$MLX_MTP_EMU_CACHE (default: <tmp>/mlx_mtp_emu) by source hash, and run through
ctypes on numpy copies of the inputs. Outputs are poisoned (0xFF bytes: NaN
for floating types, -1 for integers) unless `init_value` is given.

See emu_runtime.h for the execution model and ../README.md for what it does
not model.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

try:
    import mlx.core as mx
except ImportError:  # pragma: no cover
    mx = None

_HERE = Path(__file__).resolve().parent
_RUNTIME = _HERE / "emu_runtime.h"
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-w"]

# dtype name -> (numpy storage dtype, Metal type, CUDA type)
_TYPES = {
    "float32": (np.float32, "float", "float"),
    "float16": (np.float16, "float16_t", "__half"),
    "bfloat16": (np.uint16, "bfloat16_t", "__nv_bfloat16"),
    "int32": (np.int32, "int32_t", "int32_t"),
    "uint32": (np.uint32, "uint32_t", "uint32_t"),
    "int64": (np.int64, "int64_t", "int64_t"),
    "uint64": (np.uint64, "uint64_t", "uint64_t"),
    "int16": (np.int16, "int16_t", "int16_t"),
    "uint16": (np.uint16, "uint16_t", "uint16_t"),
    "int8": (np.int8, "int8_t", "int8_t"),
    "uint8": (np.uint8, "uint8_t", "uint8_t"),
    "bool": (np.bool_, "bool", "bool"),
}


def _dtype_name(dt) -> str:
    if isinstance(dt, str):
        return dt
    if mx is not None and isinstance(dt, mx.Dtype):
        return str(dt).split(".")[-1]
    return np.dtype(dt).name


_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def guarded_empty(shape, dtype) -> np.ndarray:
    """An array whose last byte is followed by an inaccessible page (and whose
    mapping starts with one), so a kernel reading or writing past its end
    faults instead of silently touching other memory."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    data = -(-max(nbytes, 1) // _PAGE) * _PAGE
    mm = mmap.mmap(-1, data + 2 * _PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    for off in (0, _PAGE + data):
        if _libc.mprotect(base + off, _PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
    start = _PAGE + data - nbytes
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=start).view(dtype).reshape(shape)


def _guarded_copy(arr: np.ndarray) -> np.ndarray:
    out = guarded_empty(arr.shape, arr.dtype)
    out[...] = arr
    return out


class _Buf:
    """A host buffer plus the dtype name MLX would see."""

    def __init__(self, arr: np.ndarray, dtype: str):
        self.arr = arr
        self.dtype = dtype


def _to_buf(x) -> _Buf:
    if mx is not None and isinstance(x, mx.array):
        name = _dtype_name(x.dtype)
        if name == "bfloat16":
            arr = np.array(x.view(mx.uint16))
        else:
            arr = np.array(x)
        return _Buf(_guarded_copy(arr), name)
    if isinstance(x, (bool, np.bool_)):
        return _Buf(np.array(x, dtype=np.bool_), "bool")
    if isinstance(x, (int, np.integer)):
        return _Buf(np.array(x, dtype=np.int32), "int32")
    if isinstance(x, (float, np.floating)) and not isinstance(x, np.ndarray):
        return _Buf(np.array(x, dtype=np.float32), "float32")
    arr = np.asarray(x)
    return _Buf(_guarded_copy(arr), _dtype_name(arr.dtype))


_TG_DECL = re.compile(
    r"\b(?:threadgroup|__shared__)\s+((?:const\s+)?[A-Za-z_][\w:<>, ]*?)\s+([A-Za-z_]\w*)\s*((?:\[[^\]]+\])+)\s*;"
)


def _rewrite_shared(src: str, counter: List[int]) -> str:
    def sub(m):
        counter[0] += 1
        typ, name, dims = m.group(1), m.group(2), m.group(3)
        return f"auto& {name} = ::emu::tg_mem<{typ}{dims}, {counter[0]}>();"

    return _TG_DECL.sub(sub, src)


_METAL_PRELUDE = """
using namespace metal;
#define device
#define constant
#define thread
#define threadgroup
#define kernel
#define METAL_FUNC inline
"""

_CUDA_PRELUDE = """
using namespace emu_cuda;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __grid_constant__
#define __launch_bounds__(...)
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
"""

_COMMON_PRELUDE = """
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#define FLT_MAX 3.402823466e+38F
"""


class EmuKernel:
    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        dialect: str = "metal",
        **_ignored,
    ):
        if atomic_outputs:
            raise NotImplementedError("atomic outputs are not emulated")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.dialect = dialect
        self._libs: Dict[str, Any] = {}

    # -- source generation -------------------------------------------------
    def _cpp(self, ins: List[_Buf], out_dtypes: List[str], template) -> str:
        cuda = self.dialect == "cuda"
        tcol = 2 if cuda else 1
        lines = ['#include "emu_runtime.h"', _COMMON_PRELUDE, _CUDA_PRELUDE if cuda else _METAL_PRELUDE]
        counter = [0]
        lines.append(_rewrite_shared(self.header, counter))
        lines.append("static void __emu_body(void** __b, const emu::ThreadInfo& __ti) {")
        for tname, tval in template:
            if isinstance(tval, bool):
                lines.append(f"  constexpr bool {tname} = {'true' if tval else 'false'};")
            elif isinstance(tval, int):
                lines.append(f"  constexpr int {tname} = {tval};")
            else:
                lines.append(f"  using {tname} = {_TYPES[_dtype_name(tval)][tcol]};")
        slot = 0
        for nm, b in zip(self.input_names, ins):
            ctype = _TYPES[b.dtype][tcol]
            if b.arr.ndim == 0 and not cuda:
                lines.append(f"  const {ctype}& {nm} = *(const {ctype}*)__b[{slot}];")
            else:
                lines.append(f"  const {ctype}* {nm} = (const {ctype}*)__b[{slot}];")
            slot += 1
            if b.arr.ndim > 0:
                if f"{nm}_shape" in self.source:
                    lines.append(f"  const int* {nm}_shape = (const int*)__b[{slot}];")
                    slot += 1
                if f"{nm}_strides" in self.source:
                    lines.append(f"  const int64_t* {nm}_strides = (const int64_t*)__b[{slot}];")
                    slot += 1
                if f"{nm}_ndim" in self.source:
                    lines.append(f"  const int {nm}_ndim = *(const int*)__b[{slot}];")
                    slot += 1
        for nm, dt in zip(self.output_names, out_dtypes):
            ctype = _TYPES[dt][tcol]
            lines.append(f"  {ctype}* {nm} = ({ctype}*)__b[{slot}];")
            slot += 1
        if cuda:
            lines += [
                "  const dim3 threadIdx = __ti.tpitg, blockIdx = __ti.tgpig;",
                "  const dim3 blockDim = __ti.tptg, gridDim = __ti.tgpg;",
                "  const int warpSize = 32;",
            ]
        else:
            lines += [
                "  const uint3 thread_position_in_grid = __ti.tpig;",
                "  const uint3 thread_position_in_threadgroup = __ti.tpitg;",
                "  const uint3 threadgroup_position_in_grid = __ti.tgpig;",
                "  const uint3 threads_per_threadgroup = __ti.tptg;",
                "  const uint3 threads_per_grid = __ti.tpg;",
                "  const uint3 threadgroups_per_grid = __ti.tgpg;",
                "  const uint thread_index_in_threadgroup = __ti.lin;",
                "  const uint thread_index_in_simdgroup = __ti.lane;",
                "  const uint simdgroup_index_in_threadgroup = __ti.sg;",
                "  const uint simdgroups_per_threadgroup = __ti.nsg;",
                "  const uint threads_per_simdgroup = 32;",
            ]
        lines.append("  {")
        lines.append("#line 1")
        lines.append(_rewrite_shared(self.source, counter))
        lines.append("  }")
        lines.append("}")
        lines.append(
            'extern "C" int emu_launch(void** b, const int64_t* g, const int64_t* t, char* e, int n)'
            f" {{ return emu::launch(__emu_body, b, g, t, {int(cuda)}, e, n); }}"
        )
        return "\n".join(lines) + "\n"

    def _lib(self, cpp: str):
        runtime = _RUNTIME.read_text()
        key = hashlib.sha256(
            (cpp + runtime + CXX + " ".join(CXXFLAGS)).encode()
        ).hexdigest()[:24]
        if key in self._libs:
            return self._libs[key]
        cache = Path(os.environ.get("MLX_MTP_EMU_CACHE", Path(tempfile.gettempdir()) / "mlx_mtp_emu"))
        cache.mkdir(parents=True, exist_ok=True)
        so = cache / f"{self.name}_{key}.so"
        if not so.exists():
            src = cache / f"{self.name}_{key}.cpp"
            src.write_text(cpp)
            tmp = cache / f".{so.name}.{os.getpid()}.tmp"
            r = subprocess.run(
                [CXX, *CXXFLAGS, f"-I{_HERE}", "-o", str(tmp), str(src)],
                capture_output=True, text=True,
            )
            if r.returncode != 0:
                raise RuntimeError(f"emulated kernel {self.name} failed to compile:\n{r.stderr[-6000:]}")
            os.replace(tmp, so)
        lib = ctypes.CDLL(str(so))
        lib.emu_launch.restype = ctypes.c_int
        self._libs[key] = lib
        return lib

    # -- call ----------------------------------------------------------------
    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[Any],
        grid: Tuple[int, int, int],
        threadgroup: Tuple[int, int, int],
        template: Sequence[Tuple[str, Any]] = (),
        init_value: Optional[float] = None,
        verbose: bool = False,
        stream=None,
        return_numpy: bool = False,
    ):
        if len(inputs) != len(self.input_names):
            raise ValueError(f"{self.name}: expected {len(self.input_names)} inputs, got {len(inputs)}")
        if self.dialect == "metal":
            # MLX dispatches Metal threadgroups of min(threadgroup, grid) per axis
            threadgroup = tuple(min(int(t), int(g)) for t, g in zip(threadgroup, grid))
        ins = [_to_buf(x) for x in inputs]
        out_dt = [_dtype_name(d) for d in output_dtypes]
        cpp = self._cpp(ins, out_dt, list(template))
        if verbose:
            print(cpp)
        lib = self._lib(cpp)
        keep = []
        ptrs = []
        for nm, b in zip(self.input_names, ins):
            keep.append(b.arr)
            ptrs.append(b.arr.ctypes.data)
            if b.arr.ndim > 0:
                if f"{nm}_shape" in self.source:
                    a = np.array(b.arr.shape, dtype=np.int32)
                    keep.append(a); ptrs.append(a.ctypes.data)
                if f"{nm}_strides" in self.source:
                    a = np.array([s // b.arr.itemsize for s in b.arr.strides], dtype=np.int64)
                    keep.append(a); ptrs.append(a.ctypes.data)
                if f"{nm}_ndim" in self.source:
                    a = np.array(b.arr.ndim, dtype=np.int32)
                    keep.append(a); ptrs.append(a.ctypes.data)
        outs = []
        for shape, dt in zip(output_shapes, out_dt):
            npdt = _TYPES[dt][0]
            o = guarded_empty(tuple(shape), npdt)
            if init_value is None:
                o.view(np.uint8).fill(0xFF)
            elif dt == "bfloat16":
                o[...] = np.array([init_value], np.float32).view(np.uint32)[0] >> 16
            else:
                o[...] = init_value
            outs.append(o)
            ptrs.append(o.ctypes.data)
        arr = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        g = (ctypes.c_int64 * 3)(*[int(x) for x in grid])
        t = (ctypes.c_int64 * 3)(*[int(x) for x in threadgroup])
        err = ctypes.create_string_buffer(1024)
        rc = lib.emu_launch(arr, g, t, err, 1024)
        if rc != 0:
            msg = err.value.decode()
            m = re.search(r"address 0x([0-9a-f]+)", msg)
            if m:
                addr = int(m.group(1), 16)
                names = self.input_names + self.output_names
                arrays = [b.arr for b in ins] + outs
                for nm, a in zip(names, arrays):
                    lo = a.ctypes.data
                    hi = lo + a.nbytes
                    if lo - _PAGE <= addr < hi + _PAGE and not lo <= addr < hi:
                        msg += f" ({'past the end of' if addr >= hi else 'before'} `{nm}`, byte offset {addr - lo} of {a.nbytes})"
            raise RuntimeError(f"emulated kernel {self.name}: {msg}")
        if return_numpy or mx is None:
            return outs
        res = []
        for o, dt in zip(outs, out_dt):
            a = mx.array(o)
            if dt == "bfloat16":
                a = a.view(mx.bfloat16)
            res.append(a)
        return res


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
    """Drop-in for mx.fast.metal_kernel that runs on the CPU emulator."""
    return EmuKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                     atomic_outputs, dialect="metal")


def cuda_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                shared_memory=0):
    """Drop-in for mx.fast.cuda_kernel that runs on the CPU emulator."""
    if shared_memory:
        raise NotImplementedError("dynamic shared memory is not emulated")
    return EmuKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                     dialect="cuda")


__all__ = ["EmuKernel", "metal_kernel", "cuda_kernel"]
