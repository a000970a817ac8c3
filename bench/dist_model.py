"""Tokens/s of a model sharded over machines, from counted collectives (the
model in docs/distributed.md; every input is an assumption printed with it).

    python bench/dist_model.py [--counts tensor.json pipeline.json]

    per token, plain:  t = C + R·λ + B/β
    per cycle, MTP k:  t = C·v(k) + C·k·d + R_k·λ + B_k/β, emitting T(k) tokens

C: compute of one decode step per rank (memory-bound: active weight bytes
per rank / memory bandwidth); v(k): verify(k+1)/decode cost; d: one draft
step / decode; R, B: sequential collective rounds and bytes per token (per
cycle for MTP), λ: link latency per round, β: link bandwidth; T(k) =
1 + a1 + a1·a2 + ...  from acceptances a_i. The counts per layer come from
bench/dist_bench.py on the demo (--counts) and are scaled to the model.
"""

import argparse
import json

# Qwen3.5-397B-A17B-like shape (60 layers: 45 Gated-DeltaNet + 15 attention,
# hidden 4096, untied 248K lm_head), 4-bit weights, on two Macs.
MODEL = dict(name="397B-A17B 4-bit, 2 ranks", layers=60, hidden=4096, act_bytes=2,
             active_gb=17e9 * 4.5 / 8 / 1e9, mem_gbps=400.0)  # ~half of M3 Ultra's 819 GB/s
LINKS = {  # (latency per collective round in µs, bandwidth GB/s): assumptions
    "Thunderbolt 5, JACCL (RDMA)": (10.0, 8.0),
    "Thunderbolt 5, ring (TCP)": (40.0, 4.0),
    "10 GbE, ring (TCP)": (80.0, 1.1),
}
# verify(k+1)/decode for a MoE with 10 of 512 experts per token (each extra
# token mostly reads other experts) and one draft step / decode (one layer +
# the lm_head): assumptions, see docs/distributed.md
VERIFY = {0: 1.0, 1: 1.35, 2: 1.7, 3: 2.05}
DRAFT = 0.05
ACCEPT = {"demo head (measured)": None, "Qwen3.5 head (assumed 0.8/0.6/0.5)": [0.8, 0.6, 0.5]}


def tokens_per_cycle(acc, k):
    t, p = 1.0, 1.0
    for a in acc[:k]:
        p *= a
        t += p
    return t


def rounds(mode, k, layers):
    """Sequential collective rounds per forward (cycle) at depth k (k=0: mlx_lm)."""
    if mode == "tensor":  # an all_sum after attention/GDN and after the MLP per layer,
        # plus the gather of the vocabulary-sharded lm_head; MTP: one more gather
        # per draft step (the replicated head drafts through the sharded lm_head)
        base = 2 * layers + 1 + (k if k else 0)
    else:  # pipeline: the stage's send/recv, then the all_gather of the last hidden
        base = 2
    return base + (2 if k else 0)  # MTP: the drafts and the decision, one all_sum each


def bytes_per_cycle(mode, k, m):
    h = m["hidden"] * m["act_bytes"] * (k + 1)
    if mode == "tensor":
        return (2 * m["layers"]) * h + 248320 // 2 * m["act_bytes"] * (k + 1)  # + logits gather
    return 2 * h


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", nargs="*", default=[],
                   help="bench/dist_bench.py --json outputs (their tokens/cycle are used)")
    args = p.parse_args()
    measured = {}
    for f in args.counts:
        d = json.load(open(f))
        measured[d["mode"]] = {r["depth"]: r["tokens_per_cycle"] for r in d["rows"]}
    m = MODEL
    C = m["active_gb"] / 2 / m["mem_gbps"]  # seconds per decode step per rank
    print(f"{m['name']}: compute per decode step per rank C = {C * 1e3:.2f} ms "
          f"({m['active_gb']:.1f} GB active / 2 ranks / {m['mem_gbps']:.0f} GB/s)")
    for mode in ("tensor", "pipeline"):
        # pipeline: the two stages run one after the other, so a step's wall time is 2·C
        c = C if mode == "tensor" else 2 * C
        print(f"\n{mode} parallel | link | mlx_lm tok/s | " +
              " | ".join(f"MTP k={k}" for k in (1, 2, 3)))
        for link, (lat_us, bw) in LINKS.items():
            lat, bw_b = lat_us * 1e-6, bw * 1e9
            for acc_name, acc in ACCEPT.items():
                if acc is None:
                    if mode not in measured:
                        continue
                    tpc = {k: measured[mode][k] for k in (1, 2, 3)}
                else:
                    tpc = {k: tokens_per_cycle(acc, k) for k in (1, 2, 3)}
                step = c + rounds(mode, 0, m["layers"]) * lat + bytes_per_cycle(mode, 0, m) / bw_b
                base = 1 / step
                cells = []
                for k in (1, 2, 3):
                    t = (c * VERIFY[k] + C * k * DRAFT + rounds(mode, k, m["layers"]) * lat
                         + bytes_per_cycle(mode, k, m) / bw_b)
                    tps = tpc[k] / t
                    cells.append(f"{tps:.1f} ({tps / base:.2f}x)")
                print(f"| {link}, {acc_name} | {base:.1f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
