"""Collectives and bytes per emitted token on a sharded model: MTP against
mlx_lm's sharded decoding, on the same launch.

    mlx.launch -n 2 --backend ring --python $(which python) bench/dist_bench.py \
        [--model M] [--pipeline] [--max-tokens 64] [--depths 1,2,3]

Two ranks on one machine say nothing about speed across machines; what
decides it there is how many sequential rounds of collectives each emitted
token costs (each pays the link's latency) and how many bytes they move
(each pays its bandwidth). This bench counts them: every call of
mx.distributed's collectives during decoding (after the first token, so the
prompt is not counted) is counted with its payload, decoding eagerly so
every call goes through Python (compiled graphs would call them once, at
trace time). In these models every collective of a forward depends on the
previous one, so calls = sequential rounds. docs/distributed.md turns the
counts into tokens/s for a given link (bench/dist_model.py).
"""

import argparse
import json
import sys
from collections import Counter

import mlx.core as mx

COUNTED = ("all_sum", "all_gather", "send", "recv", "recv_like")


class Counting:
    """Counts calls of mx.distributed's collectives and their payload bytes
    (instrumentation for this bench only)."""

    def __init__(self):
        self.calls, self.bytes = Counter(), Counter()
        self.on = False
        for name in COUNTED:
            fn = getattr(mx.distributed, name)
            setattr(mx.distributed, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            out = fn(*args, **kwargs)
            if self.on:
                self.calls[name] += 1
                self.bytes[name] += out.nbytes
            return out
        return counted

    def reset(self):
        self.calls.clear()
        self.bytes.clear()


def run(gen, counting, n):
    """Decode with counting on after the first token: (tokens, calls, bytes)."""
    tokens = []
    for t, _ in gen:
        tokens.append(int(t))
        if len(tokens) == 1:
            counting.reset()
            counting.on = True
    counting.on = False
    return tokens, sum(counting.calls.values()), sum(counting.bytes.values()), dict(counting.calls)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--pipeline", action="store_true")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--depths", default="1,2,3")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = p.parse_args()
    counting = Counting()

    from mlx_lm.generate import generate_step as lm_generate_step

    import mlx_mtp
    from mlx_mtp.distributed import sharded_load
    from mlx_mtp.stats import MTPStats

    group = mx.distributed.init()
    model, tok = sharded_load(args.model, pipeline_group=group if args.pipeline else None,
                              tensor_group=None if args.pipeline else group)
    prompt = mx.array(tok.encode(args.prompt))
    n = args.max_tokens
    ref, calls, nbytes, kinds = run(lm_generate_step(prompt, model, max_tokens=n), counting, n)
    rows = [dict(method="mlx_lm", depth=0, tokens_per_cycle=1.0,
                 collectives_per_token=calls / (n - 1), bytes_per_token=nbytes / (n - 1),
                 kinds=kinds, identical=True)]
    for depth in [int(d) for d in args.depths.split(",")]:
        stats = MTPStats()
        out, calls, nbytes, kinds = run(mlx_mtp.generate_step(
            prompt, model, max_tokens=n, draft_tokens=depth, compiled=False, stats=stats),
            counting, n)
        rows.append(dict(method="mlx_mtp", depth=depth,
                         tokens_per_cycle=stats.emitted / stats.cycles if stats.cycles else None,
                         collectives_per_token=calls / (n - 1), bytes_per_token=nbytes / (n - 1),
                         kinds=kinds, identical=out == ref))
    if group.rank() == 0:
        mode = "pipeline" if args.pipeline else "tensor"
        print(f"{group.size()} ranks, {mode} parallel, {model.model_path}, {n} tokens "
              "(counted after the first)")
        print("| method | depth | tokens/cycle | collectives/token | bytes/token | "
              "calls by kind | identical to mlx_lm |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            tpc = "-" if r["tokens_per_cycle"] is None else f"{r['tokens_per_cycle']:.2f}"
            print(f"| {r['method']} | {r['depth']} | {tpc} | {r['collectives_per_token']:.1f} | "
                  f"{r['bytes_per_token']:.0f} | {r['kinds']} | {r['identical']} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(mode=mode, ranks=group.size(), rows=rows), f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
