"""Each kernel checks itself once, on first use in a process.

The Metal kernels run by default on a Mac and were only ever run in the
emulator (emu/) before a user's; the CUDA twins likewise. So before a kernel
first runs on a compiled backend (any but "ref"), `verified` runs it on a
tiny input built like the call's (same dtypes and template arguments) beside
its ops reference (`*_ref` in __init__.py, passed in). A compile error, a crash or a mismatch
(beyond the kernel's rounding: the same tolerances as the emulator tests) is
one warning line naming the kernel, and that kernel's reference path runs
from then on: slower, never wrong. `paths()` says which path each kernel took
(the CLI's --verbose prints it).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

log = logging.getLogger("mlx_mtp")

KERNELS = ("gdn_verify", "conv_verify", "commit", "draft_project", "qmv_rows")
# (kernel, backend, variant) -> (the form that passed, or None; why the others failed)
_results: Dict[tuple, Tuple[Optional[str], str]] = {}
# kernel -> the path it last took, in words (written by took())
PATHS: Dict[str, str] = {}
_lock = threading.RLock()


def verified(kernel: str, backend: str, variant: tuple, check: Callable[[], Optional[str]]) -> bool:
    """Whether `kernel` runs as a kernel for this (backend, variant): `check()`
    (the kernel beside its reference on a tiny input: None when they agree,
    else why not) runs the first time; an exception in it is a failure too."""
    return verified_choice(kernel, backend, variant, {"": check}) is not None


def verified_choice(kernel: str, backend: str, variant: tuple,
                    checks: Dict[str, Callable[[], Optional[str]]]) -> Optional[str]:
    """The first of a kernel's forms (name -> check) that passes its check for
    this (backend, variant), tried in order the first time; None, after one
    warning with each form's reason, when none does."""
    key = (kernel, backend, variant)
    with _lock:
        if key not in _results:
            passed, reasons = None, []
            for name, check in checks.items():
                try:
                    reason = check()
                except Exception as e:  # a compile error, a launch the backend refused
                    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
                    reason = f"{type(e).__name__}: {' '.join(lines[:2])[:240]}"
                if reason is None:
                    passed = name
                    break
                reasons.append(f"{name}: {reason}" if name else reason)
            _results[key] = (passed, "; ".join(reasons))
            if passed is None:
                log.warning("mlx_mtp: the %s kernel (%s) failed its self-check (%s): its "
                            "reference path runs instead", kernel, backend, _results[key][1])
        passed, why = _results[key]
    took(kernel, f"{backend} kernel (self-checked{', ' + passed if passed else ''})"
         if passed is not None else f"reference (the {backend} kernel failed its self-check: {why})")
    return passed


def took(kernel: str, path: str):
    """Record the path a kernel took (in words)."""
    PATHS[kernel] = path


def paths() -> Dict[str, str]:
    """Each kernel's last path in this process ("not used" if none yet)."""
    return {k: PATHS.get(k, "not used") for k in KERNELS}


def reset():
    """Forget every check and path (tests)."""
    with _lock:
        _results.clear()
        PATHS.clear()


# -- the checks: tiny inputs, the kernel against the reference ------------------------------
TOL = {mx.float32: 2e-5, mx.bfloat16: 3e-2, mx.float16: 5e-3}


def _mismatch(got, want, dtype, what: str) -> Optional[str]:
    """Why `got` is not `want` within the dtype's tolerance (None if it is):
    max |got - want| <= tol * (1 + max |want|), every value finite."""
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    if g.shape != w.shape:
        return f"{what}: shape {tuple(g.shape)}, not {tuple(w.shape)}"
    if not mx.all(mx.isfinite(g)).item():
        return f"{what}: non-finite values"
    err = mx.max(mx.abs(g - w)).item() if g.size else 0.0
    bound = TOL.get(dtype, 3e-2) * (1.0 + (mx.max(mx.abs(w)).item() if w.size else 0.0))
    return None if err <= bound else f"{what}: off by {err:.3g}"


def _first(*reasons) -> Optional[str]:
    return next((r for r in reasons if r is not None), None)


def gdn_check(launch, reference, backend: str, fused: bool, dtype, Dk: int, Dv: int, ratio: int):
    """gdn_verify's three modes (metal/launch.py): the captured states and y,
    the tape verify's y (bit for bit the capture's), and the tape's replay at
    a different count per row (bit for bit the captured state there)."""
    def check():
        B, T, Hk = 2, 3, 1
        Hv = Hk * ratio
        key = mx.random.key(1)
        ks = mx.random.split(key, 8)
        q = mx.random.normal((B, T, Hk, Dk), key=ks[0]).astype(dtype)
        k = mx.random.normal((B, T, Hk, Dk), key=ks[1]).astype(dtype)
        v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype)
        a = mx.random.normal((B, T, Hv), key=ks[3]).astype(dtype)
        b = mx.random.normal((B, T, Hv), key=ks[4]).astype(dtype)
        A_log = mx.random.uniform(-1.0, 1.0, (Hv,), key=ks[5])
        dt_bias = mx.random.normal((Hv,), key=ks[6]).astype(dtype)
        state = mx.random.normal((B, Hv, Dv, Dk), key=ks[7]) * 0.1
        args = (q, k, v, a, b, A_log, dt_bias, state)
        y, s = launch.gdn_verify(*args, backend=backend, fused=fused)
        yr, sr = reference(*args)
        wrong = _first(_mismatch(y, yr, dtype, "y"), _mismatch(s, sr, dtype, "states"))
        if wrong is not None:
            return wrong
        yt, tape = launch.gdn_verify(*args, backend=backend, fused=fused, tape=True)
        if not mx.array_equal(yt, y).item():
            return "the tape verify's y is not the capture's"
        n = mx.array([T, 2], dtype=mx.int32)
        got = launch.gdn_replay(_Tape(tape), n, backend=backend, fused=fused)
        want = mx.stack([s[0, T - 1], s[1, 1]])
        if got.shape != want.shape or not mx.array_equal(got, want).item():
            return "the replayed state is not the captured one"
        return None
    return check


