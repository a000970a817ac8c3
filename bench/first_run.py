"""The README's first command, both ways: eager first (the CPU default, a
process's first params.CPU_EAGER_RUNS graph runs eager) and every graph
compiled at its first use (CPU_EAGER_RUNS = 0).

    python bench/first_run.py [--pairs 6] [--prompt "def fibonacci(n):"]

Cold: each way once with an empty MLX kernel cache (TMPDIR a new folder), the
wall time of the whole process and the kernels it compiled. Warm: the two
alternated `--pairs` times with the machine's cache, the speed each prints,
and the median of the pairs' ratios (this machine drifts minute to minute).
Tables in docs/measured.md.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# one process: set the eager budget, then run the CLI as `python -m mlx_mtp.generate` would
RUN = ("import sys; import mlx_mtp.params as p; p.CPU_EAGER_RUNS = int(sys.argv[1]); "
       "from mlx_mtp.cli import main; sys.exit(main(sys.argv[2:]))")
WAYS = {"eager first": None, "compiled at first use": 0}


def run(eager_runs, prompt, env=None):
    """(wall seconds, tokens, printed tok/s) of one process."""
    from mlx_mtp import params

    n = params.CPU_EAGER_RUNS if eager_runs is None else eager_runs
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", RUN, str(n), "--prompt", prompt, "--verbose"],
                       capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - start
    m = re.search(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", r.stdout)
    return wall, int(m.group(1)), float(m.group(2))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--prompt", default="def fibonacci(n):")
    args = p.parse_args()
    print(f"{sys.executable}; prompt {args.prompt!r}")
    print("| way | cold wall | kernels compiled | warm printed tok/s |")
    print("|---|---|---|---|")
    cold = {}
    for way, n in WAYS.items():
        with tempfile.TemporaryDirectory() as d:
            wall, _, _ = run(n, args.prompt, env=dict(os.environ, TMPDIR=d))
            cold[way] = (wall, len(list(Path(d).glob("mlx/*/cpu/*.so"))))
    warm = {way: [] for way in WAYS}
    for _ in range(args.pairs):  # alternated, pair by pair
        for way, n in WAYS.items():
            warm[way].append(run(n, args.prompt)[2])
    for way in WAYS:
        speeds = warm[way]
        print(f"| {way} | {cold[way][0]:.1f} s | {cold[way][1]} | "
              f"{min(speeds):.0f}-{max(speeds):.0f} |")
    ratios = [e / c for e, c in zip(*warm.values())]
    print("warm eager / compiled, pair by pair: " + ", ".join(f"{r:.2f}" for r in ratios)
          + f" (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
