"""Estimate what MTP will give on your own text, before generating.

`teacher_forced_logits(model, tokens)` runs the trunk over the text and the
head over (trunk hidden at t, token t+1), so `mtp_logits[t]` is the head's
prediction of token t+2. `expected_acceptance` turns that into greedy
acceptance per draft position: at each start t the head drafts k tokens by
chaining itself exactly as in decoding, and draft i is accepted when drafts
1..i all equal the trunk's greedy choice at t+1..t+i (teacher-forced).

    python -m mlx_mtp.evaluate --model M --text-file F [--depth 4]
"""

from __future__ import annotations

import json
import sys
from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache

from . import params


def teacher_forced_logits(model, tokens) -> Tuple[mx.array, mx.array]:
    """(main_logits [T, V], mtp_logits [T-1, V]) for a 1-D token sequence."""
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    h = model.trunk_hidden(tokens[None], None)
    main = model.logits_from_hidden(h)[0]
    if not model.has_mtp:
        raise ValueError("the model has no MTP head")
    g = model.mtp(h[:, :-1], model.embed(tokens[None, 1:]), None)
    return main, model.logits_from_hidden(g)[0]


def _cache_upto(c, n: int):
    """A head cache entry holding only its first `n` pairs: a KVCache, or a
    CacheList of them (qwen4_exp's QSA layer: attention K/V, indexer keys)."""
    if isinstance(c, CacheList):
        return CacheList(*(_cache_upto(x, n) for x in c.caches))
    nc = KVCache()
    nc.keys = c.keys[..., :n, :]
    nc.values = c.values[..., :n, :]
    nc.offset = n
    return nc


def _head_cache_upto(full: list, n: int) -> list:
    return [_cache_upto(c, n) for c in full]


def expected_acceptance(model, tokens, depth: int = 4, max_starts: int = 256,
                        draft_vocab: Optional[mx.array] = None) -> dict:
    """Teacher-forced greedy acceptance per draft position 1..depth on `tokens`
    (drafting over `draft_vocab` ids only, when given)."""
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    T = tokens.size
    if T < depth + 2:
        raise ValueError(f"text too short: {T} tokens, need at least {depth + 2}")
    h = model.trunk_hidden(tokens[None], None)
    greedy = mx.argmax(model.logits_from_hidden(h)[0], axis=-1)  # trunk's choice for t+1
    full = model.mtp.make_cache()
    g_all = model.mtp(h[:, :-1], model.embed(tokens[None, 1:]), full)
    d1_all = model.draft_tokens_from_hidden(g_all[0], draft_vocab)  # draft for t+2
    mx.eval(greedy, d1_all, [c.state for c in full])
    greedy_l = greedy.tolist()
    last_start = T - 1 - depth  # need trunk targets up to t+depth
    starts = list(range(0, last_start))
    if len(starts) > max_starts:
        step = len(starts) / max_starts
        starts = [starts[int(i * step)] for i in range(max_starts)]
    accepted = [0] * depth
    for t in starts:
        # head entries (h_p, tok_{p+1}) for p <= t, then chain from its output
        cache = _head_cache_upto(full, t + 1)
        g = g_all[:, t : t + 1]
        d = d1_all[t : t + 1]
        drafts = [d]
        for _ in range(depth - 1):
            g = model.mtp(g, model.embed(d[None]), cache)
            d = model.draft_tokens_from_hidden(g[0], draft_vocab)
            drafts.append(d)
        drafts = mx.concatenate(drafts).tolist()
        for i in range(depth):
            # draft i+1 proposes token t+2+i; the trunk's greedy for it is greedy[t+1+i]
            if drafts[i] != greedy_l[t + 1 + i]:
                break
            accepted[i] += 1
    n = len(starts)
    acc = [a / n for a in accepted]
    return {
        "tokens": T,
        "starts": n,
        "acceptance": acc,
        # a cycle of depth k emits 1 + the number of accepted drafts
        "tokens_per_cycle": {k: 1 + sum(acc[:k]) for k in range(1, depth + 1)},
    }


def main(argv: Optional[list] = None) -> int:
    from .loader import load

    p = params.ArgumentParser(prog="python -m mlx_mtp.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or HF repo (default: demo model)")
    p.add_argument("--text-file", required=True, help="text of your workload ('-' for stdin)")
    p.add_argument("--depth", type=int, default=4, help="draft positions to report")
    p.add_argument("--max-tokens", type=int, default=2048, help="use at most this many tokens")
    p.add_argument("--max-starts", type=int, default=256, help="start positions sampled for chains")
    p.add_argument("--draft-vocab", default=None,
                   help="draft over a trimmed vocabulary: a JSON file or N (tokenizer's first N ids)")
    p.add_argument("--write-draft-vocab", default=None, metavar="FILE",
                   help="count the most frequent ids of the text into FILE (see --draft-vocab-size)")
    p.add_argument("--draft-vocab-size", type=int, default=32768)
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        model, tokenizer = load(args.model)
        text = sys.stdin.read() if args.text_file == "-" else open(args.text_file).read()
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not model.has_mtp:
        print("error: the model has no MTP head; nothing to estimate", file=sys.stderr)
        return 1
    from . import draft_vocab as dv

    all_tokens = tokenizer.encode(text)
    tokens = all_tokens[: args.max_tokens]
    V = model.vocab_size
    if args.write_draft_vocab:
        ids = dv.count([all_tokens], args.draft_vocab_size, tokenizer, V)
        dv.save(args.write_draft_vocab, ids, source=args.text_file)
        print(f"wrote {len(ids)} draft-vocabulary ids to {args.write_draft_vocab}")
    try:
        vocab = dv.load(args.draft_vocab, tokenizer, V)
        res = expected_acceptance(model, tokens, args.depth, args.max_starts, vocab)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    main_l, mtp_l = teacher_forced_logits(model, tokens)
    tk = mx.array(tokens)
    ce_main = mx.mean(mx.logsumexp(main_l[:-1], axis=-1) - mx.take_along_axis(main_l[:-1], tk[1:, None], axis=-1)[:, 0])
    ce_mtp = mx.mean(mx.logsumexp(mtp_l[:-1], axis=-1) - mx.take_along_axis(mtp_l[:-1], tk[2:, None], axis=-1)[:, 0])
    res["loss_trunk"] = ce_main.item()
    res["loss_head"] = ce_mtp.item()
    if args.json:
        print(json.dumps(res))
        return 0
    if vocab is not None:
        res["draft_vocab"] = int(vocab.size)
    print(f"{res['tokens']} tokens, {res['starts']} chain starts (teacher-forced, greedy)"
          + (f", drafting over {vocab.size} ids" if vocab is not None else ""))
    print(f"cross-entropy: trunk {res['loss_trunk']:.3f}, MTP head (t+2) {res['loss_head']:.3f}")
    for i, a in enumerate(res["acceptance"], 1):
        print(f"draft position {i}: acceptance {a:.1%}   depth {i}: "
              f"{res['tokens_per_cycle'][i]:.2f} tokens per cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
