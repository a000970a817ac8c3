"""One rank of tests/test_distributed.py (run by `mlx.launch -n 2 --backend ring`).

    worker.py MODEL {tensor,pipeline} PLAN.json OUT.json

Loads this rank's share with `mlx_mtp.sharded_load` and decodes what PLAN
asks: mlx_lm's own generate_step on the sharded model (its sharded
decoding), MTP greedy at each depth (one batch of all prompts, drafts from a
bigram table built from known continuations, so rows accept partially), MTP
with the model's own head, seeded sampling, and two turns on one prompt
cache (and, with "mixed_turns", an mlx_lm turn between two MTP ones). With
"drafts_differ", the ranks whose bigram drafts are not the ones verified (all
but rank 0, tensor parallel; all but the first stage, pipeline) draft other
tokens, as ranks computing unequal floats could. Rank 0 writes the tokens to
OUT; every rank must finish.
"""

import json
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step as lm_generate_step

import mlx_mtp
from mlx_mtp.cache import head_caches
from mlx_mtp.distributed import first_stage, sharded_load
from mlx_mtp.testing.drafters import BigramDrafter
from mlx_mtp.batch import make_batch
from mlx_mtp.decode import decode_rows



def batch_tokens(model, prompts, n, depth, drafter):
    batch = make_batch(model, draft_tokens=depth, drafter=drafter)
    requests = [batch.prepare(p, None, n, None) for p in prompts]
    got, accepted = [[] for _ in prompts], 0
    for i, ev in decode_rows(batch, requests, len(prompts)):
        got[i].append(ev.token)
        accepted += bool(ev.from_draft)
    return got, accepted


def mixed_turns(model, prompts, n):
    """Three turns on one prompt cache: MTP, then mlx_lm (the trunk moves on
    without the head), then MTP sampling. Returns the tokens and the length
    of the head's cache at the end."""
    cache = model.make_cache()
    first = [int(t) for t, _ in mlx_mtp.generate_step(
        mx.array(prompts[0]), model, max_tokens=n, draft_tokens=2, prompt_cache=cache)]
    second = [int(t) for t, _ in lm_generate_step(mx.array(prompts[1]), model, max_tokens=n,
                                                  prompt_cache=cache)]
    third = [int(t) for t, _ in mlx_mtp.generate_step(
        mx.array(prompts[2]), model, max_tokens=n, draft_tokens=2, prompt_cache=cache,
        sampler=mlx_mtp.make_sampler(1.0, top_p=0.95), seed=7)]
    return [first, second, third], head_caches(cache, len(model.is_linear))[0].offset


def main():
    path, mode, plan_file, out_file = sys.argv[1:5]
    group = mx.distributed.init()
    plan = json.loads(open(plan_file).read())
    model, tok = sharded_load(path, pipeline_group=group if mode == "pipeline" else None,
                              tensor_group=group if mode == "tensor" else None,
                              ngram_tables=plan.get("ngram_tables", "auto"))
    prompts, n = plan["prompts"], plan["max_tokens"]
    t0 = time.perf_counter()
    mark = lambda what: print(f"rank {group.rank()}: {what} at {time.perf_counter() - t0:.1f} s",
                              flush=True)
    out = {"mlx_lm": [[int(t) for t, _ in lm_generate_step(mx.array(p), model, max_tokens=n)]
                      for p in prompts]}
    mark("mlx_lm")
    drafter = BigramDrafter(plan["continuations"], model.vocab_size)
    source = first_stage(model)  # the rank whose drafts are verified
    if plan.get("drafts_differ") and group.rank() != (0 if source is None else source):
        drafter = BigramDrafter([], model.vocab_size)  # each draft wrong
    for depth in plan["depths"]:
        out[f"bigram_{depth}"], out[f"bigram_{depth}_accepted"] = batch_tokens(
            model, prompts, n, depth, drafter)
    mark("bigram batches")
    for depth in plan["head_depths"]:
        out[f"head_{depth}"] = [[int(t) for t, _ in mlx_mtp.generate_step(
            mx.array(p), model, max_tokens=n, draft_tokens=depth)] for p in prompts]
    mark("head")
    sampler = mlx_mtp.make_sampler(1.0, top_p=0.95)
    out["sampled"] = [[int(t) for t, _ in mlx_mtp.generate_step(
        mx.array(p), model, max_tokens=n, draft_tokens=2, sampler=sampler, seed=7)]
        for p in prompts]
    mark("sampled")
    cache = model.make_cache()
    turns = []
    for p in prompts[:2]:
        turns.append([int(t) for t, _ in mlx_mtp.generate_step(
            mx.array(p), model, max_tokens=n, draft_tokens=2, prompt_cache=cache)])
    out["turns"] = turns
    out["host_lookups"] = model.host_lookups  # (n-gram tables read from disk)
    mark("turns")
    if plan.get("mixed_turns"):
        out["mixed_turns"], head_length = mixed_turns(model, prompts, n)
        # every rank's: the heads must stay alike (rank 0 accepts the first
        # stage's drafts with its own head's probabilities)
        out["mixed_head_lengths"] = mx.distributed.all_gather(
            mx.array([head_length]), group=group).tolist()
        mark("mixed turns")
    if group.rank() == 0:
        with open(out_file, "w") as f:
            json.dump(out, f)
    print(f"rank {group.rank()} done", flush=True)


if __name__ == "__main__":
    main()
