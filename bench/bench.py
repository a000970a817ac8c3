"""Benchmark mlx_mtp against mlx_lm on one model and one prompt set, in one run.

Rounds alternate mlx_lm's own generation and mlx_mtp at each depth, so both
see the same machine state. Prints tok/s (generation only, prompt excluded),
the ratio to mlx_lm (pooled over all rounds, and per round: median and
min-max, which is what to trust on a noisy shared machine), acceptance per
draft position, tokens per cycle, the measured costs verify(k+1)/decode(1)
and draft-step/decode(1), and for fixed depths k > 0 the ideal ratio
tokens_per_cycle / (verify(k+1)/decode + k * draft/decode) with the achieved
fraction of it ("efficiency"); writes JSON with the machine, MLX version and
the BLAS library actually loaded.

Flags beyond the model/prompt ones:
  --depths 0,1,2,auto   depths to run (mlx_mtp's default pipelined loop)
  --adversarial tokens|head  random-token prompts / a head with random weights
  --draft-vocab N|FILE  trimmed draft vocabulary for all mlx_mtp rows
  --uncompiled          also run the pipelined loop uncompiled, rows "k nocomp"
                        (plain rows: the defaults, pipelined and compiled)
  --sync                also run the synchronous loop (lookahead=False) at each
                        depth, as rows "k sync", in the same rounds
  --rounds N            alternating rounds (default 3)
  --trace               time a few steady-state cycles of one generation
                        (first prompt), pipelined and synchronous: host graph
                        build, async_eval, host blocked in land, land
                        bookkeeping, period; estimates how much host time the
                        device hides; prints an ASCII timeline of one cycle
  --trace-depth K       depth of the trace (default: best fixed depth measured)
  --trace-cycles N      steady-state cycles traced (default 8)
  --trace-repeats N     trace runs of each loop, interleaved (default 3); the
                        median one is shown, the hidden fraction of all
  --json-schema FILE_OR_JSON  structured output instead: constrained MTP at each
                        depth against constrained plain decoding (mlx_lm's
                        generate_step with the same grammar mask), alternated run
                        by run; acceptance per position, JSON validity, and every
                        greedy output equal to the constrained reference's

On Linux CPU use an fp32 model with OpenBLAS preloaded (docs/design.md, "Performance physics"):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python bench/bench.py --model mlx_mtp/demo --depths 0,1,2,3,4 --sync --trace

  python bench/bench.py --synthetic --oracle-rate 0.8   # random weights, oracle drafts
  python bench/bench.py --json-schema schema.json --depths 0,1,2,3,auto
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


_T0 = time.perf_counter()


def progress(msg: str):
    """One line on stderr as each phase starts: a GPU's first-use compiles
    take minutes, and a silent bench looks hung."""
    print(f"[bench +{time.perf_counter() - _T0:.0f}s] {msg}", file=sys.stderr, flush=True)


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


# Qwen3.6-27B's text config: the shapes --synthetic-27b and verify_cost.py use
TEXT_27B = dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408,
                num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                full_attention_interval=4, rms_norm_eps=1e-6, vocab_size=248320,
                tie_word_embeddings=False, mtp_num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                 "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]})


def model_27b(bits: int = 0, tiny: bool = False):
    """A model of Qwen3.6-27B's text shapes (64 layers, hidden 5120, 24/4
    attention heads of 256, GDN 16/48 heads of 128, FFN 17408, vocabulary
    248320, one MTP layer) with random bf16 weights, built in memory: speed
    does not depend on the weights' values, and the oracle drafter supplies
    the acceptance."""
    import mlx.nn as nn
    from mlx_lm.models import qwen3_5

    from mlx_mtp.families.qwen3_5 import Model

    text = dict(TEXT_27B)
    if tiny:  # the same code path at a size this machine holds (a smoke test)
        text.update(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                    num_attention_heads=4, head_dim=64, linear_num_value_heads=16,
                    linear_num_key_heads=4, vocab_size=4096)
    model = Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    # bf16 (A_log stays fp32, as mlx_lm casts); small weights keep activations
    # finite through 64 random layers
    from mlx.utils import tree_flatten, tree_unflatten

    params = [(k, v if k.endswith("A_log") else (v * 0.02 if v.ndim > 1 else v).astype(mx.bfloat16))
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    if bits:
        nn.quantize(model, group_size=64, bits=bits,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.startswith("mtp"))
        nn.quantize(model.mtp, group_size=64, bits=8)
        from mlx_mtp.quantized import use_shared_reads

        use_shared_reads(model)  # as mlx_mtp.load does
    for _, v in tree_flatten(model.parameters()):
        mx.eval(v)
    return model


def synthetic_model(args) -> Path:
    from mlx_mtp.testing.synthetic import write_checkpoint

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
    GDN capture, one head draft step and one head-cache rewrite, at the
    prompt's context length. Caches are rolled back after each call so the
    context stays fixed."""
    from mlx_mtp.cache import CaptureCache

    cache = model.make_cache()
    n_trunk = len(model.is_linear)
    trunk = cache[:n_trunk]
    model.trunk_hidden(mx.array(prompt_ids)[None], trunk)
    mx.eval([c.state for c in trunk])
    trunk = [CaptureCache(c[0], c[1]) if lin else c for c, lin in zip(trunk, model.is_linear)]
    saved = [c.state if lin else None for c, lin in zip(trunk, model.is_linear)]

    def run(T, capture):
        for c in trunk:
            if isinstance(c, CaptureCache):
                c.capturing = capture
        toks = mx.array([prompt_ids[-1]] * T)[None]
        h = model.trunk_hidden(toks, trunk)
        mx.eval(model.logits_from_hidden(h), [c.state for c in trunk])
        for c, s in zip(trunk, saved):
            if s is None:
                c.trim(T)
            else:
                c.state = s

    out = {"decode_s": timed(lambda: run(1, False), reps)}
    for k in depths:
        if k > 0:
            out[f"verify{k + 1}_s"] = timed(lambda k=k: run(k + 1, True), reps)
    if model.has_mtp:
        from mlx_lm.models.cache import KVCache

        hc = [KVCache() for _ in model.mtp.layers]
        h = model.trunk_hidden(mx.array(prompt_ids)[None], None)
        model.mtp(h[:, :-1], model.embed(mx.array(prompt_ids)[None, 1:]), hc)
        mx.eval([c.state for c in hc])
        g = h[:, -1:]

        def draft():
            x = model.mtp(g, model.embed(mx.array([[prompt_ids[-1]]])), hc)
            mx.eval(model.draft_tokens_from_hidden(x[:, -1]))
            for c in hc:
                c.trim(1)

        out["draft_s"] = timed(draft, reps)

        # head-cache rewrite of a depth-k cycle: the head over k+1 verified hiddens
        for k in depths:
            if k > 0:
                hk = h[:, -(k + 1):]
                toks = mx.array(prompt_ids[-(k + 1):])[None]

                def rewrite(hk=hk, toks=toks, k=k):
                    mx.eval(model.mtp(hk, model.embed(toks), hc))
                    for c in hc:
                        c.trim(k + 1)

                out[f"rewrite{k}_s"] = timed(rewrite, reps)
    return out


