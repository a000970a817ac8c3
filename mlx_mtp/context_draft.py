"""Context drafts: the continuation a row would copy from its own tokens.

Agents re-type their context (a SEARCH block repeats a file, a tool call a
path): after the last few tokens of a row, the tokens that followed their
most recent earlier occurrence in the row's prompt and output are a likely
continuation, known many tokens ahead. `ContextIndex` finds it without
scanning the context: a map from each n-gram (a few sizes n, longest
first) to the position after its latest occurrence, updated as the row
grows (O(1) per appended token: one entry per size), so a proposal costs
the lookups and the copy, whatever the row's length.

A proposal is a point draft (q = δ at each token): the one acceptance rule
(`acceptance.accept`) keeps it exactly (docs/design.md, "Context drafts").
`ContextDrafter` puts the runs into the decode loop through the `Drafter`
protocol: opt-in (the loop's `drafter=` option), one row at a time, the first
step of issue 63.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np

import mlx.core as mx

NGRAM_SIZES = (4, 3)  # the suffix lengths looked up, longest first
MAX_RUN = 16  # the longest run proposed


@dataclass(frozen=True)
class Proposal:
    """A run copied from the row's context: `tokens` (empty when the suffix
    never occurred before), `match` the length of the suffix found (0: none)
    and `source` the position in the row's tokens the run starts at (-1)."""

    tokens: Tuple[int, ...] = ()
    match: int = 0
    source: int = -1

    def __len__(self) -> int:
        return len(self.tokens)


