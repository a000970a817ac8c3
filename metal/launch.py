"""Kernel launchers: one Python API over Metal, CUDA and the Linux emulator.

Each public function takes the reference's arguments plus `backend`:
  "metal"      mx.fast.metal_kernel on the `.metal` source (Apple GPU)
  "cuda"       mx.fast.cuda_kernel on the `.cu` twin (MLX CUDA backend)
  "emu-metal"  the `.metal` source run by metal/emu on the CPU (tests)
  "emu-cuda"   the `.cu` twin run by metal/emu on the CPU (tests)
Grid, threadgroup and template arguments are computed here for every backend
alike, so the emulator tests exercise the same launch code as the GPU paths.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx

_DIR = Path(__file__).resolve().parent
_EXT = {"metal": ".metal", "cuda": ".cu"}
_SOURCE_OVERRIDES: Dict[Tuple[str, str], str] = {}
_KERNELS: Dict[tuple, object] = {}

MAX_DRAFT_ROWS = 8  # hidden rows per draft_project launch
MAX_TOP_K = 32


def dialect(backend: str) -> str:
    return "cuda" if backend.endswith("cuda") else "metal"


def load_source(name: str, dial: str) -> str:
    key = (name, dial)
    if key in _SOURCE_OVERRIDES:
        return _SOURCE_OVERRIDES[key]
    return (_DIR / f"{name}{_EXT[dial]}").read_text()


class override_source:
    """Context manager: run kernel `name` with a different source (tests)."""

    def __init__(self, name: str, dial: str, source: str):
        self.key, self.source = (name, dial), source

    def __enter__(self):
        self.prev = _SOURCE_OVERRIDES.get(self.key)
        _SOURCE_OVERRIDES[self.key] = self.source
        return self

    def __exit__(self, *exc):
        if self.prev is None:
            _SOURCE_OVERRIDES.pop(self.key, None)
        else:
            _SOURCE_OVERRIDES[self.key] = self.prev


def split_source(text: str) -> Tuple[str, str]:
    """A kernel file is `[comments] //@header <helpers> //@body <body>` or just a body."""
    if "//@body" not in text:
        return "", text
    head, body = text.split("//@body", 1)
    header = head.split("//@header", 1)[1] if "//@header" in head else ""
    return header, body


def _factory(backend: str):
    if backend == "metal":
        return mx.fast.metal_kernel
    if backend == "cuda":
        return mx.fast.cuda_kernel
    from . import emu

    return emu.metal_kernel if backend == "emu-metal" else emu.cuda_kernel


def _kernel(name: str, backend: str, inputs: Sequence[str], outputs: Sequence[str],
            edit=None):
    dial = dialect(backend)
    text = load_source(name, dial)
    header, body = split_source(text)
    if dial == "cuda":
        header = load_source("cuda_compat", "cuda") + header
    if edit is not None:
        header, body = edit(header, body)
    key = (name, backend, tuple(inputs), tuple(outputs),
           hashlib.sha1((header + body).encode()).hexdigest())
    k = _KERNELS.get(key)
    if k is None:
        k = _factory(backend)(
            name=f"mtp_{name}", input_names=list(inputs), output_names=list(outputs),
            source=body, header=header,
        )
        _KERNELS[key] = k
    return k


def _rt(*dts):
    out = dts[0]
    for d in dts[1:]:
        out = mx.result_type(mx.array(0, out), mx.array(0, d))
    return out


def _round_scalar(x: float, dtype) -> float:
    return mx.array(x, dtype=mx.float32).astype(dtype).astype(mx.float32).item()


# --------------------------------------------------------------------- GDN
# gdn_verify's modes (its MODE template argument): one source, so a replay's
# updates are the verify's arithmetic
CAPTURE, TAPE, REPLAY = 0, 1, 2


def _gdn_kernel(backend: str):
    return _kernel(
        "gdn_verify", backend,
        ["q", "k", "v", "gate_a", "gate_b", "A_log", "dt_bias", "state_in", "scal", "consumed"],
        ["y", "states"],
    )


def _gdn_scal(in_t, Dk: int, fused: bool):
    inv = Dk ** -0.5
    if not fused:
        return mx.zeros((3,), mx.float32)
    return mx.array([_round_scalar(inv ** 2, in_t), _round_scalar(inv, in_t), 1e-6 * inv ** 2],
                    dtype=mx.float32)


def _gdn_launch(mode: int, q, k, v, gate_a, gate_b, A_log, dt_bias, state, consumed, *,
                backend: str, fused: bool):
    """One launch of gdn_verify in `mode`; q is a placeholder in REPLAY (not
    read), so are consumed outside it; the outputs a mode does not write are
    one-element placeholders."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    in_t = k.dtype
    at = _rt(gate_a.dtype, dt_bias.dtype) if fused else gate_a.dtype
    one = (1,)
    return _gdn_kernel(backend)(
        inputs=[q, k, v, gate_a, gate_b, A_log, dt_bias, state.astype(mx.float32),
                _gdn_scal(in_t, Dk, fused), consumed],
        template=[("InT", in_t), ("GT", gate_b.dtype), ("AT", at),
                  ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv), ("T", T), ("FUSED", bool(fused)),
                  ("MODE", mode)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[one if mode == REPLAY else (B, T, Hv, Dv),
                       {CAPTURE: (B, T, Hv, Dv, Dk), TAPE: one, REPLAY: (B, Hv, Dv, Dk)}[mode]],
        output_dtypes=[in_t, mx.float32],
    )


