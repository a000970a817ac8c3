"""The table bench/gpu.sh prints last, from what its steps left in OUT.

    python bench/gpu_table.py OUT

One section per step that ran: the kernel tests' outcome, the per-forward cost
of M rows over one (MLX's op and qmv_rows) with qmv_rows's bitwise check, the
27B benches (ratio to mlx_lm as the median of adjacent pairs, ideal, verify
costs, identity, cold start) and the demo's identity. A step that was cut off
or failed says so and points at its log.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def _load(out: Path, name: str):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _status(out: Path, name: str) -> str:
    rc = (out / f"{name}.rc").read_text().strip() if (out / f"{name}.rc").exists() else "not run"
    return {"0": "ok", "124": "CUT OFF (time)", "skipped": "skipped (no time left)"}.get(
        rc, f"rc={rc} (see {name}.log)")


def forward_costs(doc) -> list:
    """[(M, mlx total / M=1, ours total / M=1 or None, all bitwise)] from verify_cost's rows."""
    rows = doc["rows"]
    Ms = sorted({r["M"] for r in rows})
    tot = {}
    for M in Ms:
        at = [r for r in rows if r["M"] == M]
        mlx = sum(r["mlx_ms"] * r["layers"] for r in at)
        ours = sum(r.get("ours_ms", r["mlx_ms"]) * r["layers"] for r in at)
        ok = all(r.get("bitwise", True) for r in at)
        tot[M] = (mlx, ours if any("ours_ms" in r for r in at) else None, ok)
    one = tot[Ms[0]][0]
    return [(M, m / one, None if o is None else o / one, ok) for M, (m, o, ok) in tot.items()]


def bench_lines(doc) -> list:
    costs = doc["costs"]
    dec = costs["decode_s"]
    curve = ", ".join(f"k={k}: {costs[f'verify{k + 1}_s'] / dec:.2f}"
                      for k in range(1, 9) if f"verify{k + 1}_s" in costs)
    lines = [f"  decode {dec * 1e3:.1f} ms, draft step {costs.get('draft_s', 0) * 1e3:.1f} ms; "
             f"verify(k+1)/decode {curve}"]
    for res in doc["results"]:
        fixed = [r for r in res["rows"] if r["depth"] not in (0, "auto")]
        auto = next((r for r in res["rows"] if r["depth"] == "auto"), None)
        parts = []
        for r in res["rows"]:
            ideal = f" (ideal {r['ideal']:.2f}, {r['ratio_pair_median'] / r['ideal']:.0%} of it)" \
                if r.get("ideal") else ""
            parts.append(f"depth {r['label']} {r['ratio_pair_median']:.2f}x{ideal}")
        lines.append(f"  oracle {res['oracle_rate']}: " + "; ".join(parts))
        if auto and fixed:
            best = max(fixed + [r for r in res["rows"] if r["depth"] == 0],
                       key=lambda r: r["ratio_pair_median"])
            lines.append(f"    auto / best fixed depth ({best['label']}): "
                         f"{auto['ratio_pair_median'] / best['ratio_pair_median']:.0%}")
        lines.append(f"    outputs identical to mlx_lm: {'yes' if not res['mismatches'] else 'NO'}")
    cold = doc.get("cold_start_s") or {}
    if cold:
        lines.append("  cold start s: " + ", ".join(f"{k} {v:.1f}" for k, v in cold.items()))
    return lines


def main(out: str) -> int:
    out = Path(out)
    print(f"== bench/gpu.sh: {out}")
    print(f"kernel tests (tests/test_kernels_cuda.py): {_status(out, 'kernel_tests')}", end="")
    log = out / "kernel_tests.log"
    if log.exists():
        tail = [l for l in log.read_text().splitlines() if re.search(r"passed|failed|error", l)]
        print(f"  {tail[-1].strip() if tail else ''}", end="")
    print()
    for name, what in (("verify_cost_q4", "4-bit"), ("verify_cost_bf16", "bf16")):
        doc = _load(out, name)
        print(f"one forward of M rows / one row, 27B projections + GDN + conv + attention, {what}: "
              f"{_status(out, name)}")
        if doc:
            for M, mlx, ours, ok in forward_costs(doc):
                print(f"  M={M}: MLX's op {mlx:.2f}"
                      + ("" if ours is None else f"   qmv_rows {ours:.2f}")
                      + ("" if ok else "   NOT BITWISE MLX's one-row op"))
    for name, what in (("bench_q4", "27B shapes 4-bit, qmv_rows"),
                       ("bench_q4_mlx_op", "27B shapes 4-bit, MLX's op (MLX_MTP_QMV_ROWS=0)"),
                       ("bench_bf16", "27B shapes bf16"),
                       ("demo_q4", "demo at 4 bits")):
        doc = _load(out, name)
        print(f"bench.py, {what}: {_status(out, name)}")
        if doc:
            for line in bench_lines(doc):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