def warm_auto(model, ids, max_depth):
    """Trace the adaptive loop's graphs at every depth (a scripted controller)."""
    from mlx_mtp.depth import DepthController
    from mlx_mtp.decode import generate_tokens

    class EveryDepth(DepthController):
        def next_depth(self):
            self.cycles += 1
            return (self.cycles - 1) % (max_depth + 1)

    for _ in generate_tokens(mx.array(ids), model, max_tokens=4 * (max_depth + 1) ** 2,
                             draft_tokens="auto", controller=EveryDepth(max_depth)):
        pass


def multi_turn(args, model, ref_model, tok) -> dict:
    """A conversation of args.turns turns over a long first context: each
    turn sends a few new tokens and generates args.max_tokens. Three runs side
    by side, turn by turn: mlx_lm with its prompt cache, mlx_mtp with its
    prompt cache (only the new tokens are prefilled), mlx_mtp without one
    (the whole history prefilled every turn). Greedy; outputs must agree."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_mtp.decode import generate_tokens

    context = Path(args.context_file).read_text() if args.context_file else Path(
        json.__file__).with_name("decoder.py").read_text()
    asks = ["\n\n# A helper for the code above:\ndef ", "\n\n# Tests:\ndef test_",
            "\n\nclass ", "\n\nif __name__ == '__main__':\n    ", "\n\n# Usage:\n"]
    news = [tok.encode(context + asks[0])] + [tok.encode(a) for a in asks[1:]]
    news = (news * args.turns)[:args.turns]

    def timed_gen(gen):
        t0 = time.perf_counter()
        out, t1 = [], None
        for tkn in gen:
            out.append(tkn[0])
            if t1 is None:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        return out, t1 - t0, (len(out) - 1) / max(t2 - t1, 1e-9)

    lm_cache, mtp_cache = make_prompt_cache(ref_model), model.make_cache()
    history, rows = [], []
    for i, new in enumerate(news):
        full = history + new
        r = {"turn": i + 1, "context_tokens": len(full), "new_tokens": len(new)}
        want, r["mlx_lm_ttft"], r["mlx_lm_tps"] = timed_gen(generate_step(
            mx.array(new), ref_model, max_tokens=args.max_tokens, prompt_cache=lm_cache))
        got, r["mtp_ttft"], r["mtp_tps"] = timed_gen(generate_tokens(
            mx.array(new), model, max_tokens=args.max_tokens, prompt_cache=mtp_cache))
        plain, r["nocache_ttft"], r["nocache_tps"] = timed_gen(generate_tokens(
            mx.array(full), model, max_tokens=args.max_tokens))
        r["identical"] = want == got == plain
        rows.append(r)
        history = full + want
    print(f"multi-turn: {len(news)} turns, first context {len(news[0])} tokens, then "
          f"{', '.join(str(len(n)) for n in news[1:])} new tokens per turn, "
          f"{args.max_tokens} generated per turn, greedy, draft_tokens auto")
    print(f"{'turn':>4} {'context':>7} | {'time to first token (s)':^32} | "
          f"{'decode tok/s':^26} | identical")
    print(f"{'':>4} {'':>7} | {'mlx_lm+cache':>12} {'mtp+cache':>9} {'mtp, none':>9} | "
          f"{'mlx_lm':>8} {'mtp+cache':>9} {'mtp, none':>9} |")
    for r in rows:
        print(f"{r['turn']:>4} {r['context_tokens']:>7} | {r['mlx_lm_ttft']:>12.3f} "
              f"{r['mtp_ttft']:>9.3f} {r['nocache_ttft']:>9.3f} | {r['mlx_lm_tps']:>8.1f} "
              f"{r['mtp_tps']:>9.1f} {r['nocache_tps']:>9.1f} | {'yes' if r['identical'] else 'NO'}")
    tot = lambda key: sum(r[key] for r in rows)
    print(f"total time to first token: mlx_lm+cache {tot('mlx_lm_ttft'):.2f} s, "
          f"mtp+cache {tot('mtp_ttft'):.2f} s, mtp without cache {tot('nocache_ttft'):.2f} s; "
          "decode tok/s ratio mtp+cache / mlx_lm, median over turns: "
          f"{statistics.median(r['mtp_tps'] / r['mlx_lm_tps'] for r in rows):.2f}x")
    return {"rows": rows, "identical": all(r["identical"] for r in rows)}


def trace_run(model, ids, k, n_cycles, pipeline: bool) -> tuple:
    """One generation of `n_cycles` cycles at depth k on prompt ids through the
    decode loop (mlx_mtp.decode), which stamps each cycle it reads with
    time.perf_counter(): build0/build1 (graph built), queued (async_eval
    returned), wait0/wait1 (the read), land1 (bookkeeping), yield. In the
    pipelined loop a record's build/queue stamps are of the cycle launched in
    the same iteration (the next one). Returns (records, emitted tokens)."""
    from mlx_mtp.decode import generate_tokens

    recs = []
    gen = generate_tokens(mx.array(ids), model, max_tokens=-1, draft_tokens=k,
                          lookahead=pipeline, timeline=recs)
    out = []
    for tok, _, _ in gen:
        out.append(tok)
        if len(recs) > n_cycles:
            break
    gen.close()
    recs = recs[:n_cycles]
    for r in recs:
        r.setdefault("yield", r["land1"])
    return recs, out


def trace_summary(recs, busy, warm) -> dict:
    """Per-cycle times (s) of the steady-state records (index >= warm, each
    with a predecessor for the period) and the hidden-host-time estimate.
    busy[i] = device time of cycle i measured alone."""
    rows = []
    for i in range(max(warm, 1), len(recs)):
        r, prev = recs[i], recs[i - 1]
        build = r["build1"] - r["build0"]
        queue = r["queued"] - r["build1"]
        blocked = r["wait1"] - r["wait0"]
        land = r["land1"] - r["wait1"]
        yld = r["yield"] - r["land1"]
        period = r["wait1"] - prev["wait1"]  # land to land
        # host work only: the async_eval call is not counted, since on MLX's
        # CPU backend it blocks while many ops are queued (waiting, not work)
        host = build + land + yld
        idle = max(0.0, period - busy[i])
        rows.append(dict(build=build, async_eval=queue, blocked=blocked, land=land,
                         yield_=yld, host=host, period=period, busy=busy[i], idle=idle,
                         accepted=r["accepted"]))
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "accepted"}
    host_sum = sum(r["host"] for r in rows)
    idle_sum = sum(r["idle"] for r in rows)
    hidden = min(1.0, max(0.0, 1.0 - idle_sum / host_sum)) if host_sum > 0 else float("nan")
    return {"median_s": med, "hidden_fraction": hidden, "cycles": rows}


def device_spans(recs, busy, pipelined) -> list:
    """(start, end) of each landed cycle's device work. Synchronous: its eval.
    Pipelined (estimated): the device runs cycles in order, cycle i from when
    its ops are queued (its async_eval starts, in the iteration before it is
    landed) and the previous cycle is done, for its lockstep busy time; its
    end is capped by when the host saw it done (land's wait end)."""
    if not pipelined:
        return [(r["wait0"], r["wait1"]) for r in recs]
    spans = []
    for i, r in enumerate(recs):
        if i == 0:
            end = r["wait1"]
        else:
            end = min(r["wait1"], max(recs[i - 1]["build1"], spans[-1][1]) + busy[i])
        spans.append((max(end - busy[i], spans[-1][1] if spans else -float("inf")), end))
    return spans


def ascii_timeline(rec, spans, pipelined, width=64) -> list:
    """One loop iteration as ms offsets from its graph build start, and bars:
    host  b=graph build  q=async_eval call  W=blocked waiting for the device
          l=land bookkeeping  y=yield  .=other;
    device  = the cycle landed in this iteration, + the next one."""
    t0 = rec["build0"]
    ms = lambda t: (t - t0) * 1e3
    events = [("build start", rec["build0"]), ("build end", rec["build1"])]
    if pipelined:
        events.append(("eval queued (async_eval returned)", rec["queued"]))
    events += [("land wait start", rec["wait0"]),
               ("land wait end (.tolist() returned)", rec["wait1"]),
               ("land end", rec["land1"]), ("tokens yielded", rec["yield"])]
    span = max(rec["yield"] - t0, 1e-9)
    col = lambda t: min(width, max(0, round((t - t0) / span * width)))
    host = ["."] * width
    for a, b, ch in (("build0", "build1", "b"), ("build1", "queued", "q"), ("wait0", "wait1", "W"),
                     ("wait1", "land1", "l"), ("land1", "yield", "y")):
        for c in range(col(rec[a]), col(rec[b])):
            host[c] = ch
    dev = [" "] * width
    for (a, b), ch in zip(spans, "=+"):
        for c in range(col(a), col(b)):
            dev[c] = ch
    lines = [f"    {ms(t):7.2f} ms  {name}" for name, t in events]
    lines.append(f"    host   |{''.join(host)}|  0..{span * 1e3:.2f} ms")
    lines.append(f"    device |{''.join(dev)}|" + ("  (estimated)" if pipelined else ""))
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder / HF repo (default: demo model)")
    p.add_argument("--synthetic", action="store_true", help="random-weight fp32 checkpoint")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--cost-depths", type=str, default="",
                   help="also measure verify(k+1)/decode at these depths, e.g. 1,2,3,4,5,6,7")
    p.add_argument("--synthetic-27b", action="store_true",
                   help="Qwen3.6-27B text shapes with random weights, built in memory (bf16; "
                        "the one model serves as mlx_lm's and mlx_mtp's), random-token prompts")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bits", type=int, default=0,
                   help="with --synthetic-27b: quantize the trunk (4 or 8), head at 8 bits")
    p.add_argument("--oracle-rate", type=str, default=None,
                   help="draft the trunk's own greedy output, right with this probability "
                        "(comma-separated: one table per rate)")
    p.add_argument("--prompts", type=str, default=None, help="file with one prompt per paragraph")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--depths", type=str, default="0,1,2,3,4,auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sync", action="store_true",
                   help="also run the synchronous loop (lookahead=False) at each depth")
    p.add_argument("--adversarial", choices=["tokens", "head"], default=None,
                   help="random-token prompts, or a head with random weights")
    p.add_argument("--draft-vocab", type=str, default=None,
                   help="trimmed draft vocabulary for every mlx_mtp row (N most frequent ids, or a file)")
    p.add_argument("--context-drafts", action="store_true",
                   help="also each depth with context drafts (generate_step(context_drafts=))")
    p.add_argument("--uncompiled", action="store_true",
                   help="also run the pipelined loop without per-depth compilation")
    p.add_argument("--trace", action="store_true",
                   help="time steady-state cycles of one generation, pipelined and synchronous")
    p.add_argument("--trace-depth", type=int, default=None,
                   help="depth of the trace (default: best fixed depth > 0 measured, else 2)")
    p.add_argument("--trace-cycles", type=int, default=8)
    p.add_argument("--trace-repeats", type=int, default=3,
                   help="trace runs per loop (interleaved); the median one is shown")
    p.add_argument("--multi-turn", action="store_true",
                   help="also run a multi-turn conversation with and without the prompt cache")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--context-file", type=str, default=None,
                   help="first turn's context (default: the Python stdlib's json/decoder.py)")
    p.add_argument("--json-schema", type=str, default=None, metavar="FILE_OR_JSON",
                   help="constrained MTP vs constrained plain decoding under this schema")
    p.add_argument("--json", type=str, default="bench/results/bench.json")
    args = p.parse_args(argv)
    constraint = None
    if args.json_schema is not None:
        from mlx_mtp.cli import read_constraint

        try:
            constraint = read_constraint("json_schema", args.json_schema)
        except ValueError as e:
            p.error(f"--json-schema: {e}")

    import mlx_lm
    from mlx_lm.generate import generate_step

    import mlx_mtp
    from mlx_mtp.testing.drafters import OracleDrafter
    from mlx_mtp.decode import generate_tokens
    from mlx_mtp.stats import MTPStats
    from mlx_mtp.loader import resolve_model_path

    rates = [None] if args.oracle_rate is None else [float(r) for r in args.oracle_rate.split(",")]
    cost_depths = [int(d) for d in args.cost_depths.split(",") if d]
    if args.synthetic_27b:
        path = f"in-memory Qwen3.6-27B shapes, random weights, {args.bits or 16}-bit trunk"
        progress(f"building the model: {path}")
        model = model_27b(args.bits, tiny=args.tiny)
        ref_model, tok = model, None  # mlx_lm's generate_step runs on our subclass unchanged
    else:
        path = resolve_model_path(synthetic_model(args) if args.synthetic else args.model)
        model, tok = mlx_mtp.load(path)
        # the baseline is mlx_lm's own loader and generate_step on the same weights
        ref_model, _ = mlx_lm.load(str(path))
    depths = [d if d == "auto" else int(d) for d in args.depths.split(",")]
    fixed = [d for d in depths if d != "auto"]
    # (label, depth, mode): each depth's sync / compiled rows right after its default one
    variants = []
    for k in depths:
        variants.append((str(k), k, "default"))
        if args.sync:
            variants.append((f"{k} sync", k, "sync"))
        if args.uncompiled:
            variants.append((f"{k} nocomp", k, "uncompiled"))
        if args.context_drafts and k != 0:
            variants.append((f"{k} ctx", k, "context"))
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        prompts = [s for s in Path(args.prompts).read_text().split("\n\n") if s.strip()]
    if tok is not None:
        prompt_ids = [tok.encode(s) for s in prompts]
    if tok is None or args.adversarial == "tokens":  # text the head cannot predict
        import random

        rng = random.Random(0)
        V0 = model.vocab_size
        prompt_ids = [[rng.randrange(V0) for _ in range(48)] for _ in prompts]
    if args.adversarial == "head":  # a head that drafts garbage, same cost
        from mlx.utils import tree_flatten, tree_unflatten

        mx.random.seed(0)
        params = [(k, mx.random.normal(v.shape, dtype=v.dtype) * 0.05)
                  for k, v in tree_flatten(model.mtp.parameters())]
        model.mtp.update(tree_unflatten(params))
        mx.eval(model.mtp.parameters())
    V = model.vocab_size
    if constraint is not None:
        return constrained_bench(args, path, model, ref_model, tok, prompts, prompt_ids, depths,
                                 constraint)

    def run_mlx_lm(ids, max_tokens=None):
        t0, out = None, []
        for tkn, _ in generate_step(mx.array(ids), ref_model,
                                    max_tokens=max_tokens or args.max_tokens):
            if t0 is None:
                t0 = time.perf_counter()  # first token = end of prompt processing
            out.append(tkn)
        return out, len(out) - 1, time.perf_counter() - t0

    from mlx_mtp import draft_vocab as dv

    vocab = dv.load(args.draft_vocab, tok, V) if args.draft_vocab else None
    modes = {"default": {}, "sync": dict(lookahead=False),
             "uncompiled": dict(lookahead=True, compiled=False),
             "context": dict(context_drafts=True)}

    def run_mtp(ids, k, ref, mode="default", rate=None):
        stats = MTPStats()
        oracle = OracleDrafter(ref, rate, V) if rate is not None else None
        t0, out = None, []
        for tkn, _, _ in generate_tokens(mx.array(ids), model, max_tokens=args.max_tokens,
                                         draft_tokens=k, stats=stats, drafter=oracle,
                                         draft_vocab=vocab, **modes[mode]):
            if t0 is None:
                t0 = time.perf_counter()
            out.append(tkn)
        return out, len(out) - 1, time.perf_counter() - t0, stats

    # warm-up (allocator; compiled graphs are kept on the model across generations,
    # so every graph the rounds use is traced here: each variant, and auto's at
    # every depth). The first call of each is a cold start: its time to first
    # token includes the backend's first-use compiles, which a user waits for.
    cold = {}

    def first_call(label, fn):
        progress(f"warm-up: {label}")
        t0 = time.perf_counter()
        out = fn()
        cold[label] = time.perf_counter() - t0
        return out

    ref0, _, _ = first_call("mlx_lm", lambda: run_mlx_lm(prompt_ids[0][:8]))
    for lab, k, mode in variants:
        first_call(f"mlx_mtp {lab}", lambda: run_mtp(prompt_ids[0][:8], k, ref0, mode))
    if "auto" in depths and model.has_mtp:
        first_call("auto at every depth", lambda: warm_auto(model, prompt_ids[0][:8], max_depth=4))
    progress("cold start, seconds (first-use compiles included): "
             + ", ".join(f"{lab} {t:.1f}" for lab, t in cold.items()))

    info = machine_info()
    progress("step costs: decode, verify(k+1), draft, rewrite")
    costs = step_costs(model, prompt_ids[0], sorted(set(fixed) | set(cost_depths)))
    dec_s = costs["decode_s"]

    def measure(rate):
        # per round: [tokens, seconds] for mlx_lm and every variant
        labels = ["mlx_lm"] + [v[0] for v in variants]
        per_round = {lab: [[0, 0.0] for _ in range(args.rounds)] for lab in labels}
        # tok/s of every run, in run order: a variant's run is paired with the
        # mlx_lm run right before it (same prompt, adjacent in time)
        pairs = {v[0]: [] for v in variants}
        agg = {v[0]: MTPStats() for v in variants}
        mismatches = {v[0]: 0 for v in variants}
        for r in range(args.rounds):
            for p_i, ids in enumerate(prompt_ids):
                progress(f"rate {rate}: round {r + 1}/{args.rounds}, prompt {p_i + 1}/{len(prompt_ids)}")
                for lab, k, mode in variants:
                    ref, n, dt = run_mlx_lm(ids)
                    per_round["mlx_lm"][r][0] += n
                    per_round["mlx_lm"][r][1] += dt
                    base = n / dt
                    out, n, dt, st = run_mtp(ids, k, ref, mode, rate)
                    pairs[lab].append((n / dt) / base)
                    mismatches[lab] += out != ref
                    per_round[lab][r][0] += n
                    per_round[lab][r][1] += dt
                    agg[lab].add(st)

        def pooled(lab):
            n = sum(x[0] for x in per_round[lab])
            t = sum(x[1] for x in per_round[lab])
            return n / t, t

        dec_s = costs["decode_s"]
        base_tps, _ = pooled("mlx_lm")
        base_round = [n / t for n, t in per_round["mlx_lm"]]
        rows = []
        for lab, k, mode in variants:
            tps, t = pooled(lab)
            rr = [(n / dt) / b for (n, dt), b in zip(per_round[lab], base_round)]
            tpc = agg[lab].tokens_per_cycle
            ideal = eff = None
            if k not in (0, "auto") and f"verify{k + 1}_s" in costs:
                denom = costs[f"verify{k + 1}_s"] / dec_s + k * costs.get("draft_s", 0.0) / dec_s
                ideal = tpc / denom
                eff = (tps / base_tps) / ideal
            rows.append({
                "depth": k, "label": lab, "mode": mode,
                "tok_s": tps, "ratio": tps / base_tps,
                "ratio_rounds": rr, "ratio_median": statistics.median(rr),
                "ratio_pairs": pairs[lab], "ratio_pair_median": statistics.median(pairs[lab]),
                "ratio_min": min(rr), "ratio_max": max(rr),
                "acceptance": agg[lab].acceptance, "tokens_per_cycle": tpc,
                "verify_cost": (costs.get(f"verify{k + 1}_s", dec_s) / dec_s
                                if k != "auto" else float("nan")),
                "ideal": ideal, "efficiency": eff,
                "cycles": agg[lab].cycles,
                "context_drafted": agg[lab].context_drafted,
                "context_accepted": agg[lab].context_accepted,
                "cycle_s": t / agg[lab].cycles if agg[lab].cycles else 0.0,
                "mismatches": mismatches[lab],
            })
        print(f"model: {path}   device: {info['device']}   mlx {info['mlx']}   BLAS: {info['blas']}")
        print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.max_tokens} tokens each, greedy"
              + (f", oracle drafter at rate {rate}" if rate is not None else ""))
        print(f"mlx_lm: {base_tps:.1f} tok/s;  decode {dec_s * 1e3:.2f} ms, "
              f"draft step {costs.get('draft_s', 0) * 1e3:.2f} ms "
              f"({costs.get('draft_s', 0) / dec_s:.2f}x decode)")
        print("each mlx_mtp run follows an mlx_lm run on the same prompt; pairs = median of those "
              "adjacent pairs' tok/s ratios (the figure to quote on a noisy machine); pooled = "
              "total tokens / total time ratio; min-max of the per-round ratios. ideal = tok/cycle / "
              "(verify(k+1)/decode + k*draft/decode); eff = pooled / ideal")
        print(f"{'depth':>9} {'tok/s':>8} {'pairs':>6} {'pooled':>7} {'min-max':>11} "
              f"{'tok/cycle':>9} {'verify(k+1)/decode':>18} {'ideal':>6} {'eff':>5}  "
              "acceptance per position")
        fmt = lambda v, f: "-" if v is None else format(v, f)
        for r in rows:
            acc = " ".join(f"{a:.2f}" for a in r["acceptance"]) or "-"
            mm = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
            print(f"{r['label']:>9} {r['tok_s']:>8.1f} {r['ratio_pair_median']:>5.2f}x {r['ratio']:>6.2f}x "
                  f"{mm:>11} {r['tokens_per_cycle']:>9.2f} {r['verify_cost']:>18.2f} "
                  f"{fmt(r['ideal'], '.2f'):>6} {fmt(r['efficiency'], '.2f'):>5}  {acc}")
        if any(r["mode"] == "context" for r in rows):
            print("per source (context runs vs the head's drafts, drafted / accepted):")
            for r in rows:
                if r["mode"] == "context":
                    st = agg[r["label"]]
                    print(f"{r['label']:>9} context {st.context_accepted}/{st.context_drafted}, "
                          f"head {st.accepted - st.context_accepted}/"
                          f"{st.drafted - st.context_drafted}; {st.tokens_per_cycle:.2f} "
                          f"tokens per cycle")
        fixed_rows = [r for r in rows if r["mode"] == "default" and r["depth"] != "auto"]
        auto_row = next((r for r in rows if r["mode"] == "default" and r["depth"] == "auto"), None)
        if auto_row and fixed_rows:
            best = max(fixed_rows, key=lambda r: r["ratio_pair_median"])
            print(f"auto / best fixed depth ({best['depth']}), pair medians: "
                  f"{auto_row['ratio_pair_median'] / best['ratio_pair_median']:.1%}")
        if model.has_mtp:
            print("where a cycle's time goes (ms; stage costs measured alone, host = the rest):")
            print(f"{'depth':>9} {'cycle':>7} {'draft':>7} {'verify':>7} {'rewrite':>8} {'host+sync':>9}")
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
                print(f"{r['label']:>9} {b['cycle']:>7.2f} {b['draft']:>7.2f} {b['verify']:>7.2f} "
                      f"{b['rewrite']:>8.2f} {b['host']:>9.2f}")
        bad = {lab: m for lab, m in mismatches.items() if m}
        print("outputs identical to mlx_lm: " + ("yes" if not bad else
              f"NO ({sum(bad.values())} differ: "
              + ", ".join(f"{lab}: {m}" for lab, m in bad.items()) + ")"))
        return {"oracle_rate": rate, "mlx_lm_tok_s": base_tps, "mlx_lm_tok_s_rounds": base_round,
                "rows": rows, "mismatches": sum(bad.values())}


    results = [measure(rate) for rate in rates]
    print("cold start (first generation of an 8-token prompt, first-use compiles included), s: "
          + ", ".join(f"{lab} {t:.1f}" for lab, t in cold.items()))
    rows = results[0]["rows"]
    n_bad = sum(r["mismatches"] for r in results)
    if len(cost_depths) > 0:
        print("verify cost curve (one forward of k+1 tokens with GDN capture / one decode): "
              + ", ".join(f"k={k}: {costs[f'verify{k + 1}_s'] / dec_s:.2f}"
                          for k in sorted(cost_depths) if k > 0))

    turns = None
    if args.multi_turn and tok is not None:
        turns = multi_turn(args, model, ref_model, tok)
        n_bad += not turns["identical"]

    trace = None
    if args.trace:
        trace = run_trace(args, model, prompt_ids[0], rows, run_mlx_lm)
        n_bad += not trace["identical_to_mlx_lm"]

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "machine": info, "model": str(path), "prompts": len(prompts), "rounds": args.rounds,
            "max_tokens": args.max_tokens, "results": results,
            "costs": costs, "cold_start_s": cold, "trace": trace, "multi_turn": turns,
            "command": " ".join([sys.executable] + sys.argv),
        }, indent=1))
        print(f"wrote {args.json}")
    return 0 if n_bad == 0 else 1


