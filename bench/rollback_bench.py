"""Cycle time of the two GDN rollbacks (docs/design.md §3, "Rollback"): every
position's state captured, or a tape replayed at the commit, on this device.

    python bench/rollback_bench.py                    # the demo model and a tiny random one
    python bench/rollback_bench.py --depths 2 3 4 16 --tokens 96 --repeats 3

`--gdn` times one GDN layer's verify and commit alone (compiled, as in a
cycle), capture against tape, at the tiny model's, the demo's and
Qwen3.6-27B's layer shapes, T = depth + 1, one row.

Each (model, depth, rollback) decodes the same greedy prompt with its own
model instance (a compiled graph is traced per rollback), rounds interleaved;
prints the median seconds per cycle over the rounds, and the tokens (which
must be equal: both rollbacks commit the same states).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import mlx.core as mx

import mlx_mtp
from mlx_mtp import cache as cache_mod
from mlx_mtp.api import generate_step
from mlx_mtp.stats import MTPStats

mlx_mtp.params.CPU_EAGER_RUNS = 0  # compiled from the first cycle, as on a GPU

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _models(which: str):
    if which == "demo":
        from mlx_mtp.loader import demo_model_path

        path = demo_model_path()
    else:
        from mlx_mtp.testing.synthetic import write_checkpoint

        path = write_checkpoint(tempfile.mkdtemp(prefix="rollback_bench_"))
    return {mode: mlx_mtp.load(str(path)) for mode in ("capture", "tape")}


def _run(model, tok, depth: int, tokens: int, mode: str):
    cache_mod._FORCE_ROLLBACK = mode
    try:
        stats = MTPStats()
        prompt = mx.array(tok.encode(PROMPT))
        start, cpu0, out = time.perf_counter(), time.process_time(), []
        for t, _ in generate_step(prompt, model, max_tokens=tokens, draft_tokens=depth,
                                  stats=stats):
            out.append(int(t))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - start
        return (wall / max(stats.cycles, 1), cpu / max(stats.cycles, 1)), out, stats.cycles
    finally:
        cache_mod._FORCE_ROLLBACK = None


GDN_SHAPES = {"tiny": (2, 4, 16), "demo": (4, 4, 64), "27b": (16, 48, 128)}  # Hk, Hv, D


def gdn_only(depths, repeats: int):
    from mlx_mtp import metal

    @mx.compile
    def capture(q, k, v, a, b, A_log, dt_bias, state, n):
        y, states = metal.gdn_verify_ref(q, k, v, a, b, A_log, dt_bias, state)
        return y, mx.take_along_axis(states, (n - 1)[:, None, None, None, None], axis=1)[:, 0]

    @mx.compile
    def tape(q, k, v, a, b, A_log, dt_bias, state, n):
        y, t = metal.gdn_verify_taped_ref(q, k, v, a, b, A_log, dt_bias, state)
        return y, metal.gdn_replay_ref(t["state"], t["k"], t["v"], t["g"], t["beta"], n)

    for name, (Hk, Hv, D) in GDN_SHAPES.items():
        for depth in depths:
            T = depth + 1
            ks = mx.random.split(mx.random.key(0), 6)
            args = (mx.random.normal((1, T, Hk, D), key=ks[0]).astype(mx.bfloat16),
                    mx.random.normal((1, T, Hk, D), key=ks[1]).astype(mx.bfloat16),
                    mx.random.normal((1, T, Hv, D), key=ks[2]).astype(mx.bfloat16),
                    mx.random.normal((1, T, Hv), key=ks[3]).astype(mx.bfloat16),
                    mx.random.normal((1, T, Hv), key=ks[4]).astype(mx.bfloat16),
                    mx.zeros((Hv,)), mx.zeros((Hv,), mx.bfloat16),
                    mx.random.normal((1, Hv, D, D), key=ks[5]) * 0.1,
                    mx.array([T // 2 + 1], mx.int32))
            iters = max(3, int(2e7 // (Hv * D * D * T)))
            res = {}
            for fn in (capture, tape):
                mx.eval(fn(*args))
                samples = []
                for _ in range(repeats):
                    c0 = time.process_time()
                    for _ in range(iters):
                        mx.eval(fn(*args))
                    samples.append((time.process_time() - c0) / iters)
                res[fn.__name__] = statistics.median(samples)
            print(f"gdn {name:4s} T {T:2d}  cpu ms: capture {res['capture'] * 1e3:8.3f} "
                  f"tape {res['tape'] * 1e3:8.3f} ({res['tape'] / res['capture']:.3f})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "demo"])
    ap.add_argument("--depths", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gdn", action="store_true", help="one GDN layer's verify and commit alone")
    args = ap.parse_args()
    if args.gdn:
        return gdn_only(args.depths, args.repeats)
    for which in args.models:
        models = _models(which)
        for depth in args.depths:
            times = {m: [] for m in models}
            outs = {}
            for m, (model, tok) in models.items():  # warm-up: trace the graphs
                _, outs[m], _ = _run(model, tok, depth, args.tokens, m)
            for _ in range(args.repeats):
                for m, (model, tok) in models.items():
                    dt, out, cycles = _run(model, tok, depth, args.tokens, m)
                    times[m].append(dt)
                    assert out == outs[m]
            same = outs["capture"] == outs["tape"]
            wall = {m: statistics.median(t[0] for t in v) for m, v in times.items()}
            cpu = {m: statistics.median(t[1] for t in v) for m, v in times.items()}
            print(f"{which:5s} depth {depth:2d}  cycles {cycles:3d}  wall ms/cycle: capture "
                  f"{wall['capture'] * 1e3:7.2f} tape {wall['tape'] * 1e3:7.2f} "
                  f"({wall['tape'] / wall['capture']:.3f})  cpu ms/cycle: capture "
                  f"{cpu['capture'] * 1e3:7.2f} tape {cpu['tape'] * 1e3:7.2f} "
                  f"({cpu['tape'] / cpu['capture']:.3f})  same tokens {same}", flush=True)


if __name__ == "__main__":
    main()
