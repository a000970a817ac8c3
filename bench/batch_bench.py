"""Batched decoding: mlx_mtp.batch_generate against mlx_lm.batch_generate.

For each batch size B, rounds alternate the two on the same B prompts (the
same machine state for both); each call is timed whole (prompts included,
the same prompts for both), so aggregate tok/s = generated tokens / wall
time and per-row tok/s = aggregate / B. The ratio reported is the median of
the rounds' ratios (adjacent runs), with min-max. Outputs are checked
identical row by row (greedy). Also prints the depth mlx_mtp's controller
settled on per B (tokens per cycle, drafted/accepted).

On Linux CPU use an fp32 model with OpenBLAS preloaded (docs/design.md):
  OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python bench/batch_bench.py --sizes 1,2,4,8 --max-tokens 64 --rounds 3
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
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--draft-tokens", default="auto")
    p.add_argument("--json", default="bench/results/batch_bench.json")
    args = p.parse_args(argv)

    import mlx_lm

    import mlx_mtp
    from mlx_mtp.load import resolve_model_path

    path = str(resolve_model_path(args.model))
    model, tok = mlx_mtp.load(path, quiet=True)
    ref, _ = mlx_lm.load(path)
    depth = args.draft_tokens if args.draft_tokens == "auto" else int(args.draft_tokens)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"model {path}; BLAS {blas_in_use()}; max_tokens {args.max_tokens}; "
          f"depth {depth}; rounds {args.rounds}")

    def run_lm(prompts):
        t = time.perf_counter()
        out = mlx_lm.batch_generate(ref, tok, prompts, max_tokens=args.max_tokens,
                                    return_token_ids=True)
        return out.token_ids, time.perf_counter() - t

    def run_mtp(prompts, stats):
        t = time.perf_counter()
        out = mlx_mtp.batch_generate(model, tok, prompts, max_tokens=args.max_tokens,
                                     draft_tokens=depth, return_token_ids=True, stats=stats)
        return out.token_ids, time.perf_counter() - t

    rows = []
    for B in sizes:
        prompts = [tok.encode(MORE_PROMPTS[i % len(MORE_PROMPTS)]) for i in range(B)]
        run_lm(prompts)  # warm both (graph compiles, first-use allocations)
        run_mtp(prompts, [])
        ratios, lm_tps, mtp_tps, stats, same = [], [], [], [], True
        for _ in range(args.rounds):
            want, t_lm = run_lm(prompts)
            round_stats = []
            got, t_mtp = run_mtp(prompts, round_stats)
            stats += round_stats
            n_lm, n_mtp = sum(map(len, want)), sum(map(len, got))
            same &= got == want
            lm_tps.append(n_lm / t_lm)
            mtp_tps.append(n_mtp / t_mtp)
            ratios.append(mtp_tps[-1] / lm_tps[-1])
        drafted = sum(s.drafted for s in stats)
        accepted = sum(s.accepted for s in stats)
        cycles = sum(s.cycles for s in stats)
        row = dict(batch=B, mlx_lm_tps=statistics.median(lm_tps),
                   mlx_mtp_tps=statistics.median(mtp_tps), ratio=statistics.median(ratios),
                   ratio_min=min(ratios), ratio_max=max(ratios), identical=same,
                   tokens_per_cycle=sum(s.emitted for s in stats) / max(cycles, 1),
                   drafts_per_cycle=drafted / max(cycles, 1),
                   acceptance=accepted / drafted if drafted else 0.0)
        rows.append(row)
        print(f"B={B}: mlx_lm {row['mlx_lm_tps']:.1f} tok/s ({row['mlx_lm_tps'] / B:.1f}/row), "
              f"mlx_mtp {row['mlx_mtp_tps']:.1f} tok/s ({row['mlx_mtp_tps'] / B:.1f}/row), "
              f"ratio {row['ratio']:.2f}x [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}], "
              f"drafts/cycle {row['drafts_per_cycle']:.2f}, acceptance "
              f"{row['acceptance']:.0%}, tokens/cycle {row['tokens_per_cycle']:.2f}, "
              f"identical {same}", flush=True)
    print("\n| B | mlx_lm tok/s (per row) | mlx_mtp tok/s (per row) | ratio (median of pairs) "
          "| drafts/cycle | identical |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        B = r["batch"]
        print(f"| {B} | {r['mlx_lm_tps']:.1f} ({r['mlx_lm_tps'] / B:.1f}) | "
              f"{r['mlx_mtp_tps']:.1f} ({r['mlx_mtp_tps'] / B:.1f}) | {r['ratio']:.2f}x "
              f"[{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] | {r['drafts_per_cycle']:.2f} | "
              f"{r['identical']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(machine=machine_info(), mlx=mx.__version__,
                                                   args=vars(args), rows=rows), indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