def constrained_bench(args, path, model, ref_model, tok, prompts, prompt_ids, depths,
                      constraint) -> int:
    """--json-schema: constrained MTP at each depth against constrained plain
    decoding (mlx_lm's generate_step with the grammar's mask, the reference
    tests/test_structured.py compares with), each MTP run right after a
    reference run on the same prompt. Prints tok/s, the median of those
    pairs' ratios, the pooled ratio, tokens per cycle, acceptance per draft
    position, how many outputs are complete valid JSON, and whether every
    output equals the reference's."""
    import jsonschema
    from mlx_lm.generate import generate_step as lm_step

    import mlx_mtp
    from mlx_mtp.stats import MTPStats
    from mlx_mtp.constraint import MaskingProcessor

    schema = json.loads(constraint.source)
    eos = set(tok.eos_token_ids)

    def timed(steps):
        """(tokens before EOS, finish, seconds from the first token)."""
        t0, out, finish = None, [], "length"
        for token, _ in steps:
            if t0 is None:
                t0 = time.perf_counter()  # first token = end of prompt processing
            if token in eos:
                finish = "stop"
                break
            out.append(token)
        return out, finish, time.perf_counter() - t0

    def plain(ids):
        return timed(lm_step(mx.array(ids), ref_model, max_tokens=args.max_tokens,
                             logits_processors=[MaskingProcessor(constraint, tok)]))

    def mtp(ids, k, stats):
        return timed(mlx_mtp.generate_step(mx.array(ids), model, max_tokens=args.max_tokens,
                                           draft_tokens=k, constraint=constraint, tokenizer=tok,
                                           stats=stats))

    def valid(tokens, finish):
        if finish != "stop":
            return False
        try:
            jsonschema.validate(json.loads(tok.decode(tokens)), schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    labels = [str(k) for k in depths]
    plain(prompt_ids[0][:8])  # warm-up: allocator, every depth's graphs
    for k in depths:
        mtp(prompt_ids[0][:8], k, MTPStats())
    per = {lab: {"pairs": [], "tokens": 0, "seconds": 0.0, "base_tokens": 0, "base_seconds": 0.0,
                 "stats": MTPStats(), "same": 0, "valid": 0, "runs": 0} for lab in labels}
    plain_valid = plain_runs = 0
    for _ in range(args.rounds):
        for ids in prompt_ids:
            for lab, k in zip(labels, depths):
                ref, finish, dt = plain(ids)
                plain_valid += valid(ref, finish)
                plain_runs += 1
                st = MTPStats()
                out, mfinish, mdt = mtp(ids, k, st)
                r = per[lab]
                n, m = max(len(ref) - 1, 1), max(len(out) - 1, 1)  # (after the first token)
                r["pairs"].append((m / mdt) / (n / dt))
                r["base_tokens"] += n
                r["base_seconds"] += dt
                r["tokens"] += m
                r["seconds"] += mdt
                r["same"] += (out, mfinish) == (ref, finish)
                r["valid"] += valid(out, mfinish)
                r["runs"] += 1
                r["stats"].add(st)
    base_tps = sum(r["base_tokens"] for r in per.values()) / sum(
        r["base_seconds"] for r in per.values())
    info = machine_info()
    print(f"model: {path}   device: {info['device']}   mlx {info['mlx']}   BLAS: {info['blas']}")
    given = args.json_schema if len(args.json_schema) < 60 else args.json_schema[:57] + "..."
    print(f"structured output: JSON schema {given}")
    print(f"{len(prompts)} prompts x {args.rounds} rounds, at most {args.max_tokens} tokens, "
          "greedy; each mlx_mtp run follows a constrained plain run (mlx_lm's generate_step "
          "with the same mask) on the same prompt")
    print(f"constrained plain decoding: {base_tps:.1f} tok/s; complete valid JSON "
          f"{plain_valid}/{plain_runs}")
    print("pairs = median of adjacent pairs' tok/s ratios; pooled = total tokens / total time "
          "ratio (both against constrained plain decoding); forced = drafts the grammar forced; "
          "jumps = cycles that verified a forced run alone (no head draft)")
    print(f"{'depth':>6} {'tok/s':>8} {'pairs':>6} {'pooled':>7} {'tok/cycle':>9} "
          f"{'forced':>7} {'jumps':>6} {'valid':>7} {'same':>7}  acceptance per position")
    rows = []
    for lab, k in zip(labels, depths):
        r = per[lab]
        tps = r["tokens"] / r["seconds"]
        pooled = tps / (r["base_tokens"] / r["base_seconds"])
        acc = r["stats"].acceptance
        rows.append({"depth": k, "tok_s": tps, "ratio_pair_median": statistics.median(r["pairs"]),
                     "ratio_pooled": pooled, "ratio_pairs": r["pairs"],
                     "tokens_per_cycle": r["stats"].tokens_per_cycle, "acceptance": acc,
                     "forced_drafts": r["stats"].forced, "jumps": r["stats"].jumps,
                     "valid": r["valid"], "same": r["same"], "runs": r["runs"]})
        print(f"{lab:>6} {tps:>8.1f} {rows[-1]['ratio_pair_median']:>5.2f}x {pooled:>6.2f}x "
              f"{r['stats'].tokens_per_cycle:>9.2f} {r['stats'].forced:>7} {r['stats'].jumps:>6} "
              f"{r['valid']:>3}/{r['runs']:<3} "
              f"{r['same']:>3}/{r['runs']:<3}  " + (" ".join(f"{a:.0%}" for a in acc) or "-"))
    same = all(r["same"] == r["runs"] for r in rows)
    print("outputs identical to constrained plain decoding: " + ("yes" if same else "NO"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "machine": info, "model": str(path), "schema": schema, "prompts": len(prompts),
            "rounds": args.rounds, "max_tokens": args.max_tokens,
            "constrained_plain_tok_s": base_tps, "plain_valid": plain_valid,
            "plain_runs": plain_runs, "rows": rows,
            "command": " ".join([sys.executable] + sys.argv)}, indent=1))
        print(f"wrote {args.json}")
    return 0 if same else 1


