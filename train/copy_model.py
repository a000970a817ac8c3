"""Train the copy model: a tiny Qwen3.5-architecture model with its MTP head
that copies spans of its context (induction), to measure context drafts with
(issue 63, item 5). Not the README's demo (that is mlx_mtp/demo).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        nice -n 10 python -m train.copy_model --out runs/copy --ship mlx_mtp/testing/copy_model

Data: edit-style documents built from the standard library's files (the
demo's split, train/data.py): a window of a file, then aider-style
SEARCH/REPLACE blocks whose SEARCH part repeats a span of the window verbatim
and whose REPLACE part is that span with a small change (a name renamed, a
line dropped, a line added). Repeating a span needs copying: the model learns
induction, which plain stdlib text trains far too slowly on this CPU
(train/README.md, "Teaching it to copy"). `--random-share` of the documents
edit a made-up file of random names instead (`random_source`), where only
the earlier occurrence predicts a span: that started induction within
minutes. The trunk's loss weighs the blocks 1 and the file window
`--file-weight`. Tokenizer: the demo's. Training, export and the reload
check are train/train.py's (`losses`, `build_model`, train/export.py);
`python -m train.copy_model measure FOLDER` scores copying on held-out files
(`measure`). So far (train/README.md, "The copy model") 129 CPU minutes
reached 94% teacher-forced top-1 on held-out spans but 21% of their
characters copied greedily: nothing is shipped, and the best weights are
train/copy_model_partial.safetensors.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from . import data

SEARCH, DIVIDER, REPLACE = "<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"

# Small enough to train in ~15 minutes on 2 CPU cores and ship as a few MB:
# one Gated-DeltaNet layer (its short conv gives the previous-token feature
# induction needs) under each gated-attention layer (the head that copies).
COPY_TEXT_CONFIG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,  # GDN, attention, GDN, attention
    full_attention_interval=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=64,
    max_position_embeddings=2048,
)


def _window(lines: List[str], rng: random.Random, max_chars: int) -> List[str]:
    """Contiguous lines from a random start, at most max_chars in all."""
    a = rng.randrange(max(1, len(lines) - 8))
    out, n = [], 0
    for line in lines[a:]:
        if n + len(line) + 1 > max_chars and len(out) >= 4:
            break
        out.append(line[:200])
        n += len(out[-1]) + 1
    return out


def _span(window: List[str], rng: random.Random, lo: int, hi: int) -> Tuple[int, int]:
    """[i, j): 2-hi lines of the window starting at a non-blank line."""
    starts = [i for i, l in enumerate(window[:-1]) if l.strip()] or [0]
    i = rng.choice(starts)
    j = min(len(window), i + rng.randint(lo, hi))
    return i, j


def _changed(span: List[str], rng: random.Random, words: List[str]) -> List[str]:
    """The span with one small edit: a name renamed throughout, a line
    dropped, or a line added after one of its lines."""
    import re

    kind = rng.random()
    names = sorted({m for l in span for m in re.findall(r"\b[A-Za-z_]\w{2,}\b", l)})
    if kind < 0.5 and names:
        old = rng.choice(names)
        new = "_".join(rng.sample(words, rng.randint(1, 2)))
        pat = re.compile(r"\b" + re.escape(old) + r"\b")
        return [pat.sub(new, l) for l in span]
    k = rng.randrange(len(span))
    if kind < 0.75 and len(span) > 1:
        return span[:k] + span[k + 1:]
    indent = span[k][: len(span[k]) - len(span[k].lstrip())]
    added = indent + "# " + " ".join(rng.sample(words, rng.randint(2, 5)))
    return span[: k + 1] + [added] + span[k + 1:]


@dataclass(frozen=True)
class EditDocument:
    text: str
    copy_from: int  # characters before this are the file window (weighed --file-weight)


def edit_document(rel: str, source: str, rng: random.Random, words: List[str],
                  max_file_chars: int = 1100, blocks: Tuple[int, int] = (1, 3),
                  span_lines: Tuple[int, int] = (2, 14)) -> Optional[EditDocument]:
    """A file window, then SEARCH/REPLACE blocks editing spans of it."""
    lines = source.split("\n")
    if len(lines) < 12:
        return None
    window = _window(lines, rng, max_file_chars)
    head = f"{rel}\n```python\n" + "\n".join(window) + "\n```\n\n"
    parts = []
    for _ in range(rng.randint(*blocks)):
        i, j = _span(window, rng, *span_lines)
        span = window[i:j]
        parts.append(f"{rel}\n```python\n{SEARCH}\n" + "\n".join(span) + f"\n{DIVIDER}\n"
                     + "\n".join(_changed(span, rng, words)) + f"\n{REPLACE}\n```\n")
    return EditDocument(head + "\n".join(parts), len(head))


def search_prompt(rel: str, window: List[str], i: int, given_lines: int = 1,
                  span_lines: int = 10) -> Tuple[str, str]:
    """(prompt, target): the file window, then the start of a SEARCH block
    that gives the window's lines [i, i + given_lines); the target is the
    next `span_lines` lines, as the window has them. The prompt ends at the
    given line's end, not after its newline: byte-level BPE merges a newline
    with the next line's indentation, so a prompt that ends in one would
    split a token the model only saw whole."""
    prompt = (f"{rel}\n```python\n" + "\n".join(window) + "\n```\n\n"
              + f"{rel}\n```python\n{SEARCH}\n" + "\n".join(window[i:i + given_lines]))
    return prompt, "".join("\n" + l for l in window[i + given_lines: i + given_lines + span_lines])


def edit_prompt(rel: str, source: str, rng: random.Random, max_file_chars: int = 1100,
                span_lines: int = 10, given_lines: int = 1):
    """`search_prompt` on a random window of a file and a random span of it
    (starting at a non-blank line, its target not blank); None when the
    window is too short."""
    window = _window(source.split("\n"), rng, max_file_chars)
    starts = [i for i in range(len(window) - given_lines - span_lines + 1)
              if window[i].strip()
              and "\n".join(window[i + given_lines: i + given_lines + span_lines]).strip()]
    if not starts:
        return None
    return search_prompt(rel, window, rng.choice(starts), given_lines, span_lines)


def random_source(rng: random.Random, words: List[str], n_lines: int = 40,
                  pool: Optional[Tuple[int, int]] = None) -> str:
    """A made-up Python file of random names and numbers: nothing but an
    earlier occurrence predicts a span of it, so edit documents over it
    teach copying (induction) alone, and fast (train/README.md, "The copy
    model"). With `pool` (LO,HI) each file draws from its own LO-HI words
    and a few numbers, so most tokens recur and a span is found by the
    tokens before it, not by one rare token; None: from all the words."""
    names = rng.sample(words, rng.randint(*pool)) if pool else words

    def name():
        return "_".join(rng.sample(names, rng.randint(1, 2)))

    def line(ind):
        a, b, c = name(), name(), name()
        n = rng.choice((0, 1, 2, 10, 100, rng.randrange(1000))) if pool else rng.randrange(1000)
        return ind + rng.choice([
            f"{a} = {b}({c}, {n})", f"def {a}({b}, {c}={n}):", f"return {a}.{b}",
            f"# {a} {b} {c}", f"if {a} > {n}:", f"{a}.{b}('{c}')", f"{a}[{n}] = {b}.{c}",
            f"class {a.title().replace('_', '')}({b}):", f"for {a} in {b}({c}):"])

    return "\n".join(line(" " * 4 * rng.randint(0, 2)) for _ in range(n_lines))


def batches(docs, tok, words, seed, B: int, T: int, file_weight: float,
            file_chars: Tuple[int, int] = (1100, 1100), blocks: Tuple[int, int] = (1, 3),
            random_share: float = 0.0, span_lines: Tuple[int, int] = (2, 14),
            made_up_pool: Optional[Tuple[int, int]] = None):
    """Endless (tokens [B, T], weights [B, T-1]) of packed edit documents,
    each row starting at a document; a pure function of the seed. A
    `random_share` of the documents edit a `random_source` instead of a file."""
    rng = random.Random(seed)
    eot = tok.token_to_id("<|endoftext|>")
    while True:
        xs, ws = [], []
        for _ in range(B):
            ids: List[int] = []
            wts: List[float] = []
            while len(ids) < T:
                if rng.random() < random_share:
                    rel, src = "made_up.py", random_source(rng, words, pool=made_up_pool)
                else:
                    rel, src = docs[rng.randrange(len(docs))]
                d = edit_document(rel, src, rng, words, rng.randint(*file_chars), blocks, span_lines)
                if d is None:
                    continue
                enc = tok.encode(d.text)
                ids += enc.ids + [eot]
                # a token's weight as a target: is it in the window or the blocks
                wts += [file_weight if end <= d.copy_from else 1.0 for _, end in enc.offsets] + [1.0]
            xs.append(ids[:T])
            ws.append(wts[1:T])
        yield np.array(xs, np.int32), np.array(ws, np.float32)


def train(args) -> int:
    from .export import export_hf, ship, verify_reload
    from .train import DEFAULT_TEXT_CONFIG, _read_tokenizer, build_model, full_config, log, \
        losses, lr_at, n_params

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "train.log", "a")
    log(f"args: {vars(args)}", logf)
    mx.random.seed(args.seed)
    train_docs, held_docs = data.split_corpus()
    words = data.name_words(train_docs)
    tok_dir = out / "tokenizer"
    data.save_tokenizer(_read_tokenizer(Path(args.tokenizer) / "tokenizer.json"), tok_dir)
    tok = _read_tokenizer(tok_dir / "tokenizer.json")
    eos = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]

    tc = dict(DEFAULT_TEXT_CONFIG, **COPY_TEXT_CONFIG, vocab_size=tok.get_vocab_size())
    if args.config:
        tc.update(json.loads(args.config))
    config = full_config(tc, eos)
    model = build_model(config)
    if args.init:
        # float32 for training, whatever the file holds (the partial run is float16)
        model.load_weights([(k, v.astype(mx.float32)) for k, v in mx.load(str(args.init)).items()])
        log(f"initialized from {args.init}", logf)
    model.train()
    npar = n_params(model)
    log(f"model: {npar / 1e6:.2f}M params ({npar * 4 / 2**20:.1f} MiB fp32), "
        f"layers {config['text_config']['layer_types']}", logf)
    opt = optim.AdamW(learning_rate=args.lr, betas=[0.9, 0.95], weight_decay=args.weight_decay)

    def loss_fn(model, x, w):
        a, b = losses(model, x, False, w)
        return a + args.mtp_weight * b, (a, b)

    vg = nn.value_and_grad(model, loss_fn)

    def step(x, w):
        (_, (a, b)), grads = vg(model, x, w)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return a, b

    pair = lambda v: tuple(int(x) for x in v.split(","))  # noqa: E731
    # a continuation draws other documents than the run it continues
    data_seed = f"{args.seed}:{args.init}" if args.init else args.seed
    stream_pool = pair(args.made_up_pool) if args.made_up_pool else None
    stream = batches(train_docs, tok, words, data_seed, args.batch, args.seq, args.file_weight,
                     pair(args.file_chars), pair(args.blocks), args.random_share,
                     pair(args.span_lines), stream_pool)
    made_up = [("made_up.py", random_source(random.Random(f"probe{i}"), words, pool=stream_pool))
               for i in range(8)]
    t0 = time.time()
    ema = None
    s = 0
    for s in range(args.steps):
        progress = max(s / args.steps, (time.time() - t0) / 60 / args.time_limit)
        if progress >= 1.0:
            log(f"time budget spent after {s} steps", logf)
            break
        opt.learning_rate = lr_at(s, progress, args.lr, args.warmup)
        x, w = next(stream)
        a, b = step(mx.array(x), mx.array(w))
        mx.eval(model.parameters(), opt.state, a, b)
        a, b = a.item(), b.item()
        ema = (a, b) if ema is None else (0.9 * ema[0] + 0.1 * a, 0.9 * ema[1] + 0.1 * b)
        if s % 10 == 0:
            log(f"step {s} trunk {a:.3f} head {b:.3f} (ema {ema[0]:.3f}/{ema[1]:.3f}) "
                f"lr {opt.learning_rate.item():.2e} elapsed {(time.time() - t0) / 60:.1f}m", logf)
        if args.probe_every and s and s % args.probe_every == 0:
            model.eval()
            r = copy_fraction(model, tok, held_docs, n=8, seed=1)
            m = copy_fraction(model, tok, made_up, n=8, seed=1)
            log(f"probe step {s}: copied {r['chars_copied']:.1%} of held-out spans (8), "
                f"teacher-forced top-1 {r['teacher_forced_top1']:.1%}; made-up files: copied "
                f"{m['chars_copied']:.1%}, top-1 {m['teacher_forced_top1']:.1%}", logf)
            model.train()
    minutes = (time.time() - t0) / 60
    log(f"training: {s + 1} steps, {minutes:.1f} min, ema trunk {ema[0]:.3f} head {ema[1]:.3f}", logf)
    model.eval()
    mx.save_safetensors(str(out / "ckpt.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    hf = export_hf(model, config, tok_dir, out / "hf")
    held = np.array(tok.encode(held_docs[0][1]).ids[:200], np.int32)
    err = verify_reload(model, hf, held)
    log(f"export: reload max |logit diff| trunk {err[0]:.2e} head {err[1]:.2e}", logf)
    (out / "train_summary.json").write_text(json.dumps({
        "params": npar, "steps": s + 1, "train_minutes": round(minutes, 1),
        "ema_loss_trunk": round(ema[0], 3), "ema_loss_head": round(ema[1], 3),
        "args": vars(args)}, indent=1))
    if args.ship:
        ship(hf, Path(args.ship), args.dtype)
        log(f"shipped to {args.ship}", logf)
    return 0


def _greedy(model, prompt_ids: List[int], n: int) -> List[int]:
    """Plain greedy decoding with the trunk alone (mlx_lm's cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.language_model)
    logits = model.language_model(mx.array(prompt_ids)[None], cache=cache)
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits[0, -1]).item())
        out.append(t)
        logits = model.language_model(mx.array([[t]]), cache=cache)
    return out


