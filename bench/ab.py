"""A/B gate: mlx_mtp.server at two revisions, and mlx_lm.server, on every
serve_bench workload in one run.

    python bench/ab.py BASE [HEAD] [--rounds 5] [--workloads ...] [--model PATH]

BASE and HEAD are git revisions (HEAD's default: this checkout as it is,
uncommitted changes included). Each is checked out in a git worktree and
installed (`pip install --no-deps --target`) into a folder of its own, so
each server runs its own revision's code, whatever is installed here. The
three servers (base, head, mlx_lm) run every workload round by round, the
order rotating, each run started once all are idle (serve_bench.measure);
the workloads whose requests follow each other without that wait
(serve_bench.FOLLOWING: lone requests right after an agent's turns, a
request arriving as a turn ends, mixed traffic back to back) are run too.

With json1free3 and same4 (both in the defaults) it also prints what one
JSON-schema client costs its three free neighbours: a free client's tok/s
there over one of four free clients' (paired by round; NEIGHBOURS_TARGET).
Per workload it prints each server's median tok/s, the paired ratios
head/base and head/mlx_lm (median of the rounds' ratios, [min-max]), and for
turn_ttft the time to first token as a turn ends and after a pause. A
workload is a regression when its median head/base ratio is below 0.97 and
its spread does not reach 1.0 (the upper quartile of the rounds' ratios is
below 1): the exit status is then 1. Run it before landing any change to the
server, batch, cycle or cache (docs/contributing.md).

On Linux CPU, as serve_bench: an fp32 model with OpenBLAS preloaded.

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      python bench/ab.py 873b75f --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import serve_bench  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REGRESSION = 0.97  # a median head/base below this, its spread short of 1.0: a regression
# issue 63: a grammar-constrained client costs its free neighbours at most 8%
NEIGHBOURS_TARGET = 0.92


def install(revision: str, into: Path, cwd: Path) -> Path:
    """The revision's package installed in a folder of its own (from a git
    worktree of it, or for None a copy of this checkout's files as they are:
    tracked, and untracked ones git does not ignore; `pip install
    --target`); returns the folder to put on PYTHONPATH. `cwd`: where the
    servers run (checked: the package imports from the folder there)."""
    source = into / "src"
    if revision is not None:
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force",
                        str(source), revision], check=True, capture_output=True)
    else:
        files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                               check=True, capture_output=True, text=True).stdout.split()
        for name in files:
            if (REPO / name).is_file():
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, source / name)
    site = into / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(source)], check=True, capture_output=True)
    found = subprocess.run([sys.executable, "-c", "import mlx_mtp; print(mlx_mtp.__file__)"],
                           env=dict(os.environ, PYTHONPATH=pythonpath(site)), cwd=cwd,
                           text=True, capture_output=True, check=True).stdout.strip()
    if not found.startswith(str(site)):  # (the server must run this revision's code)
        raise RuntimeError(f"{revision or 'the checkout'}: mlx_mtp imports from {found}, "
                           f"not from {site}")
    return site


def pythonpath(site: Path) -> str:
    """PYTHONPATH with `site` first (the environment's own after it)."""
    return os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


def spread(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, (3 * len(xs)) // 4)]  # the upper quartile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="git revision to compare against (e.g. 873b75f)")
    p.add_argument("head", nargs="?", default=None,
                   help="git revision (default: this checkout, uncommitted changes included)")
    p.add_argument("--model", default=None, help="default: the embedded demo model")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workloads", default=",".join(serve_bench.DEFAULT
                                                   + list(serve_bench.FOLLOWING)
                                                   + ["json1free3"]))
    p.add_argument("--mtp-args", default="", help="extra flags for both mlx_mtp servers")
    p.add_argument("--head-args", default="",
                   help="extra flags for the head's server only (e.g. BASE = HEAD's revision "
                        "and --head-args=--context-drafts: a switch against itself)")
    p.add_argument("--json", default="bench/results/ab.json")
    args = p.parse_args(argv)
    from bench import blas_in_use, machine_info
    from mlx_mtp.loader import resolve_model_path

    workloads = args.workloads.split(",")
    known = serve_bench.DEFAULT + list(serve_bench.FOLLOWING) + [
        w for w in serve_bench.WORKLOADS if w != "jsonlen"]  # (jsonlen: mlx_mtp first, 2 servers)
    unknown = [w for w in workloads if w not in known]
    if unknown:
        p.error(f"unknown workload {unknown[0]!r}; choose from {', '.join(dict.fromkeys(known))}")
    model = str(Path(resolve_model_path(args.model)).resolve())
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    head_name = args.head or "working tree"
    with tempfile.TemporaryDirectory(prefix="mlx_mtp-ab-") as tmp:
        sites = {}
        try:
            for name, rev in (("base", args.base), ("head", args.head)):
                (Path(tmp) / name).mkdir()
                sites[name] = install(rev, Path(tmp) / name, Path(tmp))
            mtp = ["mlx_mtp.server", "--model", model, *args.mtp_args.split()]
            servers = {"base": (mtp, {"PYTHONPATH": pythonpath(sites["base"])}),
                       "head": (mtp + args.head_args.split(),
                                {"PYTHONPATH": pythonpath(sites["head"])}),
                       "mlx_lm": (["mlx_lm", "server", "--model", model], None)}
            print(f"model {model}; BLAS {blas_in_use()}; base {args.base}, head {head_name}"
                  + (f" with {args.head_args}" if args.head_args else "") + "; "
                  f"{args.rounds} rounds; workloads {', '.join(workloads)}", flush=True)

            def said(rnd, w, runs):
                print(f"round {rnd + 1} {w:>11}: " + ", ".join(
                    f"{n} {r['tps']:6.1f} tok/s" for n, r in runs.items())
                    + f"; head/base {runs['head']['tps'] / runs['base']['tps']:.2f}x"
                    + "".join(f", {n} errors {r['errors']}" for n, r in runs.items()
                              if r["errors"]), flush=True)

            rounds, rss = serve_bench.measure(servers, workloads, args.rounds, out, said,
                                              cwd=Path(tmp))
        finally:
            for name in ("base", "head"):
                src = Path(tmp) / name / "src"
                if src.exists():
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(src)], capture_output=True)
    summary, regressions = {}, []
    print(f"\n{args.rounds} rounds, three servers rotated; tok/s = completion tokens / wall time "
          "of the workload's timed requests; ratios are medians of the rounds' paired ratios "
          "[min-max]; for turn_ttft, base TTFT / head TTFT (higher: head answers sooner)")
    print("| workload | base tok/s | head tok/s | mlx_lm tok/s | head / base | head / mlx_lm "
          "| base / mlx_lm | TTFT p50 base / head / mlx_lm |")
    print("|---|---|---|---|---|---|---|---|")
    for w in workloads:
        rs = rounds[w]
        if w == "turn_ttft":  # (a latency: lower is better)
            pairs = [statistics.median(r["base"]["ttft"]) / statistics.median(r["head"]["ttft"])
                     for r in rs]
        else:
            pairs = [r["head"]["tps"] / r["base"]["tps"] for r in rs]
        vs_lm = [r["head"]["tps"] / r["mlx_lm"]["tps"] for r in rs]
        base_lm = [r["base"]["tps"] / r["mlx_lm"]["tps"] for r in rs]
        ttft = {n: serve_bench.pct([t for r in rs for t in r[n]["ttft"]], 0.5)
                for n in ("base", "head", "mlx_lm")}
        worse = statistics.median(pairs) < REGRESSION and spread(pairs) < 1.0
        if worse:
            regressions.append(w)
        summary[w] = {"head_base": pairs, "head_mlx_lm": vs_lm, "base_mlx_lm": base_lm,
                      "ttft_p50": ttft, "regression": worse,
                      "tps": {n: [r[n]["tps"] for r in rs] for n in ("base", "head", "mlx_lm")},
                      "errors": {n: sum(len(r[n]["errors"]) for r in rs)
                                 for n in ("base", "head", "mlx_lm")}}
        med = {n: statistics.median(summary[w]["tps"][n]) for n in ("base", "head", "mlx_lm")}

        def cell(xs):
            return f"{statistics.median(xs):.2f}x [{min(xs):.2f}-{max(xs):.2f}]"

        print(f"| {w} | {med['base']:.1f} | {med['head']:.1f} | {med['mlx_lm']:.1f} "
              f"| {cell(pairs)}{' REGRESSION' if worse else ''} | {cell(vs_lm)} "
              f"| {cell(base_lm)} | {ttft['base'] * 1000:.0f} / {ttft['head'] * 1000:.0f} / "
              f"{ttft['mlx_lm'] * 1000:.0f} ms |")
    if "turn_ttft" in rounds:
        for n in ("base", "head", "mlx_lm"):
            after = [t for r in rounds["turn_ttft"] for t in r[n]["ttft"]]
            idle = [t for r in rounds["turn_ttft"] for t in r[n]["ttft_idle"]]
            print(f"turn_ttft {n}: TTFT as a turn ends p50 {serve_bench.pct(after, 0.5) * 1000:.0f}"
                  f" ms, after a {serve_bench.PAUSE_S:g} s pause p50 "
                  f"{serve_bench.pct(idle, 0.5) * 1000:.0f} ms")
    if "json1free3" in rounds and "same4" in rounds:
        # what a grammar-constrained client costs its free neighbours: a free
        # client's tok/s beside it over one of four free clients', paired by round
        kept = {n: [j[n]["free_client_tps"] / f[n]["free_client_tps"]
                    for j, f in zip(rounds["json1free3"], rounds["same4"])]
                for n in ("base", "head", "mlx_lm")}
        summary["neighbours"] = kept
        print("a JSON-schema client's free neighbours keep (json1free3 / same4, a free "
              f"client's tok/s; target >= {NEIGHBOURS_TARGET}): " + ", ".join(
                  f"{n} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
                  for n, v in kept.items()))
    print("peak RSS: " + ", ".join(f"{n} {v:.0f} MB" for n, v in rss.items()))
    print("regressions: " + (", ".join(regressions) if regressions else "none"))
    out.write_text(json.dumps({"machine": machine_info(), "args": vars(args),
                               "command": " ".join([sys.executable] + sys.argv),
                               "summary": summary, "peak_rss_mb": rss}, indent=1))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