class ContextIndex:
    """One row's tokens (its prompt, then what it emits) and, per n-gram of
    each size in `sizes`, the position right after its latest occurrence
    that has a token there."""

    def __init__(self, tokens: Iterable[int] = (), sizes: Sequence[int] = NGRAM_SIZES):
        sizes = tuple(sizes)
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes) \
                or len(set(sizes)) != len(sizes):
            raise ValueError(f"n-gram sizes must be distinct positive integers, got {sizes!r}")
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.tokens: List[int] = []
        # n-gram -> the position of the token after its latest occurrence
        self._after: Dict[Tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """The row's next token. The n-grams ending just before it now have a
        continuation: each points here (a later occurrence replaces an earlier)."""
        at, tokens = len(self.tokens), self.tokens
        for n in self.sizes:
            if at >= n:
                self._after[tuple(tokens[at - n:at])] = at
        tokens.append(int(token))

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def propose(self, max_len: int = MAX_RUN) -> Proposal:
        """The continuation after the most recent earlier occurrence of the
        row's current suffix (the longest size that occurred), up to
        `max_len` tokens. A run that reaches the row's end goes on with
        itself (a repeat of period p continues as one)."""
        if not isinstance(max_len, int) or max_len < 0:
            raise ValueError(f"max_len must be a non-negative integer, got {max_len!r}")
        tokens, end = self.tokens, len(self.tokens)
        for n in self.sizes:
            if end < n:
                continue
            start = self._after.get(tuple(tokens[end - n:end]))
            if start is None:
                continue
            run: List[int] = []
            for i in range(max_len):  # start < end: each token is known by then
                at = start + i
                run.append(tokens[at] if at < end else run[at - end])
            return Proposal(tuple(run), n, start)
        return Proposal()


class ContextDrafter:
    """A `cycle.Drafter` that drafts the row's context run where its suffix
    occurred before (point drafts: q None), else the head's own chain.

    Opt-in and a first step: pass `drafter=ContextDrafter(prompt)` to the
    decode loop (`decode.generate_tokens`, `make_batch`). It is host-side (its
    index is the row's tokens on the host), so its batch decodes one row,
    eagerly, each cycle read before the next, and the head still runs its
    chain every cycle. Exact under any sampler: a run is verified by the one
    acceptance rule like any draft. `prompt`: the tokens the index starts
    from at each generation (the row's prompt; with a prompt cache, what the
    caller wants copied from)."""

    host_side = True
    replaces_head = False

    def __init__(self, prompt: Iterable[int], sizes: Sequence[int] = NGRAM_SIZES):
        self.prompt = [int(t) for t in prompt]
        self.index = ContextIndex(self.prompt, sizes)
        self.sizes = self.index.sizes
        self.runs = 0  # cycles that drafted a context run (the others: the head's)

    def start(self) -> None:
        self.index = ContextIndex(self.prompt, self.sizes)

    def observe(self, tokens: List[int]) -> None:
        self.index.extend(tokens)

    def arrays(self) -> list:
        return []

    def graph_key(self) -> tuple:
        return ("context", self.sizes)

    def propose(self, arrays, state, k: int, head_drafts, head_q):
        """The run after the row's suffix (its last token is the cycle's y),
        k tokens long, else the head's drafts and their q."""
        run = self.index.propose(k)
        if not run:
            return head_drafts, head_q
        self.runs += 1
        return mx.array([run.tokens], dtype=mx.int32), None


# -- on the device: every row of a batch, inside the compiled cycle --------------------------
# A row's index as device arrays (DecodeState's ctx_* fields), so the batch
# proposes runs in the graph, per row, with no host read between cycles:
#   ctx_tokens [B, WINDOW + 1]  the row's last WINDOW tokens, token p at p % WINDOW
#                               (the last slot takes masked writes)
#   ctx_len    [B]              tokens written (the prompt, then each one emitted)
#   ctx_table  [B, BUCKETS + 1] per bucket of an n-gram's hash, the position after
#                               its latest occurrence (0: none; the last slot
#                               takes masked writes)
# A bucket two n-grams share keeps the later one, and a proposal is checked
# against the tokens before it, so a collision costs a missed run, never a
# wrong one (and a wrong one would only be rejected: the rule keeps any draft
# exact). The ring keeps the last WINDOW tokens: an occurrence older than that
# proposes nothing.
WINDOW = 1 << 17  # 512 KB a row
# 2 MB a row: an n-gram survives the ~2 x 100K later entries of a 100K-token
# context with probability ~0.7 (a shared bucket keeps the later n-gram)
BUCKETS = 1 << 19


def _bucket(grams: mx.array, n: int) -> mx.array:
    """The bucket [...] of n-grams [..., n] (FNV-1a over the ids, salted by n,
    then murmur3's finaliser: a product's low bits see only its inputs' low
    bits, and the bucket is the low bits)."""
    def u32(v):
        return mx.array(v, mx.uint32)

    h = mx.full(grams.shape[:-1], (2166136261 ^ n) & 0xFFFFFFFF, mx.uint32)
    for i in range(n):
        h = (h ^ grams[..., i].astype(mx.uint32)) * u32(16777619)
    h = (h ^ (h >> 16)) * u32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * u32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return (h & (BUCKETS - 1)).astype(mx.int32)


def _at(tokens: mx.array, positions: mx.array) -> mx.array:
    """tokens[b, positions[b, ...] % WINDOW] (positions clamped at 0: MLX's
    gathers check no bounds)."""
    flat = mx.maximum(positions, 0).reshape(positions.shape[0], -1) % WINDOW
    return mx.take_along_axis(tokens, flat, axis=1).reshape(positions.shape)


def _index_rows(tokens: mx.array, table: mx.array, at: mx.array, valid: mx.array,
                sizes: Sequence[int], first: int = 0) -> mx.array:
    """The table with, for each position `at` [B, T] marked `valid`, each
    n-gram ending just before it (and starting at `first` or later) pointing
    there (the latest wins: positions only grow, so a scatter-max keeps it)."""
    B = at.shape[0]
    flat = table.reshape(-1)
    base = (mx.arange(B, dtype=mx.int32) * (BUCKETS + 1))[:, None]
    for n in sizes:
        grams = _at(tokens, at[..., None] - n + mx.arange(n))  # [B, T, n]
        ok = valid & (at - n >= first)
        slot = base + mx.where(ok, _bucket(grams, n), BUCKETS)
        flat = flat.at[slot.reshape(-1)].maximum(mx.where(ok, at, 0).reshape(-1))
    return flat.reshape(table.shape)


def context_state(tokens: Sequence[int], sizes: Sequence[int] = NGRAM_SIZES):
    """One row's (ctx_tokens [1, WINDOW+1], ctx_len [1], ctx_table [1, BUCKETS+1])
    from its tokens so far (its prompt, with the last one: the cycle's y)."""
    ids = np.asarray(tokens, dtype=np.int32)[-WINDOW:]
    start = max(len(tokens) - WINDOW, 0)
    ring = np.zeros((1, WINDOW + 1), np.int32)
    ring[0, np.arange(start, len(tokens)) % WINDOW] = ids
    ring = mx.array(ring)
    at = mx.arange(start, len(tokens), dtype=mx.int32)[None]
    # (an n-gram reaching before the window has lost its first tokens)
    table = _index_rows(ring, mx.zeros((1, BUCKETS + 1), mx.int32), at,
                        mx.ones(at.shape, mx.bool_), sizes, start)
    return ring, mx.array([len(tokens)], dtype=mx.int32), table


def propose_runs(tokens: mx.array, length: mx.array, table: mx.array, k: int,
                 sizes: Sequence[int] = NGRAM_SIZES):
    """Per row, the k tokens after the latest earlier occurrence of its
    suffix (the longest size that occurred, as `ContextIndex.propose`):
    (runs [B, k] int32, found [B] bool)."""
    B = length.shape[0]
    start, found = mx.zeros((B,), mx.int32), mx.zeros((B,), mx.bool_)
    for n in sorted(sizes, reverse=True):
        suffix = _at(tokens, length[:, None] - n + mx.arange(n))  # [B, n]
        p = mx.take_along_axis(table, _bucket(suffix, n)[:, None], axis=1)[:, 0]
        earlier = _at(tokens, p[:, None] - n + mx.arange(n))
        ok = ((length >= n) & (p >= n) & (p < length) & (p - n >= length - WINDOW)
              & mx.all(earlier == suffix, axis=1))
        start = mx.where(ok & ~found, p, start)
        found = found | ok
    period = mx.maximum(length - start, 1)[:, None]  # a run reaching the end repeats
    runs = _at(tokens, start[:, None] + mx.arange(k) % period)
    return runs, found


def append_tokens(tokens: mx.array, length: mx.array, table: mx.array, new: mx.array,
                  count: mx.array, sizes: Sequence[int] = NGRAM_SIZES):
    """The rows' index after they emit new[b, :count[b]] (new [B, T]):
    (ctx_tokens, ctx_len, ctx_table)."""
    at = length[:, None] + mx.arange(new.shape[1])  # [B, T]
    valid = mx.arange(new.shape[1])[None] < count[:, None]
    tokens = mx.put_along_axis(tokens, mx.where(valid, at % WINDOW, WINDOW),
                               new.astype(mx.int32), axis=1)
    return tokens, length + count.astype(mx.int32), _index_rows(tokens, table, at, valid, sizes)
