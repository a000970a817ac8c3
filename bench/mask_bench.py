"""Grammar-mask cost for structured output (mlx_mtp/constraint.py, llguidance).

For each vocabulary and each constraint (a JSON schema, any JSON object, a
regex) a fixed document valid under it is tokenized with that vocabulary's
tokenizer and walked token by token. At every position it times, each on a
fresh matcher walk per round (so every state's mask is computed the first time
in its walk, as in decoding):

  mask          llguidance's mask alone, into a preallocated buffer;
  Matcher.masks our API for one position (adds the draft check and bookkeeping);
  + mx packed   that, then the words to an mx.array, unpacked on the device and
                applied to a logits row (mx.where), evaluated;
  + mx bool     that, with the bits unpacked on the host (numpy) and a bool row
                uploaded instead;
  + mx additive that, with a float32 row of 0 / -inf uploaded and added;
  verify k=3    the 4 masks of a depth-3 verify (the next 3 tokens as drafts),
                consume + rollback;
  batch 4x k=3  4 rows' verify masks in one llguidance executor call (this
                row and three more of the same workload, 1-3 tokens ahead).

Before them, the device side alone: a mask already on the host to masked
logits (packed words uploaded and unpacked in a compiled graph, or a bool row
unpacked on the host and uploaded), beside mx.where with the mask already on
the device, for random bits and for runs of allowed tokens.

Per position the median over rounds; the table gives the mean over positions
and the p50 / p90 / max over positions, in microseconds. The device side is
MLX's CPU backend here (no Metal / CUDA on this machine): those columns say
what an upload and an unpack cost on this CPU, not on a GPU.

Vocabularies: the demo model's (4096 tokens), and a 248,320-token byte-level
BPE (Qwen3.6's vocabulary size; no Qwen tokenizer can be downloaded here)
trained with the `tokenizers` package on the Python stdlib's sources (31 MB)
plus generated words in nine scripts (Latin, Cyrillic, Greek, CJK, kana,
Hangul, Hebrew, Arabic, Devanagari) and numbers, with Qwen's three chat
special tokens; it is trained once (~5 min on one core) and cached at --bpe.

  python bench/mask_bench.py                       # both vocabularies
  python bench/mask_bench.py --vocab demo --rounds 3
  python bench/mask_bench.py --outlines            # outlines-core beside (installed by hand)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

QWEN_VOCAB = 248_320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "units": {"enum": ["metric", "imperial"]},
                "notes": {"type": "string"},
            },
            "required": ["city", "days", "units", "notes"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "get_weather", "arguments": {
    "city": "San Francisco, California", "days": 5, "units": "metric",
    "notes": "The user is planning a hike on Saturday and wants to know about rain."}})
# A bounded string: every length is a lexer state of its own, which defeats
# llguidance's per-state mask cache (docs/design.md, "Structured output").
BOUNDED = json.loads(json.dumps(SCHEMA))
BOUNDED["properties"]["arguments"]["properties"]["notes"]["maxLength"] = 200
SENTENCE = "Yes. The forecast says it will be dry, but it's windy near the coast."
WORKLOADS = [("json_schema", dict(json_schema=SCHEMA), DOCUMENT),
             ("schema maxLen", dict(json_schema=BOUNDED), DOCUMENT),
             ("json_object", dict(json_object=True), DOCUMENT),
             ("regex", dict(regex=r"(Yes|No)\. [A-Za-z ,']+\."), SENTENCE),
             ("regex {1,200}", dict(regex=r"(Yes|No)\. [A-Za-z ,']{1,200}\."), SENTENCE)]


# -- the 248K vocabulary ------------------------------------------------------------

def training_text():
    """The Python stdlib's sources, then generated words in nine scripts."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.rglob("*.py")):
        if "site-packages" not in f.parts:
            yield f.read_text(encoding="utf-8", errors="replace")
    rng = random.Random(0)
    scripts = [(0x61, 26), (0x430, 32), (0x3B1, 25), (0x4E00, 3000), (0x3041, 80),
               (0xAC00, 2000), (0x5D0, 27), (0x627, 28), (0x905, 40)]
    for _ in range(200):
        words = []
        for _ in range(20000):
            base, n = rng.choice(scripts)
            words.append("".join(chr(base + int(rng.paretovariate(1.2)) % n)
                                 for _ in range(rng.randint(1, 8))))
            if rng.random() < 0.1:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
        yield " ".join(words)


