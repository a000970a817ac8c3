"""Verify / rollback / draft kernels: one Python API, dispatched by backend.

On the CPU backend the ops references in `reference.py` run (they are also the
oracle for every kernel test). Metal sources (`*.metal`) run through
`mx.fast.metal_kernel` on Apple GPUs, CUDA twins (`*.cu`) through
`mx.fast.cuda_kernel` on MLX's CUDA backend; `launch.py` launches both, and
`emu/` runs either on a Linux CPU for the tests. Set MLX_MTP_KERNELS=ref to
force the references (or =metal / =cuda / =emu-metal / =emu-cuda).

Exactness policy (greedy MTP must be token-identical to plain decoding):
by default only paths that compute bit for bit what plain decoding computes
run as kernels:
- gdn_verify on Metal: normalization and gates by mlx_lm's own ops, the
  recurrence in gdn_verify.metal, whose arithmetic and reduction tree are
  those of mlx_lm's Metal decode kernel. On CUDA, plain decoding runs
  mlx_lm's ops path, so the reference (the same ops) runs.
- conv_verify: the reference (mx.conv1d, as plain decoding).
- commit (a copy) and draft_project (drafts need no exactness): kernels.
`fused=True` or MLX_MTP_FAST_KERNELS=1 runs the fused kernels instead (conv
kernel; GDN with in-kernel normalization and gates; the CUDA GDN twin): one
launch each, equal to the references up to rounding (see the kernel files).

Before a kernel first runs in a process it checks itself against its
reference on a tiny input (`selfcheck.py`); one that fails to compile or
disagrees warns once and its reference runs instead. `describe()` says which
path each kernel took.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

from . import reference, selfcheck

__all__ = ["commit", "conv_verify", "draft_project", "gdn_verify", "backend", "fused_default",
           "describe"]


def backend() -> str:
    """The kernel backend the exported functions use right now."""
    forced = os.environ.get("MLX_MTP_KERNELS")
    if forced:
        return forced
    if mx.default_device() != mx.gpu:
        return "ref"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "ref"


def describe() -> str:
    """Which path each kernel took in this process, in one line."""
    paths = "; ".join(f"{k}: {p}" for k, p in selfcheck.paths().items())
    return f"Kernels (backend {backend()}): {paths}"


def _reference(kernel: str, be: str, why: str):
    selfcheck.took(kernel, "reference (" + ("the CPU runs the ops references" if be == "ref"
                                            else why) + ")")


def fused_default() -> bool:
    """Whether the fused (not bitwise-exact) kernels run by default."""
    return _fast(None)


def _fast(fused: Optional[bool]) -> bool:
    if fused is not None:
        return fused
    return os.environ.get("MLX_MTP_FAST_KERNELS", "0") not in ("", "0")


def conv_verify(conv_state, qkv, weight, *, backend: Optional[str] = None,
                fused: Optional[bool] = None):
    be = backend or globals()["backend"]()
    if be == "ref" or not _fast(fused):
        _reference("conv_verify", be, "exact mode: mx.conv1d, as plain decoding")
        return reference.conv_verify_compiled(conv_state, qkv, weight)
    from . import launch

    if not selfcheck.verified("conv_verify", be, selfcheck.variant(
            qkv.dtype, weight.dtype, weight.shape[1]), selfcheck.conv_check(
            launch, be, qkv.dtype, weight.dtype, weight.shape[1])):
        return reference.conv_verify_compiled(conv_state, qkv, weight)
    return launch.conv_verify(conv_state, qkv, weight, backend=be)


def gdn_verify(q, k, v, a, b, A_log, dt_bias, state, *, backend: Optional[str] = None,
               fused: Optional[bool] = None):
    be = backend or globals()["backend"]()
    fast = _fast(fused)
    Dk = q.shape[-1]
    # Exact mode mirrors plain decoding, which uses mlx_lm's Metal kernel only
    # for Dk % 32 == 0 (its ops path otherwise, and always on CUDA).
    if be == "ref" or (not fast and (be.endswith("cuda") or Dk % 32 != 0)):
        _reference("gdn_verify", be, "exact mode: plain decoding's ops on this backend and size")
        return reference.gdn_verify_compiled(q, k, v, a, b, A_log, dt_bias, state)
    from . import launch

    Dv, ratio = v.shape[-1], v.shape[2] // max(1, q.shape[2])
    if not selfcheck.verified("gdn_verify", be, selfcheck.variant(fast, q.dtype, Dk, Dv, ratio),
                              selfcheck.gdn_check(launch, be, fast, q.dtype, Dk, Dv, ratio)):
        return reference.gdn_verify_compiled(q, k, v, a, b, A_log, dt_bias, state)
    return launch.gdn_verify(q, k, v, a, b, A_log, dt_bias, state, backend=be, fused=fast)


def commit(states, conv_inputs, consumed, conv_kernel, *, backend: Optional[str] = None):
    be = backend or globals()["backend"]()
    if be == "ref" or not states:
        _reference("commit", be, "no GDN layers")
        return reference.commit(states, conv_inputs, consumed, conv_kernel)
    from . import launch

    dtype = conv_inputs[0].dtype
    if not selfcheck.verified("commit", be, selfcheck.variant(dtype, conv_kernel),
                              selfcheck.commit_check(launch, be, dtype, conv_kernel)):
        return reference.commit(states, conv_inputs, consumed, conv_kernel)
    return launch.commit(states, conv_inputs, consumed, conv_kernel, backend=be)


def draft_project(hidden, weight, scales=None, biases=None, *, group_size: int = 64,
                  bits: int = 0, vocab_ids=None, top_k: int = 1,
                  backend: Optional[str] = None):
    be = backend or globals()["backend"]()
    # kernel: float weights or mlx_lm affine quantization with bits dividing 32
    supported = bits in (0, 2, 4, 8) and (not bits or biases is not None)
    if be == "ref" or top_k > 32 or not supported:
        _reference("draft_project", be, f"top_k {top_k} over 32" if top_k > 32 else
                   f"a weight of {bits} bits has no kernel")
        return reference.draft_project(hidden, weight, scales, biases, group_size=group_size,
                                       bits=bits, vocab_ids=vocab_ids, top_k=top_k)
    from . import launch

    wdtype = scales.dtype if bits else weight.dtype
    if not selfcheck.verified("draft_project", be, selfcheck.variant(
            hidden.dtype, wdtype, bits, group_size, vocab_ids is not None, top_k),
            selfcheck.draft_check(launch, be, hidden.dtype, wdtype, bits, group_size,
                                  vocab_ids is not None, top_k)):
        return reference.draft_project(hidden, weight, scales, biases, group_size=group_size,
                                       bits=bits, vocab_ids=vocab_ids, top_k=top_k)
    return launch.draft_project(hidden, weight, scales, biases, group_size=group_size,
                                 bits=bits, vocab_ids=vocab_ids, top_k=top_k, backend=be)