def gdn_verify(q, k, v, a, b, A_log, dt_bias, state, *, backend: str, fused: bool = False,
               tape: bool = False):
    """fused=False: normalization and gates by mlx_lm's own ops (as plain
    decoding), recurrence in the kernel (bitwise with mlx_lm's Metal decode
    kernel); fused=True: all of it in the kernel (one launch).
    tape=False: (y, states [B, T, Hv, Dv, Dk]); tape=True: (y, the fields of
    a GdnTape: what the kernel consumed, for gdn_replay)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError("Hv must be a multiple of Hk")
    in_t = q.dtype
    k, v = k.astype(in_t), v.astype(in_t)
    if fused:
        gate_a, gate_b = a, b
    else:
        from mlx_lm.models.gated_delta import compute_g, normalize_qk

        q, k = normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
        gate_a = compute_g(A_log, a, dt_bias)
        gate_b = mx.sigmoid(b)
    y, states = _gdn_launch(TAPE if tape else CAPTURE, q, k, v, gate_a, gate_b, A_log, dt_bias,
                            state, mx.zeros((1,), mx.int32), backend=backend, fused=fused)
    if tape:
        return y, dict(state=state, k=k, v=v, g=gate_a, beta=gate_b, A_log=A_log,
                       dt_bias=dt_bias)
    return y, states


def gdn_replay(tape, consumed, *, backend: str, fused: bool = False):
    """The state after consumed[b] (1..T, clamped) positions of each row b,
    from a GdnTape that gdn_verify(tape=True) wrote on the same backend and
    mode: [B, Hv, Dv, Dk] fp32."""
    _, state = _gdn_launch(REPLAY, mx.zeros((1,), tape.k.dtype), tape.k, tape.v, tape.g,
                           tape.beta, tape.A_log, tape.dt_bias, tape.state,
                           consumed.astype(mx.int32).reshape(-1), backend=backend, fused=fused)
    return state


# -------------------------------------------------------------------- conv
def conv_verify(conv_state, qkv, weight, *, backend: str):
    B, T, C = qkv.shape
    K = weight.shape[1]
    conv_state = conv_state.astype(qkv.dtype)
    out_t = _rt(qkv.dtype, weight.dtype)
    kern = _kernel("conv_verify", backend, ["conv_state", "qkv", "weight"],
                   ["out", "conv_input"])
    out, conv_input = kern(
        inputs=[conv_state, qkv, weight],
        template=[("InT", qkv.dtype), ("WT", weight.dtype), ("OT", out_t),
                  ("K", K), ("C", C), ("T", T)],
        grid=(C, K - 1 + T, B),
        threadgroup=(min(C, 256), 1, 1),
        output_shapes=[(B, T, C), (B, K - 1 + T, C)],
        output_dtypes=[out_t, qkv.dtype],
    )
    return out, conv_input


# ------------------------------------------------------------------ commit
def commit(states, conv_inputs, consumed, conv_kernel, *, backend: str):
    L = len(states)
    if L == 0:
        return []
    B, T, Hv, Dv, Dk = states[0].shape
    C = conv_inputs[0].shape[-1]
    ct = conv_inputs[0].dtype
    for s, c in zip(states, conv_inputs):
        if s.shape != states[0].shape or c.shape != conv_inputs[0].shape or c.dtype != ct:
            raise ValueError("commit: all GDN layers must share shapes and dtypes")
    W = conv_kernel - 1
    S = Hv * Dv * Dk
    cases = "\n".join(
        f"    case {l}: mtp_commit_layer<CT, T, KW, C, S>(states_{l}, conv_{l}, "
        f"window_{l}, state_{l}, bi, i0, stride, n); break;"
        for l in range(L)
    )
    ins = ["consumed"] + [f"{p}_{l}" for l in range(L) for p in ("states", "conv")]
    outs = [f"{p}_{l}" for l in range(L) for p in ("window", "state")]
    kern = _kernel("commit", backend, ins, outs,
                   edit=lambda h, b: (h, b.replace("//@cases", cases)))
    arrays = [mx.array(consumed).astype(mx.int32).reshape(1)]
    for s, c in zip(states, conv_inputs):
        arrays += [s, c]
    total = S + W * C
    X = min(-(-total // 256) * 256, 256 * 64)
    res = kern(
        inputs=arrays,
        template=[("CT", ct), ("T", T), ("KW", conv_kernel), ("C", C), ("S", S)],
        grid=(X, B, L),
        threadgroup=(256, 1, 1),
        output_shapes=[shp for _ in range(L) for shp in ((B, W, C), (B, Hv, Dv, Dk))],
        output_dtypes=[d for _ in range(L) for d in (ct, mx.float32)],
    )
    return [(res[2 * l], res[2 * l + 1]) for l in range(L)]


# ------------------------------------------------ quantized matmul, 2..8 rows
QMV_ROWS_MAX = 8


def qmv_rows_elems(dtype, bits: int) -> int:
    """Values a CUDA lane takes per step: MLX qmv's elems_per_thread."""
    return 16 if dtype != mx.float32 and bits <= 4 else 8