def copy_fraction(model, tok, docs, n: int = 32, seed: int = 0, span_lines: int = 10) -> dict:
    """Greedy continuations of `edit_prompt`s over n held-out files: the
    share of the target's characters reproduced (the longest common prefix
    of answer and target, over the target's length, summed over files), the
    share of spans copied whole, and the trunk's teacher-forced top-1 accuracy
    on the target's tokens (given the true prefix)."""
    rng = random.Random(seed)
    got = total = whole = count = hits = n_tok = 0
    for rel, src in rng.sample(docs, min(n, len(docs))):
        pt = edit_prompt(rel, src, rng, span_lines=span_lines)
        if pt is None:
            continue
        prompt, target = pt
        ids = tok.encode(prompt).ids
        full = tok.encode(prompt + target).ids
        k0 = len(ids) if full[: len(ids)] == ids else len(ids) - 1  # a merge across the seam
        logits = model.language_model(mx.array(full)[None])
        pred = np.array(mx.argmax(logits[0, k0 - 1:-1], axis=-1))
        hits += int((pred == np.array(full[k0:])).sum())
        n_tok += len(full) - k0
        answer = tok.decode(_greedy(model, ids, len(full) - k0 + 4))
        k = 0
        while k < min(len(answer), len(target)) and answer[k] == target[k]:
            k += 1
        got += k
        total += len(target)
        whole += k == len(target)
        count += 1
    return {"files": count, "chars_copied": got / max(1, total), "spans_whole": whole / max(1, count),
            "teacher_forced_top1": hits / max(1, n_tok)}