def run_trace(args, model, ids, rows, run_mlx_lm) -> dict:
    """The --trace section: pipelined and synchronous runs of one generation
    at one depth; prints per-cycle medians and one cycle's timeline."""
    k = args.trace_depth
    if k is None:
        cand = [r for r in rows if r["mode"] == "default" and r["depth"] not in (0, "auto")]
        k = max(cand, key=lambda r: r["tok_s"])["depth"] if cand else 2
    if not model.has_mtp:
        k = 0
    warm = 3
    n = warm + args.trace_cycles + 1  # +1: the first steady cycle needs a predecessor
    ref, _, _ = run_mlx_lm(ids, n * (k + 1) + 2)
    modes = ("pipelined", "sync")
    reps = []  # per repeat: the three runs back to back, so they share machine state
    for _ in range(max(1, args.trace_repeats)):
        reps.append({m: trace_run(model, ids, k, n, m == "pipelined") for m in modes})
    identical = all(out == ref[:len(out)] for runs in reps for _, out in runs.values())
    acc = {m: [r["accepted"] for r in reps[0][m][0]] for m in modes}
    same_cycles = all([r["accepted"] for r in runs[m][0]] == acc["pipelined"]
                      for runs in reps for m in modes)
    summaries = []
    for runs in reps:
        # a synchronous cycle's device time: its async_eval call (on MLX's CPU
        # backend that runs most of the work) plus the wait in its read
        busy_sync = [r["queued"] - r["build1"] + r["wait1"] - r["wait0"] for r in runs["sync"][0]]
        busy_lock = busy_sync
        if not same_cycles:  # cycles differ: compare medians instead of cycle by cycle
            busy_lock = [statistics.median(busy_lock)] * n
        summaries.append(({"pipelined": trace_summary(runs["pipelined"][0], busy_lock, warm),
                           "sync": trace_summary(runs["sync"][0], busy_sync, warm)},
                          {"pipelined": busy_lock, "sync": busy_sync}))
    # show the repeat whose pipelined steady-state time is the median one
    total = lambda sm: sum(c["period"] for c in sm[0]["pipelined"]["cycles"])
    order = sorted(range(len(reps)), key=lambda j: total(summaries[j]))
    pick = order[len(order) // 2]
    runs = reps[pick]
    summ, busy_of = summaries[pick]
    hidden_all = {m: [sm[0][m]["hidden_fraction"] for sm in summaries] for m in summ}

    print(f"trace: depth {k}, first prompt, {args.trace_cycles} steady-state cycles "
          f"(after {warm}), {len(reps)} repeats (shown: the median one, #{pick + 1}); "
          "medians per cycle, ms:")
    print(f"{'loop':>10} {'build':>6} {'a_eval':>6} {'land':>6} {'yield':>6} {'host':>6} "
          f"{'blocked':>7} {'period':>7} {'dev busy':>8} {'dev idle':>8} {'hidden':>6}")
    for m, sm in summ.items():
        d = {key: v * 1e3 for key, v in sm["median_s"].items()}
        print(f"{m:>10} {d['build']:>6.2f} {d['async_eval']:>6.2f} {d['land']:>6.2f} "
              f"{d['yield_']:>6.2f} {d['host']:>6.2f} {d['blocked']:>7.2f} {d['period']:>7.2f} "
              f"{d['busy']:>8.2f} {d['idle']:>8.2f} {sm['hidden_fraction']:>6.2f}")
    print("  host = graph build (launch) + land bookkeeping after the read + yield; "
          "blocked = host waiting in land's read (device time not overlapped); "
          "period = land to land")
    print("  a_eval = the mx.async_eval call, not counted as host work: on MLX's CPU backend "
          "it blocks while many ops are queued, so there it is mostly waiting too")
    print("  dev busy = the same cycle's device time in the synchronous run (its async_eval "
          "call plus its read's wait); "
          "dev idle = max(0, period - dev busy); hidden = 1 - sum(dev idle) / sum(host)")
    print("  caveat: on the CPU backend host and 'device' share the cores, so busy measured "
          "alone may be lower than when overlapped (hidden is then underestimated)")
    if args.oracle_rate is not None:
        print("  note: the trace drafts with the model's own head (it takes no oracle), so its "
              "acceptance is not the oracle's")
    for m, hs in hidden_all.items():
        print(f"  hidden fraction over the repeats, {m}: " + " ".join(f"{h:.2f}" for h in hs))
    if not same_cycles:
        print("  note: accepted counts differ between the traced runs; used median device time")
    print(f"  trace outputs identical to mlx_lm: {'yes' if identical else 'NO'}")
    timelines = {}
    for m in ("pipelined", "sync"):
        recs = runs[m][0]
        steady = list(range(max(warm, 1), len(recs)))
        periods = {i: recs[i]["wait1"] - recs[i - 1]["wait1"] for i in steady}
        order = sorted(steady, key=periods.get)
        i = order[len(order) // 2]  # the cycle of median period
        busy = busy_of[m]
        spans = device_spans(recs, busy, m == "pipelined")
        lines = ascii_timeline(recs[i], spans[i:i + 2], m == "pipelined")
        print(f"  {m}: one loop iteration (cycle {i}, median period), from its build start:")
        print("\n".join(lines))
        t0 = recs[i]["build0"]
        timelines[m] = {"cycle": i, **{key: (v - t0) * 1e3 for key, v in recs[i].items()
                                       if key != "accepted"}}
    print("    host: b build, q async_eval, W blocked in land, l land bookkeeping, y yield; "
          "device: = the cycle landed in this iteration, + the next one; pipelined (estimated): "
          "in order, each from when it is queued and the previous is done, for its dev busy "
          "time, ending no later than the host saw it done")
    return {
        "depth": k, "warm_cycles": warm, "cycles": args.trace_cycles, "repeats": len(reps),
        "shown_repeat": pick, "identical_to_mlx_lm": identical, "same_cycles": same_cycles,
        "accepted": acc["pipelined"],
        "hidden_fraction_repeats": hidden_all,
        "device_busy_s": busy_of,
        "pipelined": summ["pipelined"], "sync": summ["sync"],
        "timeline_ms": timelines,
        "raw_s": {m: [{key: (v - recs[0]["build0"]) if key != "accepted" else v
                       for key, v in r.items()} for r in recs]
                  for m, (recs, _) in runs.items()},
    }

if __name__ == "__main__":
    sys.exit(main())
