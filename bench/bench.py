"""Benchmark mlx_mtp against mlx_lm on one model and one prompt set, in one run.

Rounds alternate mlx_lm's own generation and mlx_mtp at each depth, so both
see the same machine state. Prints tok/s (generation only, prompt excluded),
the ratio to mlx_lm, acceptance per draft position, tokens per cycle, and the
measured costs verify(k+1)/decode(1) and draft-step/decode(1); writes JSON
with the machine, MLX version and the BLAS library actually loaded.

On Linux CPU use an fp32 model with OpenBLAS preloaded (DESIGN.md §5):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python bench/bench.py --model mlx_mtp/demo --depths 0,1,2,3,4

  python bench/bench.py --synthetic --oracle-rate 0.8   # random weights, oracle drafts
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "import os\n\ndef walk_files(root):",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]


def blas_in_use() -> str:
    """Which BLAS serves MLX's CPU matmuls: a preloaded library wins symbol
    resolution over the reference BLAS bundled in the mlx wheel."""
    if platform.system() == "Darwin":
        return "Accelerate (macOS)"
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "blas" in p.lower()]
    if preload:
        return "preloaded " + ", ".join(preload)
    try:
        libs = {line.split()[-1] for line in open("/proc/self/maps") if "blas" in line.lower()}
        bundled = sorted(l for l in libs if "mlx" in l)
        if bundled:
            return "reference BLAS bundled with mlx (" + bundled[0] + ")"
    except OSError:
        pass
    return "unknown"


def machine_info() -> dict:
    import mlx_lm

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "blas": blas_in_use(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }


def synthetic_model(args) -> Path:
    from mlx_mtp.synthetic import write_checkpoint

    d = Path(tempfile.mkdtemp(prefix="mlx_mtp_bench_"))
    over = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                head_dim=args.hidden // 8, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=64, linear_value_head_dim=64)
    return write_checkpoint(d, text_overrides=over)


def timed(fn, reps):
    fn()  # warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def step_costs(model, prompt_ids, depths, reps=20) -> dict:
    """Median seconds of one trunk decode (T=1), one verify of T=k+1 tokens with
    GDN capture, and one head draft step, at the prompt's context length. Caches
    are rolled back after each call so the context stays fixed."""
    from mlx_mtp.caches import make_trunk_cache, set_capturing

    cache = make_trunk_cache(model)
    model.trunk_hidden(mx.array(prompt_ids)[None], cache)
    mx.eval([c.state for c in cache])
    saved = [(c[0], c[1]) if not hasattr(c, "offset") else None for c in cache]

    def restore(n):
        for c, s in zip(cache, saved):
            if s is None:
                c.trim(n)
            else:
                c[0], c[1] = s
                c.clear_capture()
        set_capturing(cache, False)

    def run(T, capture):
        set_capturing(cache, capture)
        toks = mx.array([prompt_ids[-1]] * T)[None]
        h = model.trunk_hidden(toks, cache)
        logits = model.logits_from_hidden(h)
        mx.eval(logits, [c.state for c in cache])
        restore(T)

    out = {"decode_s": timed(lambda: run(1, False), reps)}
    for k in depths:
        if k > 0:
            out[f"verify{k + 1}_s"] = timed(lambda k=k: run(k + 1, True), reps)
    if model.has_mtp:
        hc = model.mtp.make_cache()
        h = model.trunk_hidden(mx.array(prompt_ids)[None], None)
        model.mtp(h[:, :-1], model.embed(mx.array(prompt_ids)[None, 1:]), hc)
        mx.eval([c.state for c in hc])
        g = h[:, -1:]

        def draft():
            x = model.mtp(g, model.embed(mx.array([[prompt_ids[-1]]])), hc)
            mx.eval(mx.argmax(model.logits_from_hidden(x), axis=-1))
            for c in hc:
                c.trim(1)

        out["draft_s"] = timed(draft, reps)

        # head-cache rewrite of a depth-k cycle: the head over k+1 verified
        # hiddens, then the next first draft from one row
        for k in depths:
            if k > 0:
                hk = h[:, -(k + 1):]
                toks = mx.array(prompt_ids[-(k + 1):])[None]

                def rewrite(hk=hk, toks=toks, k=k):
                    x = model.mtp(hk, model.embed(toks), hc)
                    mx.eval(model.draft_tokens_from_hidden(x[0, -1:]))
                    for c in hc:
                        c.trim(k + 1)

                out[f"rewrite{k}_s"] = timed(rewrite, reps)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder / HF repo (default: demo model)")
    p.add_argument("--synthetic", action="store_true", help="random-weight fp32 checkpoint")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--oracle-rate", type=float, default=None,
                   help="draft the trunk's own greedy output, right with this probability")
    p.add_argument("--prompts", type=str, default=None, help="file with one prompt per paragraph")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--depths", type=str, default="0,1,2,3,4,auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=str, default="bench/results/bench.json")
    args = p.parse_args(argv)

    import mlx_lm
    from mlx_lm.generate import generate_step

    import mlx_mtp
    from mlx_mtp.decode import MTPStats, OracleDrafter, mtp_generate_step
    from mlx_mtp.load import resolve_model_path

    path = synthetic_model(args) if args.synthetic else args.model
    path = resolve_model_path(path)
    model, tok = mlx_mtp.load(path)
    # the baseline is mlx_lm's own loader and generate_step on the same weights
    ref_model, _ = mlx_lm.load(str(path))
    depths = [d if d == "auto" else int(d) for d in args.depths.split(",")]
    fixed = [d for d in depths if d != "auto"]
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        prompts = [s for s in Path(args.prompts).read_text().split("\n\n") if s.strip()]
    prompt_ids = [tok.encode(s) for s in prompts]
    V = model.language_model.args.vocab_size

    def run_mlx_lm(ids):
        t0, n = None, 0
        out = []
        for tkn, _ in generate_step(mx.array(ids), ref_model, max_tokens=args.max_tokens):
            if t0 is None:
                t0 = time.perf_counter()  # first token = end of prompt processing
            out.append(tkn)
        return out, len(out) - 1, time.perf_counter() - t0

    def run_mtp(ids, k, ref):
        stats = MTPStats()
        oracle = OracleDrafter(ref, args.oracle_rate, V) if args.oracle_rate is not None else None
        t0, out = None, []
        for tkn, _, _ in mtp_generate_step(mx.array(ids), model, max_tokens=args.max_tokens,
                                           draft_tokens=k, stats=stats, oracle=oracle):
            if t0 is None:
                t0 = time.perf_counter()
            out.append(tkn)
        return out, len(out) - 1, time.perf_counter() - t0, stats

    # warm-up (compilation, allocator)
    ref0, _, _ = run_mlx_lm(prompt_ids[0][:8])
    run_mtp(prompt_ids[0][:8], max(fixed or [1]), ref0)

    tot = {"mlx_lm": [0, 0.0]}
    tot.update({k: [0, 0.0] for k in depths})
    agg = {k: MTPStats() for k in depths}
    mismatches = 0
    for r in range(args.rounds):
        for ids in prompt_ids:
            ref, n, dt = run_mlx_lm(ids)
            tot["mlx_lm"][0] += n
            tot["mlx_lm"][1] += dt
            for k in depths:
                out, n, dt, st = run_mtp(ids, k, ref)
                mismatches += out != ref
                tot[k][0] += n
                tot[k][1] += dt
                a = agg[k]
                a.cycles += st.cycles
                a.emitted += st.emitted
                for i, (d, c) in enumerate(zip(st.drafted_at, st.accepted_at)):
                    while len(a.drafted_at) <= i:
                        a.drafted_at.append(0)
                        a.accepted_at.append(0)
                    a.drafted_at[i] += d
                    a.accepted_at[i] += c

    costs = step_costs(model, prompt_ids[0], fixed)
    base_tps = tot["mlx_lm"][0] / tot["mlx_lm"][1]
    rows = []
    for k in depths:
        tps = tot[k][0] / tot[k][1]
        rows.append({
            "depth": k, "tok_s": tps, "ratio": tps / base_tps,
            "acceptance": agg[k].acceptance, "tokens_per_cycle": agg[k].tokens_per_cycle,
            "verify_cost": (costs.get(f"verify{k + 1}_s", costs["decode_s"]) / costs["decode_s"]
                            if k != "auto" else float("nan")),
            "cycles": agg[k].cycles,
            "cycle_s": tot[k][1] / agg[k].cycles if agg[k].cycles else 0.0,
        })
    info = machine_info()
    print(f"model: {path}   device: {info['device']}   mlx {info['mlx']}   BLAS: {info['blas']}")
    print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.max_tokens} tokens each, greedy"
          + (f", oracle drafter at rate {args.oracle_rate}" if args.oracle_rate is not None else ""))
    print(f"mlx_lm: {base_tps:.1f} tok/s;  decode {costs['decode_s'] * 1e3:.2f} ms, "
          f"draft step {costs.get('draft_s', 0) * 1e3:.2f} ms "
          f"({costs.get('draft_s', 0) / costs['decode_s']:.2f}x decode)")
    print(f"{'depth':>5} {'tok/s':>8} {'vs mlx_lm':>9} {'tok/cycle':>9} {'verify(k+1)/decode':>18}  acceptance per position")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance"]) or "-"
        print(f"{r['depth']:>5} {r['tok_s']:>8.1f} {r['ratio']:>8.2f}x {r['tokens_per_cycle']:>9.2f} "
              f"{r['verify_cost']:>18.2f}  {acc}")
    if model.has_mtp:
        print("where a cycle's time goes (ms; stage costs measured alone, host = the rest):")
        print(f"{'depth':>5} {'cycle':>7} {'draft':>7} {'verify':>7} {'rewrite':>8} {'host+sync':>9}")
        for r in rows:
            k = r["depth"]
            if k in (0, "auto") or not r["cycles"]:
                continue
            cyc = r["cycle_s"]
            dr = (k - 1) * costs["draft_s"]
            ve = costs[f"verify{k + 1}_s"]
            rw = costs[f"rewrite{k}_s"]
            r["breakdown_ms"] = {"cycle": cyc * 1e3, "draft": dr * 1e3, "verify": ve * 1e3,
                                 "rewrite": rw * 1e3, "host": (cyc - dr - ve - rw) * 1e3}
            b = r["breakdown_ms"]
            print(f"{k:>5} {b['cycle']:>7.2f} {b['draft']:>7.2f} {b['verify']:>7.2f} "
                  f"{b['rewrite']:>8.2f} {b['host']:>9.2f}")
    print(f"outputs identical to mlx_lm: {'yes' if mismatches == 0 else f'NO ({mismatches} differ)'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "machine": info, "model": str(path), "prompts": len(prompts), "rounds": args.rounds,
            "max_tokens": args.max_tokens, "oracle_rate": args.oracle_rate,
            "mlx_lm_tok_s": base_tps, "costs": costs, "rows": rows,
            "command": " ".join([sys.executable] + sys.argv),
        }, indent=1))
        print(f"wrote {args.json}")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