class _Tape:
    """A tape's fields as attributes (launch.gdn_replay reads them so)."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)


def conv_check(launch, reference, backend: str, dtype, wdtype, K: int):
    def check():
        B, T, C = 1, 3, 64
        ks = mx.random.split(mx.random.key(2), 3)
        conv_state = mx.random.normal((B, K - 1, C), key=ks[0]).astype(dtype)
        qkv = mx.random.normal((B, T, C), key=ks[1]).astype(dtype)
        weight = mx.random.normal((C, K, 1), key=ks[2]).astype(wdtype)
        out, ci = launch.conv_verify(conv_state, qkv, weight, backend=backend)
        outr, cir = reference(conv_state, qkv, weight)
        return _first(_mismatch(out, outr, dtype, "out"), _mismatch(ci, cir, dtype, "conv_input"))
    return check


def commit_check(launch, reference, backend: str, dtype, conv_kernel: int):
    def check():
        L, B, T, Hv, Dv, Dk, C = 2, 1, 3, 1, 4, 8, 16
        ks = mx.random.split(mx.random.key(3), 2 * L)
        states = [mx.random.normal((B, T, Hv, Dv, Dk), key=ks[i]) for i in range(L)]
        convs = [mx.random.normal((B, conv_kernel - 1 + T, C), key=ks[L + i]).astype(dtype)
                 for i in range(L)]
        consumed = mx.array(2, dtype=mx.int32)
        got = launch.commit(states, convs, consumed, conv_kernel, backend=backend)
        want = reference(states, convs, consumed, conv_kernel)
        return _first(*(_mismatch(g, w, dtype, f"layer {i} {part}")
                        for i, (gl, wl) in enumerate(zip(got, want))
                        for part, g, w in (("window", gl[0], wl[0]), ("state", gl[1], wl[1]))))
    return check


def draft_check(launch, reference, backend: str, dtype, wdtype, bits: int, group_size: int, ids: bool,
                top_k: int):
    def check():
        N, V = 2, 96
        H = max(64, 2 * group_size) if bits else 64
        ks = mx.random.split(mx.random.key(4), 2)
        hidden = mx.random.normal((N, H), key=ks[0]).astype(dtype)
        w = mx.random.normal((V, H), key=ks[1]).astype(wdtype)
        scales = biases = None
        if bits:
            w, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        vocab_ids = mx.arange(1, V, 2, dtype=mx.int32) if ids else None
        k = min(top_k, V // 2 if ids else V)
        got = launch.draft_project(hidden, w, scales, biases, group_size=group_size, bits=bits,
                                   vocab_ids=vocab_ids, top_k=k, backend=backend)
        want = reference(hidden, w, scales, biases, group_size=group_size,
                                       bits=bits, vocab_ids=vocab_ids, top_k=k)
        if got[1].shape != want[1].shape or not mx.array_equal(got[1], want[1]).item():
            return "ids differ from the reference's"
        return _mismatch(got[0], want[0], dtype, "values")
    return check


def qmv_rows_check(launch, one_row, backend: str, dtype, bits: int, group_size: int, rows: int,
                   N: int, K: int, *, dq_fma: bool, exact: bool):
    """qmv_rows against each row alone through the backend's one-row kernel
    (`one_row`): bit for bit when `exact`, else within the dtype's tolerance."""
    def check():
        ks = mx.random.split(mx.random.key(5), 2)
        x = mx.random.normal((rows, K), key=ks[0]).astype(dtype)
        w = mx.random.normal((N, K), key=ks[1]).astype(dtype)
        wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        got = launch.qmv_rows(x, wq, scales, biases, group_size=group_size, bits=bits,
                              backend=backend, dq_fma=dq_fma)
        want = one_row(x, wq, scales, biases, group_size, bits, dq_fma)
        if not exact:
            return _mismatch(got, want, dtype, "y")
        if got.shape != want.shape or not mx.array_equal(got, want).item():
            bad = mx.sum(got != want).item() if got.shape == want.shape else "all"
            return f"{bad} of {want.size} values differ from the one-row kernel's bits"
        return None
    return check


def variant(*arrays_and_values) -> Tuple:
    """A hashable key of dtypes and template values."""
    return tuple(str(x) if isinstance(x, mx.Dtype) else x for x in arrays_and_values)
