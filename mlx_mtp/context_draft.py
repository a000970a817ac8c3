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
