"""Verify / rollback / draft kernels: one Python API, dispatched by backend.

On the CPU backend the ops references in `reference.py` run (they are also the
oracle for every kernel test). Metal sources (`*.metal`) run through
`mx.fast.metal_kernel` on Apple GPUs, CUDA twins through `mx.fast.cuda_kernel`.
"""

from .reference import commit, conv_verify, draft_project, gdn_verify

__all__ = ["commit", "conv_verify", "draft_project", "gdn_verify"]
