"""Batched decoding: mlx_mtp.batch_generate against mlx_lm.batch_generate.

For each batch size B and each mlx_mtp depth setting (auto and fixed depths),
every round runs mlx_lm.batch_generate and then mlx_mtp.batch_generate on the
same B prompts, back to back, so each pair sees the same machine state; each
call is timed whole (prompts included, the same prompts for both): aggregate
tok/s = generated tokens / wall time. The ratio reported is the median of the
rounds' pair ratios, with min-max; `auto` is also given as a fraction of the
best fixed depth at that B: its ratio over the best fixed depth's ratio, and
paired: the median over rounds of auto's tok/s over the best fixed depth's in
the same round.
Outputs are checked identical row by row (greedy). Also prints the depth
mlx_mtp's controller settled on (drafts and tokens per cycle).

On Linux CPU use an fp32 model with OpenBLAS preloaded (docs/design.md):
  OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python bench/batch_bench.py --sizes 1,2,4,8,16 --depths auto,0,1,2,3 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from bench import DEFAULT_PROMPTS, blas_in_use, machine_info  # noqa: E402

MORE_PROMPTS = DEFAULT_PROMPTS + [
    "def quicksort(items):",
    "class Stack:\n    def __init__(self):",
    "def read_json(path):",
    "import re\n\ndef slugify(text):",
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder / HF repo (default: demo model)")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--depths", "--draft-tokens", dest="depths", default="auto,0,1,2,3",
                   help="mlx_mtp depth settings to run, e.g. auto,0,1,2,3")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3,
                   help="calls of each setting before the rounds (graphs traced; auto's "
                        "controllers, kept on the model across calls, measure their depths)")
    p.add_argument("--json", default="bench/results/batch_bench.json")
    args = p.parse_args(argv)

    import mlx_lm

    import mlx_mtp
    from mlx_mtp.loader import resolve_model_path

    path = str(resolve_model_path(args.model))
    model, tok = mlx_mtp.load(path, quiet=True)
    ref, _ = mlx_lm.load(path)
    depths = [d if d == "auto" else int(d) for d in args.depths.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"model {path}; BLAS {blas_in_use()}; max_tokens {args.max_tokens}; "
          f"depths {args.depths}; {args.warmup} warm-up calls of each, then {args.rounds} "
          "rounds", flush=True)

    def run_lm(prompts):
        t = time.perf_counter()
        out = mlx_lm.batch_generate(ref, tok, prompts, max_tokens=args.max_tokens,
                                    return_token_ids=True)
        return out.token_ids, time.perf_counter() - t

    def run_mtp(prompts, depth, stats):
        t = time.perf_counter()
        out = mlx_mtp.batch_generate(model, tok, prompts, max_tokens=args.max_tokens,
                                     draft_tokens=depth, return_token_ids=True, stats=stats)
        return out.token_ids, time.perf_counter() - t

    rows = []
    for B in sizes:
        prompts = [tok.encode(MORE_PROMPTS[i % len(MORE_PROMPTS)]) for i in range(B)]
        for _ in range(args.warmup):  # graph compiles, first-use allocations, auto's learning
            run_lm(prompts)
            for depth in depths:
                run_mtp(prompts, depth, [])
        results = {d: dict(ratios=[], lm=[], mtp=[], stats=[], same=True) for d in depths}
        for _ in range(args.rounds):
            for depth in depths:
                r = results[depth]
                want, t_lm = run_lm(prompts)
                got, t_mtp = run_mtp(prompts, depth, r["stats"])
                r["same"] &= got == want
                r["lm"].append(sum(map(len, want)) / t_lm)
                r["mtp"].append(sum(map(len, got)) / t_mtp)
                r["ratios"].append(r["mtp"][-1] / r["lm"][-1])
        fixed = {d: statistics.median(results[d]["ratios"]) for d in depths if d != "auto"}
        best = max(fixed, key=fixed.get) if fixed else None
        for depth in depths:
            r, stats = results[depth], results[depth]["stats"]
            drafted = sum(s.drafted for s in stats)
            cycles = max(sum(s.cycles for s in stats), 1)
            ratio = statistics.median(r["ratios"])
            row = dict(batch=B, depth=depth, mlx_lm_tps=statistics.median(r["lm"]),
                       mlx_mtp_tps=statistics.median(r["mtp"]), ratio=ratio,
                       ratio_min=min(r["ratios"]), ratio_max=max(r["ratios"]),
                       identical=r["same"],
                       tokens_per_cycle=sum(s.emitted for s in stats) / cycles,
                       drafts_per_cycle=drafted / cycles,
                       acceptance=sum(s.accepted for s in stats) / drafted if drafted else 0.0,
                       of_best=ratio / fixed[best] if depth == "auto" and best is not None
                       else None,
                       # auto's tok/s over the best fixed depth's in the same round (one
                       # noisy division fewer than going through both mlx_lm runs)
                       of_best_paired=statistics.median(
                           a / b for a, b in zip(r["mtp"], results[best]["mtp"]))
                       if depth == "auto" and best is not None else None, best=best)
            rows.append(row)
            of_best = (f", {row['of_best']:.0%} of the best fixed depth ({best}; "
                       f"{row['of_best_paired']:.0%} paired within rounds)"
                       if row["of_best"] is not None else "")
            print(f"B={B:>2} depth {str(depth):>4}: mlx_lm {row['mlx_lm_tps']:6.1f} tok/s, "
                  f"mlx_mtp {row['mlx_mtp_tps']:6.1f} tok/s, ratio {ratio:.2f}x "
                  f"[{row['ratio_min']:.2f}-{row['ratio_max']:.2f}], drafts/cycle "
                  f"{row['drafts_per_cycle']:.2f}, tokens/cycle {row['tokens_per_cycle']:.2f}, "
                  f"identical {r['same']}{of_best}", flush=True)
    print("\n| B | " + " | ".join(f"depth {d}" for d in depths)
          + " | auto / best fixed | auto / best fixed, paired |")
    print("|---|" + "---|" * (len(depths) + 2))
    for B in sizes:
        cells = {r["depth"]: r for r in rows if r["batch"] == B}
        auto = cells.get("auto")
        print(f"| {B} | " + " | ".join(f"{cells[d]['ratio']:.2f}x" for d in depths)
              + (f" | {auto['of_best']:.0%} (best: {auto['best']}) | {auto['of_best_paired']:.0%} |"
                 if auto and auto["of_best"] is not None else " | | |"))
    print("(each depth cell: mlx_mtp / mlx_lm, median of the rounds' adjacent pairs; auto / best "
          "fixed: the ratio of those medians, and the median over rounds of auto's tok/s over the "
          "best fixed depth's in the same round)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(machine=machine_info(), mlx=mx.__version__,
                                                   args=vars(args), rows=rows,
                                                   command=" ".join([sys.executable] + sys.argv)),
                                              indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
