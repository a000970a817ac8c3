"""Verify / rollback / draft kernels: one Python API, dispatched by backend,
and the ops references (`*_ref`, below). On the CPU backend the references
run; they are also the oracle for every kernel test, and they reuse mlx_lm's
own recurrence so a verified position is bit-identical to what plain
decoding computes for the same token. Metal sources (`*.metal`) run through
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
  A verify keeps a tape (`gdn_verify_taped`: what each position's update
  consumed) and the commit replays each row's accepted prefix from it
  (`gdn_replay`) on the verify's own path: the kernel's replay mode after
  the kernel, the reference's steps after the reference.
- conv_verify: the reference (mx.conv1d, as plain decoding).
- commit (a copy) and draft_project (drafts need no exactness): kernels.
- quantized_matmul of 2..8 rows (a verify's k+1 tokens): qmv_rows, which
  reads each packed weight once and gives every row the bits MLX's one-row
  kernel gives it alone; its self-check demands that bit for bit.
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
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

from .. import params
from . import selfcheck

__all__ = ["commit", "conv_verify", "draft_project", "gdn_verify", "gdn_verify_taped", "gdn_replay",
           "GdnTape", "quantized_matmul", "backend", "fused_default", "describe"]


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
    selfcheck.took(kernel, "reference (" + (
        "the CPU runs the ops references" if be == "ref" else why) + ")")


def fused_default() -> bool:
    """Whether the fused (not bitwise-exact) kernels run by default."""
    return _fast(None)


def _fast(fused: Optional[bool]) -> bool:
    if fused is not None:
        return fused
    return params.env_flag("MLX_MTP_FAST_KERNELS")


def conv_verify(conv_state, qkv, weight, *, backend: Optional[str] = None,
                fused: Optional[bool] = None):
    be = backend or globals()["backend"]()
    if be == "ref" or not _fast(fused):
        _reference("conv_verify", be, "exact mode: mx.conv1d, as plain decoding")
        return conv_verify_ref_compiled(conv_state, qkv, weight)
    from . import launch

    if not selfcheck.verified("conv_verify", be, selfcheck.variant(
            qkv.dtype, weight.dtype, weight.shape[1]), selfcheck.conv_check(
            launch, conv_verify_ref, be, qkv.dtype, weight.dtype, weight.shape[1])):
        return conv_verify_ref_compiled(conv_state, qkv, weight)
    return launch.conv_verify(conv_state, qkv, weight, backend=be)


def _gdn_kernel(be: str, fast: bool, dtype, Dk: int, Dv: int, ratio: int) -> bool:
    """Whether a GDN verify (and a tape's replay) runs gdn_verify's kernel on
    `be`, else the ops reference. The replay asks again with the verify's
    arguments and gets the verify's answer (the self-check is cached), so a
    tape is always replayed by the arithmetic that wrote it."""
    # Exact mode mirrors plain decoding, which uses mlx_lm's Metal kernel only
    # for Dk % 32 == 0 (its ops path otherwise, and always on CUDA).
    if be == "ref" or (not fast and (be.endswith("cuda") or Dk % 32 != 0)):
        _reference("gdn_verify", be, "exact mode: plain decoding's ops on this backend and size")
        return False
    from . import launch

    return selfcheck.verified("gdn_verify", be, selfcheck.variant(fast, dtype, Dk, Dv, ratio),
                              selfcheck.gdn_check(launch, gdn_verify_ref, be, fast, dtype, Dk, Dv,
                                                  ratio))


def gdn_verify(q, k, v, a, b, A_log, dt_bias, state, *, backend: Optional[str] = None,
               fused: Optional[bool] = None):
    """The verify capturing every position's state: (y, states [B, T, Hv, Dv, Dk])."""
    be = backend or globals()["backend"]()
    fast = _fast(fused)
    if not _gdn_kernel(be, fast, q.dtype, q.shape[-1], v.shape[-1], v.shape[2] // max(1, q.shape[2])):
        return gdn_verify_ref_compiled(q, k, v, a, b, A_log, dt_bias, state)
    from . import launch

    return launch.gdn_verify(q, k, v, a, b, A_log, dt_bias, state, backend=be, fused=fast)


@dataclass
class GdnTape:
    """What a GDN layer's verify keeps to roll back without capturing every
    state: the state before the cycle (the cache's own array, no new bytes)
    and what each position's update consumed, exactly as the recurrence read
    it: k (normalized; raw conv output on the fused kernel), v, the gates g
    and beta (raw a and b on the fused kernel, which computes them, hence
    A_log and dt_bias: the layer's parameters, no new bytes). `gdn_replay`
    runs the accepted prefix's updates again, on the verify's path."""

    state: mx.array  # [B, Hv, Dv, Dk] fp32
    k: mx.array  # [B, T, Hk, Dk]
    v: mx.array  # [B, T, Hv, Dv]
    g: mx.array  # [B, T, Hv]
    beta: mx.array  # [B, T, Hv]
    A_log: mx.array  # [Hv]
    dt_bias: mx.array  # [Hv]

    def tree(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_tree(cls, tree: dict) -> "GdnTape":
        return cls(**tree)

    @property
    def nbytes(self) -> int:
        """Bytes kept for the rollback: the positions' entries (the state and
        the parameters are held anyway)."""
        return self.k.nbytes + self.v.nbytes + self.g.nbytes + self.beta.nbytes


def gdn_verify_taped(q, k, v, a, b, A_log, dt_bias, state, *, backend: Optional[str] = None,
                     fused: Optional[bool] = None) -> Tuple[mx.array, GdnTape]:
    """The verify keeping a tape instead of the states: (y, GdnTape). y and
    the replayed states are bit for bit `gdn_verify`'s on the same path."""
    be = backend or globals()["backend"]()
    fast = _fast(fused)
    if not _gdn_kernel(be, fast, q.dtype, q.shape[-1], v.shape[-1], v.shape[2] // max(1, q.shape[2])):
        y, tape = gdn_verify_taped_ref_compiled(q, k, v, a, b, A_log, dt_bias, state)
        return y, GdnTape(**tape)
    from . import launch

    y, tape = launch.gdn_verify(q, k, v, a, b, A_log, dt_bias, state, backend=be, fused=fast,
                                tape=True)
    return y, GdnTape(**tape)


def gdn_replay(tape: GdnTape, consumed: mx.array, *, backend: Optional[str] = None,
               fused: Optional[bool] = None) -> mx.array:
    """The state after the first consumed[b] positions (1..T, a device array
    [B]: no host sync) of each row b, replayed from the tape's state before
    the cycle on the path its verify took: [B, Hv, Dv, Dk] fp32."""
    be = backend or globals()["backend"]()
    fast = _fast(fused)
    n = consumed.astype(mx.int32).reshape(-1)
    n = mx.broadcast_to(n, (tape.k.shape[0],))
    Dk, Dv = tape.k.shape[-1], tape.v.shape[-1]
    if not _gdn_kernel(be, fast, tape.k.dtype, Dk, Dv, tape.v.shape[2] // max(1, tape.k.shape[2])):
        return gdn_replay_ref_compiled(tape.state, tape.k, tape.v, tape.g, tape.beta, n)
    from . import launch

    return launch.gdn_replay(tape, n, backend=be, fused=fast)


def commit(states, conv_inputs, consumed, conv_kernel, *, backend: Optional[str] = None):
    be = backend or globals()["backend"]()
    if be == "ref" or not states:
        _reference("commit", be, "no GDN layers")
        return commit_ref(states, conv_inputs, consumed, conv_kernel)
    from . import launch

    dtype = conv_inputs[0].dtype
    if not selfcheck.verified("commit", be, selfcheck.variant(dtype, conv_kernel),
                              selfcheck.commit_check(launch, commit_ref, be, dtype, conv_kernel)):
        return commit_ref(states, conv_inputs, consumed, conv_kernel)
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
        return draft_project_ref(hidden, weight, scales, biases, group_size=group_size,
                                       bits=bits, vocab_ids=vocab_ids, top_k=top_k)
    from . import launch

    wdtype = scales.dtype if bits else weight.dtype
    if not selfcheck.verified("draft_project", be, selfcheck.variant(
            hidden.dtype, wdtype, bits, group_size, vocab_ids is not None, top_k),
            selfcheck.draft_check(launch, draft_project_ref, be, hidden.dtype, wdtype, bits, group_size,
                                  vocab_ids is not None, top_k)):
        return draft_project_ref(hidden, weight, scales, biases, group_size=group_size,
                                       bits=bits, vocab_ids=vocab_ids, top_k=top_k)
    return launch.draft_project(hidden, weight, scales, biases, group_size=group_size,
                                 bits=bits, vocab_ids=vocab_ids, top_k=top_k, backend=be)


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int, mode: str = "affine",
                     backend: Optional[str] = None):
    """`mx.quantized_matmul(x, w, ..., transpose=True)`, with 2..8 rows on a
    GPU through qmv_rows: each packed weight read once, every row bit for bit
    what MLX's one-row kernel (the decode step's) computes for it. One row,
    more than 8, other quantizations and the CPU run MLX's op."""
    be = backend or globals()["backend"]()
    K = x.shape[-1]
    rows = x.size // K if K else 0

    def mlx_op():
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                                   bits=bits, mode=mode)

    if rows < 2 or rows > 8:  # decode keeps MLX's kernel; prefill its tiled matmul
        return mlx_op()
    if be == "ref" or mode != "affine" or biases is None or scales.dtype != x.dtype:
        _reference("qmv_rows", be, f"MLX's op: {mode} quantization, scales {scales.dtype}")
        return mlx_op()
    from . import launch

    N = w.shape[0]
    why = launch.qmv_rows_supported(be, x.dtype, rows, N, K, group_size, bits)
    if why is not None:
        _reference("qmv_rows", be, f"MLX's op: no kernel for {why}")
        return mlx_op()
    exact = not _fast(None)
    shape = launch.qmv_rows_check_shape(be, x.dtype, rows, N, K, bits)
    # CUDA: MLX's dequantization may or may not have been contracted to one fma
    forms = ({"fused dequantization": True, "dequantization rounded twice": False}
             if launch.dialect(be) == "cuda" else {"": True})
    choice = selfcheck.verified_choice(
        "qmv_rows", be, selfcheck.variant(x.dtype, bits, group_size, rows, *shape, exact),
        {name: selfcheck.qmv_rows_check(launch, qmv_row_reference(be), be, x.dtype, bits,
                                        group_size, rows, *shape, dq_fma=fma, exact=exact)
         for name, fma in forms.items()})
    if choice is None:
        return mlx_op()
    return launch.qmv_rows(x, w, scales, biases, group_size=group_size, bits=bits, backend=be,
                           dq_fma=forms[choice])


def qmv_row_reference(backend: str):
    """Each row on its own as `backend`'s one-row kernel computes it: MLX's op
    on a GPU, the NumPy model of that kernel in the emulator (emu/qmv.py)."""
    if backend == "emu-cuda":
        from .emu import qmv

        return qmv.cuda_qmv
    if backend == "emu-metal":
        from .emu import qmv

        return lambda x, w, s, b, gs, bits, dq_fma: qmv.metal_qmv_fast(x, w, s, b, gs, bits)

    def per_row(x, w, s, b, gs, bits, dq_fma):
        return mx.concatenate([mx.quantized_matmul(x[i:i + 1], w, s, b, transpose=True,
                                                   group_size=gs, bits=bits)
                               for i in range(x.shape[0])])
    return per_row


# -- the ops references ------------------------------------------------------------------
def conv_verify_ref(
    conv_state: mx.array, qkv: mx.array, weight: mx.array
) -> Tuple[mx.array, mx.array]:
    """Depthwise causal conv over a verify window.

    conv_state: [B, K-1, C] rows before the window; qkv: [B, T, C];
    weight: [C, K, 1] (mlx Conv1d layout, groups == C).
    Returns (silu(conv) [B, T, C], conv_input [B, K-1+T, C]). The conv window
    after consuming n tokens is conv_input[:, n : n+K-1]; keeping the whole
    input is the cheapest form of "every position's window".
    """
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    out = nn.silu(mx.conv1d(conv_input, weight, groups=weight.shape[0]))
    return out, conv_input


def _gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array):
    """g and beta of every position, each computed on its own [B, 1, Hv]
    slice as mlx_lm's single-token update computes them for plain decoding."""
    T = a.shape[1]
    g = mx.concatenate([compute_g(A_log, a[:, t:t + 1], dt_bias) for t in range(T)], axis=1)
    beta = mx.concatenate([mx.sigmoid(b[:, t:t + 1]) for t in range(T)], axis=1)
    return g, beta


def _steps(q, k, v, g, beta, state, keep_states: bool):
    """mlx_lm's single-token update (its ops path) at every position."""
    ys, states = [], []
    for t in range(q.shape[1]):
        sl = slice(t, t + 1)
        y, state = gated_delta_ops(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state)
        ys.append(y)
        if keep_states:
            states.append(state)
    return mx.concatenate(ys, axis=1), (mx.stack(states, axis=1) if keep_states else None)


def gdn_verify_ref(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
) -> Tuple[mx.array, mx.array]:
    """Gated delta recurrence over T verify tokens, capturing every state.

    q, k: [B, T, Hk, Dk] (conv output, not yet normalized); v: [B, T, Hv, Dv];
    a, b: [B, T, Hv] raw gate projections; state: [B, Hv, Dv, Dk] fp32.
    Returns y [B, T, Hv, Dv] (q.dtype) and states [B, T, Hv, Dv, Dk] fp32,
    states[:, t] being the state after token t. Each step is mlx_lm's own
    single-token update, so state t equals plain decoding's state exactly.
    """
    Dk = q.shape[-1]
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    g, beta = _gates(a, b, A_log, dt_bias)
    return _steps(q, k, v, g, beta, state, keep_states=True)


def gdn_verify_taped_ref(q, k, v, a, b, A_log, dt_bias, state) -> Tuple[mx.array, dict]:
    """`gdn_verify_ref`'s y, and instead of its states the tape (a GdnTape's
    fields): what each position's update consumed."""
    Dk = q.shape[-1]
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    g, beta = _gates(a, b, A_log, dt_bias)
    y, _ = _steps(q, k, v, g, beta, state, keep_states=False)
    return y, dict(state=state, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)


def gdn_replay_ref(state, k, v, g, beta, consumed) -> mx.array:
    """The state after consumed[b] (1..T) of a tape's positions, per row:
    the verify's own steps, each kept where the row consumed it (a where
    that keeps a value keeps its bits), so it is the state the capture path
    would have picked."""
    n = consumed.astype(mx.int32)[:, None, None, None]
    for t in range(k.shape[1]):
        sl = slice(t, t + 1)
        # (the update's y is never evaluated: q only fills its place)
        _, nxt = gated_delta_ops(k[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state)
        state = mx.where(t < n, nxt, state)
    return state


# The same functions traced once per shape (T, batch, dtype): on the CPU backend
# they run several times faster (fewer graph nodes and launches per cycle) and,
# as tests/test_reference_compiled.py checks, bit-identical to the eager ones.
gdn_verify_ref_compiled = mx.compile(gdn_verify_ref)
gdn_verify_taped_ref_compiled = mx.compile(gdn_verify_taped_ref)
gdn_replay_ref_compiled = mx.compile(gdn_replay_ref)
conv_verify_ref_compiled = mx.compile(conv_verify_ref)


def commit_ref(
    states: Sequence[mx.array],
    conv_inputs: Sequence[mx.array],
    consumed: mx.array,
    conv_kernel: int,
) -> List[Tuple[mx.array, mx.array]]:
    """Select, for every GDN layer, the state and conv window after `consumed`
    verify tokens (1..T). `consumed` is a device int32 scalar so no host
    synchronization is needed. Returns [(conv_window [B,K-1,C], state), ...].
    """
    n = consumed.astype(mx.int32).reshape(1)
    out = []
    rows = n + mx.arange(conv_kernel - 1)
    for st, ci in zip(states, conv_inputs):
        window = mx.take(ci, rows, axis=1)
        state = mx.take(st, n - 1, axis=1).squeeze(1)
        out.append((window, state))
    return out


def draft_project_ref(
    hidden: mx.array,
    weight: mx.array,
    scales: Optional[mx.array] = None,
    biases: Optional[mx.array] = None,
    *,
    group_size: int = 64,
    bits: int = 0,
    vocab_ids: Optional[mx.array] = None,
    top_k: int = 1,
) -> Tuple[mx.array, mx.array]:
    """Draft head output projection fused with arg-max / top-k.

    hidden: [N, H]; weight: [V, H] (float) or mlx_lm affine-quantized
    (weight/scales/biases, bits 4 or 8). With vocab_ids only those rows are
    scored. Returns (values [N, top_k] logits, ids [N, top_k] full-vocab ids),
    ids sorted by decreasing logit (ties: lower id first).
    """
    if vocab_ids is not None:
        weight = weight[vocab_ids]
        if scales is not None:
            scales, biases = scales[vocab_ids], biases[vocab_ids]
    if bits:
        logits = mx.quantized_matmul(
            hidden, weight, scales, biases, transpose=True,
            group_size=group_size, bits=bits,
        )
    else:
        logits = hidden @ weight.T
    logits = logits.astype(mx.float32)
    if top_k == 1:
        idx = mx.argmax(logits, axis=-1, keepdims=True)
    else:
        idx = mx.argsort(-logits, axis=-1)[:, :top_k]
    vals = mx.take_along_axis(logits, idx, axis=-1)
    if vocab_ids is not None:
        idx = vocab_ids[idx]
    return vals, idx.astype(mx.int32)
