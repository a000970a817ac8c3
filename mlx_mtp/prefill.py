"""Feeding mlx_lm's own caches: the prompt (several prompts at once) and
the tokens a finished generation leaves, exactly as mlx_lm feeds them, with
the head following one position behind (docs/design.md, "Prefill").

These are the only functions that write into a prompt cache's mlx_lm objects
besides `cache.MTPCache.write_back`; a cycle (cycle.py) works on the decoding
form and never touches them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from .cache import fill_empty, head_caches, last_hidden, set_last_hidden
from .cycle import Spec, head_forward
from .distributed import kept_on_every_stage
from .families import mrope


@dataclass
class Prefilled:
    """One prompt after `prefill`: its trunk hidden at the last fed position
    (None when nothing was fed before the last prompt token and the cache
    kept no hidden) and the head's hidden of the pair (that hidden, the last
    prompt token), or None."""

    h: Optional[mx.array]
    g: Optional[mx.array]


def _pieces(n: int, step: int, stops) -> List[int]:
    """Piece lengths covering n tokens: at most `step` each, ending at every stop."""
    bounds = sorted({s for s in stops if 0 < s < n} | {n})
    out, pos = [], 0
    for b in bounds:
        while pos < b:
            out.append(min(step, b - pos))
            pos += out[-1]
    return out


def prefill(spec: Spec, caches: List[list], prompts: List[List[int]], prefill_step_size: int,
            progress: Callable = lambda i, done, total: None, stops=None,
            snapshot: Callable = lambda i, n: None,
            head_window: Optional[int] = None, last_pair: bool = True) -> List[Prefilled]:
    """Feed each prompt but its last token to its prompt cache (mlx_lm's
    objects, updated in place), as mlx_lm feeds a prompt: pieces of at most
    `prefill_step_size` tokens. Several prompts go through the trunk together
    (mlx_lm's batched prompt processing: the caches merged, each round's
    pieces right-padded, then split back); one prompt runs on its own cache.
    The head follows one position behind: pairs (h_p, tok_{p+1}) once
    tok_{p+1} is fed, the trunk's hidden at the last fed position kept for
    the next pair (the prompt cache's invariant, cache.py); the last pair,
    with the prompt's last token, gives the hidden the head drafts from.
    Without the head (spec.use_head False) only the caches are evaluated, as
    mlx_lm prefills (its last layer's output is then never computed).

    stops[i]: token counts of prompt i after which `snapshot(i, n)` is called
    while its prompt cache holds exactly its first n tokens (the server's
    prefix cache). progress(i, done, total) per piece. last_pair False: the
    last pair is left for the next call, whose first token the prompt's last
    is (a prompt fed piece by piece, `Batch.feed_prefix`): the head then
    stays one position behind the trunk, as the prompt cache keeps it."""
    model = spec.model
    n_trunk = len(model.is_linear)
    n_rows = len(prompts)
    stops = stops or [()] * n_rows
    # the trunk's hidden at each row's last fed position, once it is known
    last: List[Optional[mx.array]] = (
        kept_on_every_stage([last_hidden(c, model.is_linear) for c in caches], model)
        if spec.use_head else [None] * len(caches))
    # the head follows only each prompt's last `head_window` tokens (a piece ends
    # where it starts following; before, only the trunk's caches are evaluated)
    head_from = [0 if head_window is None else max(0, len(p) - 1 - head_window)
                 for p in prompts]
    pieces = [_pieces(len(p) - 1, prefill_step_size, (*s, f))
              for p, s, f in zip(prompts, stops, head_from)]
    done = [0] * n_rows
    g: List[Optional[mx.array]] = [None] * n_rows
    for i in range(n_rows):
        progress(i, 0, len(prompts[i]))
    batched = n_rows > 1
    if batched and any(not c.empty() for cache in caches for c in cache[:n_trunk]):
        # mlx_lm's ArraysCache.merge starts a row that never saw a token from
        # zeros, not from what the family's layers start from (qwen4_exp's
        # n-gram context: EOS)
        for cache in caches:
            fill_empty(cache, model, n_trunk)
    trunk = _merged([c[:n_trunk] for c in caches]) if batched else caches[0][:n_trunk]
    head = None
    if spec.use_head:
        head = (_merged([head_caches(c, n_trunk) for c in caches]) if batched
                else head_caches(caches[0], n_trunk))

    def head_pass(hiddens, counts):
        """Row i's next `counts[i]` tokens (from done[i] on), each paired with
        the hidden before it: `last`, then this round's (a row with no last
        hidden skips its first)."""
        pairs = []
        for i in range(n_rows):
            d, v = done[i], counts[i]
            toks = prompts[i][d + (0 if last[i] is not None else 1):d + v]
            hs = ([last[i]] if last[i] is not None else []) + (
                [hiddens[i:i + 1, :v - 1]] if v > 1 else [])
            pairs.append((mx.concatenate(hs, axis=1) if toks else None, toks))
        G = _head_pairs(model, head, pairs, batched)
        for i, (_, toks) in enumerate(pairs):
            if toks:
                g[i] = G[i:i + 1, len(toks) - 1:len(toks)]

    for r in range(max([len(p) for p in pieces] + [0])):
        v = [p[r] if r < len(p) else 0 for p in pieces]
        h = _forward(lambda x: model.trunk_hidden(x, trunk), trunk,
                     [prompts[i][done[i]:done[i] + v[i]] for i in range(n_rows)], batched)
        followed = [v[i] if done[i] >= head_from[i] else 0 for i in range(n_rows)]
        if head is not None and any(followed):
            head_pass(h, followed)
        for i in range(n_rows):
            if v[i]:
                if head is not None:  # (where no hidden is needed, the trunk's
                    # last layer runs only as far as its cache needs)
                    last[i] = h[i:i + 1, v[i] - 1:v[i]] if followed[i] else None
                done[i] += v[i]
        mx.eval([c.state for c in trunk], [c.state for c in head or []],
                [x for x in last if x is not None])
        for i in range(n_rows):
            if v[i]:
                progress(i, done[i], len(prompts[i]))
                if done[i] in stops[i]:
                    _split_back(spec, caches, trunk, head, batched, [i], last)
                    snapshot(i, done[i])
        mx.clear_cache()
    if head is not None and last_pair:  # the last pair: (h at the last fed position,
        head_pass(None, [1] * n_rows)  # the last token)
        mx.eval([c.state for c in head], [x for x in g if x is not None])
    _split_back(spec, caches, trunk, head, batched, list(range(n_rows)), last)
    return [Prefilled(last[i], g[i]) for i in range(n_rows)]


def prefill_media(spec: Spec, cache: list, prompt: List[int], media, prefill_step_size: int,
                  progress: Callable = lambda done, total: None, stops=(),
                  snapshot: Callable = lambda n: None) -> Prefilled:
    """`prefill` for one prompt with images (`media`: rows.Media), on a
    prompt cache holding the prompt's first `media.start` tokens: the
    trunk takes the prompt's embeddings with the image features at the pads
    and each token's three M-RoPE positions; the head follows one position
    behind as `prefill`'s does, its pair (h_p, tok_{p+1}) at position p's ids
    and with tok_{p+1}'s embedding (an image pad's: its feature, as vLLM's
    multimodal MTP head takes it). `stops`, `snapshot`: as `prefill`'s, for
    this one prompt."""
    model = spec.model
    n_trunk = len(model.is_linear)
    trunk = cache[:n_trunk]
    head = head_caches(cache, n_trunk) if spec.use_head else None
    ids = mx.array([prompt], dtype=mx.int32)

    o = media.start  # (indices below are the row's prompt's; positions the whole one's)

    def at(caches, start, stop):  # the forward's tokens at their own ids (and the earlier ones')
        return mrope.at(caches, mrope.Positions(
            mx.array(media.positions[:, None, o + start:o + stop], dtype=mx.int32),
            mx.array(media.positions[:, None, :o + start], dtype=mx.int32)))

    last = last_hidden(cache, model.is_linear) if head is not None else None
    n, done, g = len(prompt) - 1, 0, None
    progress(0, len(prompt))
    pieces = _pieces(n, prefill_step_size, stops)
    for v in pieces:
        emb = media.embeddings(model, prompt, done, done + v)
        h = model.trunk_hidden(ids[:, done:done + v], at(trunk, done, done + v), emb)
        if head is not None:
            first = done if last is not None else done + 1  # a pair's token index
            hs = ([last] if last is not None else []) + ([h[:, :v - 1]] if v > 1 else [])
            if first < done + v:
                head_forward(model, mx.concatenate(hs, axis=1), ids[:, first:done + v],
                             at(head, first - 1, done + v - 1), emb[:, first - done:])
            last = h[:, v - 1:v]
        mx.eval([c.state for c in trunk], [c.state for c in head or []], last)
        done += v
        progress(done, len(prompt))
        if done in stops:
            _split_back(spec, [cache], trunk, head, False, [0], [last])
            snapshot(done)
        mx.clear_cache()
    if head is not None and last is not None:  # the last pair: (h_{n-1}, the last token)
        g = head_forward(model, last, ids[:, n:], at(head, n - 1, n),
                         media.embeddings(model, prompt, n, n + 1))
        mx.eval([c.state for c in head], g)
    _split_back(spec, [cache], trunk, head, False, [0], [last])
    return Prefilled(last, g)


def _merged(per_row: List[list]) -> list:
    """mlx_lm's batch caches over the rows' own (BatchKVCache, ArraysCache)."""
    return [layer[0].merge(list(layer)) for layer in zip(*per_row)]


def _forward(fn, caches: list, block: List[List[int]], batched: bool):
    """fn over a block of token rows, right-padded when they differ in length
    (mlx_lm's `prepare`/`finalize` keep the padding out of every state)."""
    lengths = [len(b) for b in block]
    width = max(lengths)
    if width == 0:
        return None
    if not batched:
        return fn(mx.array(block, dtype=mx.int32))
    padding = [width - n for n in lengths]
    tokens = mx.array([b + [0] * p for b, p in zip(block, padding)], dtype=mx.int32)
    if max(padding):
        for c in caches:
            c.prepare(lengths=lengths, right_padding=padding)
    out = fn(tokens)
    if max(padding):
        for c in caches:
            c.finalize()
    return out


def _head_pairs(model, head: list, pairs: list, batched: bool) -> Optional[mx.array]:
    """The head over each row's pairs (hiddens [1, n, H], n next tokens),
    rows right-padded; returns its hiddens [B, max n, H]."""
    W = max(len(t) for _, t in pairs)
    if W == 0:
        return None
    like = next(x for x, t in pairs if t)
    pad = lambda n: mx.zeros((1, n, like.shape[-1]), like.dtype)
    hs = mx.concatenate([pad(W) if not t else x if len(t) == W
                         else mx.concatenate([x, pad(W - len(t))], axis=1) for x, t in pairs])
    if not batched:
        return head_forward(model, hs, mx.array([pairs[0][1]], dtype=mx.int32), head)
    return _forward(lambda x: head_forward(model, hs, x, head), head, [list(t) for _, t in pairs],
                    True)


def _split_back(spec: Spec, caches: List[list], trunk: list, head: Optional[list],
                batched: bool, rows: List[int], hidden: list):
    """Rows' merged caches written back into their own prompt caches (mlx_lm
    objects), with the trunk's last hidden for the head's next pair."""
    model = spec.model
    n_trunk = len(model.is_linear)
    for i in rows:
        if batched:
            pairs = list(zip(caches[i][:n_trunk], trunk))
            if head is not None:
                pairs += zip(head_caches(caches[i], n_trunk), head)
            for dst, src in pairs:
                # a merged cache that is still empty (no row had or got a token:
                # one-token prompts, a head that did not follow a stored prefix)
                # has nothing to hand back, and mlx_lm's extract cannot slice it
                if not src.empty():
                    _take(dst, src.extract(i))
        if head is not None or len(caches[i]) > n_trunk:
            set_last_hidden(caches[i], hidden[i] if head is not None else None, model.is_linear)


def _take(dst, src):
    """dst (one row's mlx_lm cache object) takes src's contents (a CacheList's
    own objects each take theirs)."""
    if isinstance(dst, CacheList):
        for d, s in zip(dst.caches, src.caches):
            _take(d, s)
    elif hasattr(dst, "offset"):
        dst.keys, dst.values, dst.offset = src.keys, src.values, src.offset
    else:
        dst.cache = list(src.cache)


def catch_up(spec: Spec, prompt_cache: list, ring=None):
    """A prompt cache's head takes a ring's pairs (hiddens, tokens), oldest
    first; the last hidden is then the ring's last (None without a ring: the
    next call's first pair is skipped)."""
    model = spec.model
    n_trunk = len(model.is_linear)
    if spec.use_head and ring is not None:
        head_forward(model, ring[0], ring[1], head_caches(prompt_cache, n_trunk))
    if len(prompt_cache) > n_trunk:
        set_last_hidden(prompt_cache, None if ring is None else ring[0][:, -1:], model.is_linear)


def feed(spec: Spec, prompt_cache: list, tokens: List[int], ring=None):
    """Feed tokens that were emitted but not fed (the end of a generation) to
    the prompt cache's trunk, after the head caught up on the ring's pairs
    (ring: the row's (hiddens, tokens) oldest first, or None); the head
    follows shifted by one, and the trunk's last hidden is kept for the next
    call's first pair."""
    model = spec.model
    n_trunk = len(model.is_linear)
    head = head_caches(prompt_cache, n_trunk) if spec.use_head else None
    if head is not None and ring is not None:
        head_forward(model, ring[0], ring[1], head)
    toks = mx.array(tokens, dtype=mx.int32)[None]
    h = model.trunk_hidden(toks, prompt_cache[:n_trunk])
    if head is not None:
        if toks.shape[1] > 1:
            head_forward(model, h[:, :-1], toks[:, 1:], head)
        set_last_hidden(prompt_cache, h[:, -1:], model.is_linear)
    elif len(prompt_cache) > n_trunk:
        set_last_hidden(prompt_cache, None, model.is_linear)  # the head did not follow