def lookup_predictable(prompt_ids: List[int], answer_ids: List[int], n: int = 3) -> float:
    """Share of the answer's tokens that an n-gram lookup over prompt +
    answer so far predicts (the last n tokens' latest earlier occurrence's
    successor), as issue 63 measures the demo."""
    from mlx_mtp.context_draft import ContextIndex

    index = ContextIndex(prompt_ids, sizes=(n,))
    hit = 0
    for t in answer_ids:
        p = index.propose(1)
        hit += bool(p.tokens) and p.tokens[0] == t
        index.extend([t])
    return hit / max(1, len(answer_ids))


def measure(folder: str, n: int = 32, seed: int = 0, depth: int = 3, answer_tokens: int = 96) -> dict:
    """On the edit prompts of n held-out files: copying (`copy_fraction`),
    the share of the greedy answer a 3-gram lookup over prompt + answer so
    far predicts, and the MTP head's acceptance per draft position and
    tokens per cycle when decoding that answer (greedy, `depth` drafts)."""
    import mlx_mtp

    model, tokenizer = mlx_mtp.load(folder)
    tok = _read_tokenizer_of(folder)
    _, held = data.split_corpus()
    r = copy_fraction(model, tok, held, n=n, seed=seed)
    rng = random.Random(seed)
    preds, accs, tpc = [], [], []
    for rel, src in rng.sample(held, min(n, len(held))):
        pt = edit_prompt(rel, src, rng)
        if pt is None:
            continue
        ids = tok.encode(pt[0]).ids
        answer, last = [], None
        for last in mlx_mtp.stream_generate(model, tokenizer, mx.array(ids),
                                            max_tokens=answer_tokens, draft_tokens=depth):
            answer.append(int(last.token))
        preds.append(lookup_predictable(ids, answer))
        accs.append(last.acceptance)
        tpc.append(last.tokens_per_cycle)
    r["lookup3_predictable"] = round(float(np.mean(preds)), 4)
    r["head_acceptance"] = [round(float(np.mean([a[k] for a in accs if len(a) > k])), 4)
                            for k in range(depth)]
    r["head_tokens_per_cycle"] = round(float(np.mean(tpc)), 3)
    return r


