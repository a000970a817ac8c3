"""Drafters for tests and benchmarks; production decoding drafts with the head.

A drafter replaces the proposals of a cycle (`decode.generate_tokens(..., drafter=)`,
`make_batch(..., drafter=)`); verify, accept, commit and the head's cache
rewrite run as usual, so known accept patterns exercise the real rollback.
The interface is `cycle.Drafter`; the loop calls nothing else.
"""

from __future__ import annotations

import random
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np


class OracleDrafter:
    """Proposes the known continuation `sequence` (e.g. the trunk's own greedy
    output), each draft right with probability `accept_rate` and otherwise
    deliberately wrong: a device-side table lookup at the state's emitted
    count, so pipelined and compiled cycles can use it. The head still runs
    its chain; with sampling, q is claimed one-hot, or with `point` the
    drafts are reported as point drafts (q None: the same q, not materialised)."""

    host_side = False
    replaces_head = False

    def __init__(self, sequence: List[int], accept_rate: float = 1.0, vocab_size: int = 2,
                 seed: int = 0, margin: int = 64, point: bool = False):
        self.point = point
        rng = random.Random(seed)
        table = []
        for j in range(len(sequence) + margin):
            true = sequence[j] if j < len(sequence) else rng.randrange(vocab_size)
            right = rng.random() < accept_rate
            table.append(true if right else (true + 1) % vocab_size)
        self.table = mx.array(table, dtype=mx.int32)

    def arrays(self):
        return [self.table]

    def graph_key(self):
        return ("oracle", self.point)

    def propose(self, arrays, state, k, head_drafts, head_q):
        """Drafts for emitted positions emitted .. emitted+k-1 (index 0 is the
        prompt's first generated token)."""
        (table,) = arrays
        idx = mx.minimum(state.emitted[:, None] + mx.arange(k, dtype=mx.int32), table.size - 1)
        drafts = mx.take(table, idx)
        return drafts, None if self.point else _one_hot(drafts, head_q)


def _one_hot(drafts: mx.array, head_q: Optional[mx.array]) -> Optional[mx.array]:
    """The q a deterministic drafter claims when sampling (None when greedy)."""
    if head_q is None:
        return None
    return (mx.arange(head_q.shape[-1]) == drafts[..., None]).astype(mx.float32)


class BigramDrafter:
    """Each draft is `table[previous token]` (from the row's last emitted
    token on): a device-side lookup that needs no row identity, so rows of a
    batch that join and leave get drafts right or wrong each by their own
    context. Built from known continuations, its acceptance is partial."""

    host_side = False
    replaces_head = False

    def __init__(self, sequences: List[List[int]], vocab_size: int):
        table = [(t + 1) % vocab_size for t in range(vocab_size)]  # wrong unless learned
        for seq in sequences:
            for a, b in zip(seq, seq[1:]):
                table[a] = b
        self.table = mx.array(table, dtype=mx.int32)

    def arrays(self):
        return [self.table]

    def graph_key(self):
        return ("bigram",)

    def propose(self, arrays, state, k, head_drafts, head_q):
        (table,) = arrays
        drafts, last = [], state.y
        for _ in range(k):
            last = mx.take(table, last)
            drafts.append(last)
        drafts = mx.stack(drafts, axis=1).astype(mx.int32)
        return drafts, _one_hot(drafts, head_q)


class DistributionDrafter:
    """Draws each draft on the host from a known distribution
    q(. | tokens generated so far + earlier drafts) and reports it (or, to
    test the tests, a deliberately wrong `claimed` one).

    dist(prefix: tuple of generated token ids) -> probabilities [V];
    claimed(prefix) -> the q reported to the decoder (default: dist).
    Needs a sampler with temp > 0 (Leviathan–Chen)."""

    host_side = True
    replaces_head = True

    def __init__(self, dist: Callable, vocab_size: int, seed: int = 0,
                 claimed: Optional[Callable] = None):
        self.dist = dist
        self.claimed = claimed or dist
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.generated: List[int] = []

    def start(self):
        self.generated = []

    def observe(self, tokens):
        self.generated.extend(tokens)

    def arrays(self):
        return []

    def graph_key(self):
        return ("distribution", id(self))

    def propose(self, arrays, state, k, head_drafts, head_q):
        prefix, drafts, qs = tuple(self.generated), [], []
        for _ in range(k):
            q = np.asarray(self.dist(prefix), dtype=np.float64)
            d = int(self.rng.choice(self.vocab_size, p=q / q.sum()))
            qs.append(np.asarray(self.claimed(prefix), dtype=np.float32))
            drafts.append(d)
            prefix = prefix + (d,)
        return mx.array([drafts], dtype=mx.int32), mx.array(np.stack(qs))[None]
