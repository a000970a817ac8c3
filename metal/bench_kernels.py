"""Time each kernel against its ops reference on the current GPU backend.

    python -m mlx_mtp.metal.bench_kernels            # Qwen3.6-27B shapes, bf16
    python -m mlx_mtp.metal.bench_kernels --small --backend emu-metal   # smoke test

Prints one row per kernel: ms per call for the kernel and the reference
(median of --iters, after warm-up) and their ratio. Emulator timings say
nothing about a GPU; use them only to check that the script runs.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from . import backend as default_backend
from . import launch
from . import (GdnTape, conv_verify_ref, commit_ref, draft_project_ref, gdn_replay_ref,
               gdn_verify_ref, gdn_verify_taped_ref)


def _time(fn, iters):
    out = fn()
    mx.eval(out)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return 1e3 * ts[len(ts) // 2]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default=None)
    p.add_argument("--small", action="store_true", help="tiny shapes (emulator smoke test)")
    p.add_argument("--T", type=int, default=4, help="verify tokens (draft depth + 1)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    be = a.backend or default_backend()
    if be == "ref":
        raise SystemExit("no GPU backend: pass --backend emu-metal (with --small) to smoke-test")
    dt = getattr(mx, a.dtype)
    if a.small:
        B, Hk, Hv, D, H, V, L, iters = 1, 1, 2, 32, 128, 512, 2, 2
    else:  # Qwen3.6-27B: 48 GDN layers, 16/48 heads of 128, hidden 5120
        B, Hk, Hv, D, H, V, L, iters = 1, 16, 48, 128, 5120, 248320, 48, a.iters
    T, Kw = a.T, 4
    C = 2 * Hk * D + Hv * D
    mx.random.seed(0)
    q = mx.random.normal((B, T, Hk, D)).astype(dt)
    k = mx.random.normal((B, T, Hk, D)).astype(dt)
    v = mx.random.normal((B, T, Hv, D)).astype(dt)
    ga, gb = mx.random.normal((B, T, Hv)).astype(dt), mx.random.normal((B, T, Hv)).astype(dt)
    A_log, dtb = mx.random.normal((Hv,)), mx.random.normal((Hv,)).astype(dt)
    st = mx.random.normal((B, Hv, D, D)) * 0.1
    cs = mx.random.normal((B, Kw - 1, C)).astype(dt)
    x = mx.random.normal((B, T, C)).astype(dt)
    w = mx.random.normal((C, Kw, 1)).astype(dt)
    states = [mx.random.normal((B, T, Hv, D, D)) for _ in range(L)]
    convs = [mx.random.normal((B, Kw - 1 + T, C)).astype(dt) for _ in range(L)]
    n = mx.array(2, dtype=mx.int32)
    hid = mx.random.normal((1, H)).astype(dt)
    W = (mx.random.normal((V, H)) * 0.02).astype(dt)
    qw, sc, bi = mx.quantize(W, group_size=64, bits=4)
    ids = mx.arange(0, V, 8, dtype=mx.int32)
    mx.eval(q, k, v, ga, gb, st, cs, x, w, states, convs, hid, W, qw, sc, bi, ids)
    gdn = (q, k, v, ga, gb, A_log, dtb, st)
    # a tape of each kind (the kernel's and the reference's) and a count per row
    tape = GdnTape(**launch.gdn_verify(*gdn, backend=be, tape=True)[1])
    ref_tape = gdn_verify_taped_ref(*gdn)[1]
    per_row = mx.full((B,), 2, dtype=mx.int32)
    mx.eval(tape.tree(), ref_tape, per_row)
    rows = [
        ("gdn_verify exact", lambda: launch.gdn_verify(*gdn, backend=be),
         lambda: gdn_verify_ref(*gdn)),
        ("gdn_verify fused", lambda: launch.gdn_verify(*gdn, backend=be, fused=True),
         lambda: gdn_verify_ref(*gdn)),
        ("gdn_verify tape", lambda: launch.gdn_verify(*gdn, backend=be, tape=True)[0],
         lambda: gdn_verify_taped_ref(*gdn)[0]),
        ("gdn replay", lambda: launch.gdn_replay(tape, per_row, backend=be),
         lambda: gdn_replay_ref(*(ref_tape[f] for f in ("state", "k", "v", "g", "beta")), per_row)),
        ("conv_verify", lambda: launch.conv_verify(cs, x, w, backend=be),
         lambda: conv_verify_ref(cs, x, w)),
        (f"commit x{L} layers", lambda: launch.commit(states, convs, n, Kw, backend=be),
         lambda: commit_ref(states, convs, n, Kw)),
        ("draft bf16 argmax", lambda: launch.draft_project(hid, W, backend=be),
         lambda: draft_project_ref(hid, W)),
        ("draft 4bit argmax", lambda: launch.draft_project(hid, qw, sc, bi, bits=4, backend=be),
         lambda: draft_project_ref(hid, qw, sc, bi, bits=4)),
        ("draft 4bit top8 trimmed", lambda: launch.draft_project(
            hid, qw, sc, bi, bits=4, vocab_ids=ids, top_k=8, backend=be),
         lambda: draft_project_ref(hid, qw, sc, bi, bits=4, vocab_ids=ids, top_k=8)),
    ]
    print(f"backend {be}, dtype {a.dtype}, T={T}, B={B}, Hk/Hv={Hk}/{Hv}, D={D}, H={H}, V={V}")
    print(f"{'kernel':26s} {'kernel ms':>10s} {'ops ms':>10s} {'ratio':>7s}")
    for name, fk, fr in rows:
        tk, tr = _time(fk, iters), _time(fr, iters)
        print(f"{name:26s} {tk:10.3f} {tr:10.3f} {tr / tk:7.2f}")


if __name__ == "__main__":
    main()
