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
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

from . import reference

__all__ = ["commit", "conv_verify", "draft_project", "gdn_verify", "backend", "fused_default"]


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
        return reference.conv_verify_compiled(conv_state, qkv, weight)
    from . import launch

    return launch.conv_verify(conv_state, qkv, weight, backend=be)


def gdn_verify(q, k, v, a, b, A_log, dt_bias, state, *, backend: Optional[str] = None,
               fused: Optional[bool] = None):
    be = backend or globals()["backend"]()
    fast = _fast(fused)
    Dk = q.shape[-1]
    # Exact mode mirrors plain decoding, which uses mlx_lm's Metal kernel only
    # for Dk % 32 == 0 (its ops path otherwise, and always on CUDA).
    if be == "ref" or (not fast and (be.endswith("cuda") or Dk % 32 != 0)):
        return reference.gdn_verify_compiled(q, k, v, a, b, A_log, dt_bias, state)
    from . import launch

    return launch.gdn_verify(q, k, v, a, b, A_log, dt_bias, state, backend=be, fused=fast)


def commit(states, conv_inputs, consumed, conv_kernel, *, backend: Optional[str] = None):
    be = backend or globals()["backend"]()
    if be == "ref":
        return reference.commit(states, conv_inputs, consumed, conv_kernel)
    from . import launch

    return launch.commit(states, conv_inputs, consumed, conv_kernel, backend=be)


def draft_project(hidden, weight, scales=None, biases=None, *, group_size: int = 64,
                  bits: int = 0, vocab_ids=None, top_k: int = 1,
                  backend: Optional[str] = None):
    be = backend or globals()["backend"]()
    # kernel: float weights or mlx_lm affine quantization with bits dividing 32
    supported = bits in (0, 2, 4, 8) and (not bits or biases is not None)
    if be == "ref" or top_k > 32 or not supported:
        return reference.draft_project(hidden, weight, scales, biases, group_size=group_size,
                                       bits=bits, vocab_ids=vocab_ids, top_k=top_k)
    from . import launch

    return launch.draft_project(hidden, weight, scales, biases, group_size=group_size,
                                 bits=bits, vocab_ids=vocab_ids, top_k=top_k, backend=be)