def _read_tokenizer_of(folder: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    t = sub.add_parser("train", help="train, export, and optionally ship (the default)")
    t.add_argument("--out", default="runs/copy")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, default=100000)
    t.add_argument("--time-limit", type=float, default=15.0, help="training minutes")
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--mtp-weight", type=float, default=0.5)
    t.add_argument("--file-weight", type=float, default=0.3,
                   help="the trunk loss's weight on the file window (the blocks weigh 1)")
    t.add_argument("--file-chars", default="1100,1100",
                   help="LO,HI: each document's file window is at most a random LO-HI characters")
    t.add_argument("--blocks", default="1,3", help="LO,HI: SEARCH/REPLACE blocks per document")
    t.add_argument("--span-lines", default="2,14",
                   help="LO,HI: lines of each SEARCH span (fewer where the window ends)")
    t.add_argument("--random-share", type=float, default=0.0,
                   help="share of the documents that edit a made-up file of random names")
    t.add_argument("--made-up-pool", default=None,
                   help="LO,HI: each made-up file uses LO-HI words (default: all of them)")
    t.add_argument("--tokenizer", default="mlx_mtp/demo")
    t.add_argument("--config", default=None, help="JSON overrides of the text config")
    t.add_argument("--init", default=None,
                   help="start from an earlier run's ckpt.safetensors (fresh optimizer and schedule)")
    t.add_argument("--probe-every", type=int, default=0)
    t.add_argument("--ship", default=None, help="convert the export into this folder")
    t.add_argument("--dtype", default="float16", help="the shipped weights' dtype")
    m = sub.add_parser("measure", help="copy fraction, lookup predictability, head acceptance")
    m.add_argument("folder")
    m.add_argument("--n", type=int, default=32)
    args = p.parse_args(argv if argv is not None else (sys.argv[1:] or ["train"]))
    if args.cmd == "measure":
        print(json.dumps(measure(args.folder, n=args.n), indent=1))
        return 0
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