def qmv_rows_supported(backend: str, dtype, rows: int, N: int, K: int, group_size: int,
                       bits: int) -> Optional[str]:
    """None if qmv_rows takes this matmul on `backend`, else why not."""
    if not 1 <= rows <= QMV_ROWS_MAX:
        return f"{rows} rows"
    if bits not in (4, 8) or group_size not in (32, 64, 128):
        return f"{bits}-bit, group size {group_size}"
    if dtype not in (mx.float32, mx.bfloat16, mx.float16) or K % group_size:
        return f"{dtype}, K {K}"
    if dialect(backend) == "cuda":
        return None if K % qmv_rows_elems(dtype, bits) == 0 else f"K {K}"
    # Metal: only qmv_fast's shapes (MLX's qmv for the others is another kernel)
    vpt = 2 * 32 // bits
    if N % 8 or K % (32 * vpt):
        return f"N {N}, K {K} (not qmv_fast's shapes)"
    return None


def _qmv_cols(rows: int) -> int:
    """CUDA: output columns per warp, as many as registers allow for the rows."""
    return 4 if rows <= 2 else (2 if rows <= 4 else 1)


def qmv_rows_check_shape(backend: str, dtype, rows: int, N: int, K: int, bits: int) -> Tuple[int, int]:
    """(N, K) of the self-check's matmul for this call: the same code paths
    (the K tail, a partly filled last block) at a tiny size."""
    if dialect(backend) == "cuda":
        step, block = 32 * qmv_rows_elems(dtype, bits), 8 * _qmv_cols(rows)
        return 2 * block + N % block, 2 * step + K % step
    return 16, 2 * 32 * (2 * 32 // bits)


def qmv_rows(x, w, scales, biases, *, group_size: int, bits: int, backend: str,
             dq_fma: bool = True):
    """x [..., K] with at most 8 rows in all -> [..., N]: each row as MLX's
    one-row kernel computes it (see qmv_rows.cu / .metal), weights read once."""
    K = x.shape[-1]
    N = w.shape[0]
    M = x.size // K
    x2 = x.reshape(M, K)
    kern = _kernel("qmv_rows", backend, ["x", "w", "scales", "biases"], ["y"])
    tmpl = [("InT", x.dtype), ("M", M), ("N", N), ("K", K), ("GS", group_size),
            ("BITS", bits)]
    if dialect(backend) == "cuda":
        E = qmv_rows_elems(x.dtype, bits)
        cols = _qmv_cols(M)
        tmpl += [("E", E), ("COLS", cols), ("DQ_FMA", bool(dq_fma))]
        grid = (256 * -(-N // (8 * cols)), 1, 1)
        threadgroup = (256, 1, 1)
    else:
        grid = (32, 2 * (N // 8), 1)
        threadgroup = (32, 2, 1)
    (y,) = kern(
        inputs=[x2, w, scales, biases],
        template=tmpl, grid=grid, threadgroup=threadgroup,
        output_shapes=[(M, N)], output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], N)


# ------------------------------------------------------------- draft head
def draft_project(hidden, weight, scales=None, biases=None, *, group_size=64, bits=0,
                  vocab_ids=None, top_k=1, backend: str, simdgroups: int = 8,
                  groups: Optional[int] = None):
    N, H = hidden.shape
    has_ids = vocab_ids is not None
    V = vocab_ids.shape[0] if has_ids else weight.shape[0]
    K = int(top_k)
    if not 1 <= K <= min(MAX_TOP_K, V):
        raise ValueError(f"top_k must be in [1, {min(MAX_TOP_K, V)}]")
    if N > MAX_DRAFT_ROWS:
        parts = [
            draft_project(hidden[i:i + MAX_DRAFT_ROWS], weight, scales, biases,
                          group_size=group_size, bits=bits, vocab_ids=vocab_ids,
                          top_k=top_k, backend=backend, simdgroups=simdgroups,
                          groups=groups)
            for i in range(0, N, MAX_DRAFT_ROWS)
        ]
        return (mx.concatenate([p[0] for p in parts]), mx.concatenate([p[1] for p in parts]))
    if bits:
        if H % group_size or group_size % (32 // bits):
            raise ValueError("H must be a multiple of group_size")
        out_t = _rt(hidden.dtype, scales.dtype)
        st = scales.dtype
    else:
        out_t = _rt(hidden.dtype, weight.dtype)
        scales = biases = mx.zeros((1,), mx.float32)
        st = mx.float32
    ids = vocab_ids.astype(mx.int32) if has_ids else mx.zeros((1,), mx.int32)
    SG = simdgroups
    G = groups or max(1, min(512, -(-V // 256)))
    RPT = -(-V // G)
    RPT = -(-RPT // SG) * SG
    G = -(-V // RPT)
    k1 = _kernel("draft_project", backend,
                 ["hidden", "weight", "scales", "biases", "vocab_ids"],
                 ["part_vals", "part_pos"])
    pv, pp = k1(
        inputs=[hidden, weight, scales, biases, ids],
        template=[("InT", hidden.dtype), ("WT", weight.dtype), ("ST", st), ("OT", out_t),
                  ("N", N), ("H", H), ("V", V), ("K", K), ("BITS", int(bits)),
                  ("GS", int(group_size)), ("HAS_IDS", has_ids), ("SG", SG),
                  ("RPT", RPT), ("G", G)],
        grid=(32 * SG * G, 1, 1),
        threadgroup=(32 * SG, 1, 1),
        output_shapes=[(N, G, K), (N, G, K)],
        output_dtypes=[mx.float32, mx.int32],
    )
    k2 = _kernel("draft_topk_merge", backend, ["part_vals", "part_pos", "vocab_ids"],
                 ["values", "ids"])
    vals, out_ids = k2(
        inputs=[pv, pp, ids],
        template=[("N", N), ("G", G), ("K", K), ("HAS_IDS", has_ids)],
        grid=(32, N, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(N, K), (N, K)],
        output_dtypes=[mx.float32, mx.int32],
    )
    return vals, out_ids