def bpe_248k(path: Path):
    """mlx_lm's TokenizerWrapper over a byte-level BPE of QWEN_VOCAB tokens,
    trained into `path` the first time."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not path.exists():
        print(f"training a {QWEN_VOCAB}-token byte-level BPE into {path} (minutes)", flush=True)
        tic = time.perf_counter()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=QWEN_VOCAB, special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(training_text(), trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
        print(f"  {tok.get_vocab_size()} tokens in {time.perf_counter() - tic:.0f} s", flush=True)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    wrapper = TokenizerWrapper(hf, eos_token_ids=[hf.convert_tokens_to_ids("<|im_end|>")])
    assert len(hf) == QWEN_VOCAB, len(hf)
    return wrapper


# -- timing -------------------------------------------------------------------------

def timed(fn) -> float:
    tic = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - tic) / 1e3  # µs


def walk_times(constraint, tok, tokens, rounds, measure):
    """Per position, the median over rounds of measure(matcher, position), each
    round on a fresh matcher walked along `tokens`."""
    per_round = []
    for _ in range(rounds):
        m = constraint.matcher(tok)
        times = []
        for p in range(len(tokens)):
            times.append(measure(m, p))
            m.advance(tokens[p:p + 1])
        per_round.append(times)
    return [statistics.median(col) for col in zip(*per_round)]


def summary(times):
    s = sorted(times)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"mean": statistics.fmean(s), "p50": q(0.5), "p90": q(0.9), "max": s[-1]}


def device_side(vocab, logits, apply_packed, apply_bool, bool_rows, rounds, out):
    """A mask already on the host to masked logits, for 1 and 4 rows: the
    upload and unpack alone, beside mx.where with the mask already on the
    device. Two masks: random bits, and runs of allowed tokens (MLX's CPU
    select is data-dependent)."""
    rng = np.random.default_rng(0)
    width = (vocab + 31) // 32
    runs = np.zeros((4, width), dtype=np.uint32)
    runs[:, width // 50:width // 2] = 0xFFFFFFFF
    masks = {"random": rng.integers(0, 2 ** 32, size=(4, width), dtype=np.uint32), "runs": runs}
    out["device_side_us"] = {}
    print(f"{'device side':12} {'bits':>6} {'rows':>4} {'where only':>11} {'packed':>8} {'bool':>8} "
          f"{'host unpackbits':>16}   (µs, median of {max(rounds, 20)})")
    for kind, words in masks.items():
        on_device = mx.array(bool_rows(words).astype(bool))
        mx.eval(on_device)
        for n in (1, 4):
            cases = {
                "where only": lambda: mx.eval(apply_bool(on_device[:n], logits[:n])),
                "packed": lambda: mx.eval(apply_packed(logits[:n], mx.array(words[:n]))),
                "bool": lambda: mx.eval(apply_bool(mx.array(bool_rows(words[:n]).astype(bool)),
                                                   logits[:n])),
                "host unpackbits": lambda: bool_rows(words[:n]).astype(bool),
            }
            times = {k: statistics.median(timed(f) for _ in range(max(rounds, 20)))
                     for k, f in cases.items()}
            out["device_side_us"][f"{kind} {n}"] = times
            print(f"{'':12} {kind:>6} {n:4} {times['where only']:11.0f} {times['packed']:8.0f} "
                  f"{times['bool']:8.0f} {times['host unpackbits']:16.0f}")


def measure_vocab(label, tok, rounds, results):
    from mlx_mtp.constraint import apply_bitmask, batch_masks, constrain, llg_tokenizer

    vocab = len(tok._tokenizer)
    tic = time.perf_counter()
    llg_tokenizer(tok, vocab)
    build_s = time.perf_counter() - tic
    print(f"\n== {label}: {vocab} tokens; llguidance tokenizer built in {build_s:.2f} s")
    results[label] = {"vocab": vocab, "tokenizer_build_s": build_s, "workloads": {}}
    logits = mx.random.normal((4, vocab))  # one row per verify position (k = 3)
    mx.eval(logits)
    neg_inf = np.float32(-np.inf)
    # In the decoder the mask is applied inside the cycle's compiled graph:
    # every device-side variant here is compiled alike
    apply_packed = mx.compile(apply_bitmask)
    apply_bool = mx.compile(lambda allowed, x: mx.where(allowed, x, -mx.inf))
    apply_additive = mx.compile(lambda add, x: x + add)

    def bool_rows(words):
        return np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[..., :vocab]

    def mask_alone(m, p):
        buf = np.empty(m.words, dtype=np.int32)
        return timed(lambda: m._matcher.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes))

    def api_mask(m, p):
        return timed(lambda: m.masks(()))

    def with_packed(m, p):
        return timed(lambda: mx.eval(apply_packed(logits[:1], mx.array(m.masks(())[0]))))

    def with_bool(m, p):
        return timed(lambda: mx.eval(apply_bool(mx.array(bool_rows(m.masks(())[0]).astype(bool)),
                                                logits[:1])))

    def with_additive(m, p):
        return timed(lambda: mx.eval(apply_additive(mx.array(
            np.where(bool_rows(m.masks(())[0]), np.float32(0), neg_inf)), logits[:1])))

    for _, kwargs, _ in WORKLOADS:  # imports and first-use costs out of the timings
        constrain(**kwargs).matcher(tok).masks([])
    for n in range(1, 5):  # trace the compiled unpack at every row count
        mx.eval(apply_packed(logits[:n], mx.zeros((n, (vocab + 31) // 32), dtype=mx.uint32)))
    for n in range(1, 5):
        mx.eval(apply_bool(mx.zeros((n, vocab), dtype=mx.bool_), logits[:n]),
                apply_additive(mx.zeros((n, vocab)), logits[:n]))
    device_side(vocab, logits, apply_packed, apply_bool, bool_rows, rounds, results[label])
    rows = []
    for name, kwargs, document in WORKLOADS:
        tic = time.perf_counter()
        constraint = constrain(**kwargs)
        compile_ms = (time.perf_counter() - tic) * 1e3
        tokens = tok.encode(document)
        probe = constraint.matcher(tok)
        tic = time.perf_counter()
        constraint.matcher(tok)
        matcher_ms = (time.perf_counter() - tic) * 1e3
        assert probe.allowed_drafts(tokens) == len(tokens), f"{name}: document not allowed"

        def verify(m, p):
            return timed(lambda: m.masks(tokens[p:p + 3]))

        def verify_packed(m, p):
            def run():
                words = m.masks(tokens[p:p + 3])[0]  # fewer rows at the document's end
                mx.eval(apply_packed(logits[:len(words)], mx.array(words)))
            return timed(run)

        def verify_bool(m, p):
            def run():
                allowed = bool_rows(m.masks(tokens[p:p + 3])[0]).astype(bool)
                mx.eval(apply_bool(mx.array(allowed), logits[:len(allowed)]))
            return timed(run)

        staggered = []

        def batch4(m, p):  # this row and 3 more of this workload, 1-3 tokens ahead
            if p == 0:  # a new round: fresh matchers for the other rows
                staggered[:] = [[constraint.matcher(tok), 0] for _ in range(3)]
            rows_ = [(m, tokens[p:p + 3])]
            for ahead, row in enumerate(staggered, 1):
                at = min(p + ahead, len(tokens) - 1)
                row[0].advance(tokens[row[1]:at])
                row[1] = at
                rows_.append((row[0], tokens[at:at + 3]))
            return timed(lambda: batch_masks(rows_, 4))

        columns = [("mask", mask_alone), ("Matcher.masks", api_mask),
                   ("+ mx packed", with_packed), ("+ mx bool", with_bool),
                   ("+ mx additive", with_additive), ("verify k=3", verify),
                   ("verify k=3 + mx packed", verify_packed),
                   ("verify k=3 + mx bool", verify_bool), ("batch 4x k=3", batch4)]
        stats = {column: summary(walk_times(constraint, tok, tokens, rounds, fn))
                 for column, fn in columns}
        # how much the grammar decides: one-token masks (accepted without a
        # forward) and llguidance's fast-forward tokens (drafts to verify)
        m = constraint.matcher(tok)
        single = ff_hits = 0
        allowed_counts = []
        for p, t in enumerate(tokens):
            words = m.masks(())[0]
            n_allowed = int(np.bitwise_count(words).sum())
            allowed_counts.append(n_allowed)
            single += n_allowed == 1
            ff = m.fast_forward_tokens()
            ff_hits += bool(ff) and ff[0] == t
            m.advance([t])
        results[label]["workloads"][name] = {
            "tokens": len(tokens), "compile_ms": compile_ms, "matcher_ms": matcher_ms,
            "one_token_masks": single, "ff_first_token_matches": ff_hits,
            "allowed_median": statistics.median(allowed_counts), "us": stats}
        rows.append((name, len(tokens), compile_ms, matcher_ms, single, ff_hits, stats))

    print(f"{'workload':14} {'what':15} {'mean':>8} {'p50':>8} {'p90':>8} {'max':>8}   (µs)")
    for name, n, compile_ms, matcher_ms, single, ff_hits, stats in rows:
        for i, (column, s) in enumerate(stats.items()):
            column = column.replace("verify k=3 +", "  +")
            print(f"{name if i == 0 else '':14} {column:15} {s['mean']:8.1f} {s['p50']:8.1f} "
                  f"{s['p90']:8.1f} {s['max']:8.1f}")
        print(f"{'':14} {n} tokens; constrain() {compile_ms:.1f} ms, a matcher "
              f"{matcher_ms:.1f} ms; one-token masks at {single}/{n} positions, "
              f"llguidance's ff token = the next token at {ff_hits}/{n}")


def outlines_core_beside(label, tok, results):
    """outlines-core (not a dependency; --outlines) on the same schemas and
    document: its index build, and its mask written into the same buffer."""
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    from mlx_mtp.constraint import llg_tokenizer, stop_token_ids

    vocab = len(tok._tokenizer)
    token_bytes = llg_tokenizer(tok, vocab)  # each token's bytes, decoded once
    special = set(tok._tokenizer.all_special_ids)
    by_bytes = {}
    for i in range(vocab):
        if i not in special:
            by_bytes.setdefault(token_bytes.decode_bytes([i]), []).append(i)
    vocabulary = Vocabulary(stop_token_ids(tok)[0], by_bytes)
    tokens = tok.encode(DOCUMENT)
    out = results[label]["outlines_core"] = {}
    for name, schema in [("json_schema", SCHEMA), ("schema maxLen", BOUNDED)]:
        # the same separators as llguidance's (JSON_OPTIONS): one optional space
        regex = build_regex_from_schema(json.dumps(schema), r"( )?")
        tic = time.perf_counter()
        guide = Guide(Index(regex, vocabulary))
        build_s = time.perf_counter() - tic
        buf = np.zeros((vocab + 31) // 32, dtype=np.int32)
        times = []
        for t in tokens:
            times.append(timed(lambda: guide.write_mask_into(buf.ctypes.data, buf.size, 4)))
            guide.advance(t, return_tokens=False)
        out[name] = {"index_build_s": build_s, "us": summary(times)}
        print(f"outlines-core {name}: index built in {build_s:.2f} s; mask "
              f"p50 {out[name]['us']['p50']:.1f} µs, p90 {out[name]['us']['p90']:.1f} µs, "
              f"max {out[name]['us']['max']:.1f} µs over {len(tokens)} positions (one walk)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", choices=["demo", "248k", "both"], default="both")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bpe", type=Path,
                   default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                   / "mlx_mtp" / "bpe248k.json", help="the 248K tokenizer (trained if missing)")
    p.add_argument("--outlines", action="store_true",
                   help="also time outlines-core (pip install outlines-core) on the schemas")
    p.add_argument("--json", default="bench/results/mask_bench.json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench import machine_info

    import llguidance
    from mlx_lm.utils import load_tokenizer

    from mlx_mtp.constraint import _executor
    from mlx_mtp.loader import DEMO_MODEL_DIR

    info = machine_info()
    info.update(llguidance=llguidance.__version__, load_avg=os.getloadavg())
    print(json.dumps(info))
    _executor()
    results = {"machine": info, "rounds": args.rounds}
    vocabularies = []
    if args.vocab in ("demo", "both"):
        vocabularies.append(("demo", load_tokenizer(DEMO_MODEL_DIR, eos_token_ids=[0, 2])))
    if args.vocab in ("248k", "both"):
        vocabularies.append(("bpe248k", bpe_248k(args.bpe)))
    for label, tok in vocabularies:
        measure_vocab(label, tok, args.rounds, results)
        if args.outlines:
            outlines_core_beside(label, tok, results)
    results["load_avg_after"] = os.getloadavg()
    print(f"\nload average before {info['load_avg']}, after {results['load_avg_after']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
