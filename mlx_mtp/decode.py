"""The MTP decode loop: draft -> verify -> accept -> commit, one sync per cycle.

Invariant at the start of a cycle (P = tokens in the trunk's cache):
  - `y` is the last emitted token, not yet fed to the trunk;
  - the head's cache holds pairs (h_p, tok_{p+1}) for p < P, the last one being
    (h_{P-1}, y) written from the trunk's verified hidden;
  - `d1` (first draft) and `g` (the head's post-norm hidden that produced it)
    are already computed.
A cycle with depth k:
  1. draft: the head chains itself k-1 more times (its own hidden + draft);
  2. verify: the trunk runs [y, d1..dk] in ONE forward; GDN layers capture
     every position's state (caches.py), so rejection never re-runs the trunk;
  3. accept: targets t_i = sampler(p_i); keep drafts while d_i == t_{i-1}.
     Computed in-graph; the accepted count and targets are read with a
     single host transfer;
  4. commit: GDN layers take the state after the accepted prefix (by index),
     attention KV is trimmed; the head's cache drops its own drafting entries
     and is rewritten from the trunk's verified hiddens paired with the
     targets, which also yields the next cycle's first draft.
Emitted per cycle: d1..da and the target after them (a+1 tokens).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Generator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.sample_utils import greedy_sampler

from .caches import commit, make_trunk_cache, set_capturing, trim_attention


def mtp_disabled_by_env() -> bool:
    return os.environ.get("MLX_MTP_DISABLE", "0") not in ("", "0", "false", "False")


@dataclass
class MTPStats:
    """Counters of one generation. Acceptance at position i is the fraction of
    cycles that drafted a token at position i and had it accepted."""

    cycles: int = 0
    emitted: int = 0
    drafted_at: List[int] = field(default_factory=list)
    accepted_at: List[int] = field(default_factory=list)

    def record(self, depth: int, accepted: int, emitted: int):
        self.cycles += 1
        self.emitted += emitted
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < accepted)

    @property
    def drafted(self) -> int:
        return sum(self.drafted_at)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)

    @property
    def acceptance(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_cycle(self) -> float:
        return self.emitted / self.cycles if self.cycles else 0.0

    def as_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": [round(a, 4) for a in self.acceptance],
            "tokens_per_cycle": round(self.tokens_per_cycle, 4),
        }


def _logprobs(
    logits: mx.array,
    history: Optional[mx.array],
    extra: mx.array,
    logits_processors,
) -> mx.array:
    """Rows [T, V] of log-probabilities, processed exactly as plain decoding
    would at each position: row i sees history + extra[: i+1]."""
    if logits_processors:
        rows = []
        for i in range(logits.shape[0]):
            tokens = extra[: i + 1] if history is None else mx.concatenate([history, extra[: i + 1]])
            row = logits[i : i + 1]
            for proc in logits_processors:
                row = proc(tokens, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class OracleDrafter:
    """Benchmark/test drafter: proposes the known continuation `sequence`
    (e.g. the trunk's own greedy output), each draft right with probability
    `accept_rate` and otherwise deliberately wrong. It replaces only the head's
    proposals; verify, commit and the head-cache rewrite run as usual."""

    def __init__(self, sequence: List[int], accept_rate: float = 1.0, vocab_size: int = 2,
                 seed: int = 0):
        import random

        self.sequence = list(sequence)
        self.accept_rate = accept_rate
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, position: int, k: int) -> mx.array:
        out = []
        for i in range(k):
            j = position + i
            true = self.sequence[j] if j < len(self.sequence) else self.rng.randrange(self.vocab_size)
            right = self.rng.random() < self.accept_rate
            out.append(true if right else (true + 1) % self.vocab_size)
        return mx.array(out, dtype=mx.int32)


class MTPDecoder:
    """State of one MTP generation over a model from `mlx_mtp.load`."""

    def __init__(
        self,
        model,
        *,
        sampler: Optional[Callable] = None,
        logits_processors: Optional[list] = None,
        use_head: bool = True,
        oracle: Optional[OracleDrafter] = None,
    ):
        self.model = model
        self.sampler = sampler or greedy_sampler
        self.logits_processors = logits_processors or []
        self.use_head = use_head and model.has_mtp
        self.cache = make_trunk_cache(model)
        self.head_cache = model.mtp.make_cache() if self.use_head else None
        self.conv_kernel = model.language_model.args.linear_conv_kernel_dim
        self.history: Optional[mx.array] = None  # all tokens fed or emitted
        self.y: Optional[mx.array] = None  # last emitted token, shape [1]
        self.d1: Optional[mx.array] = None
        self.g: Optional[mx.array] = None
        self.stats = MTPStats()
        self.oracle = oracle
        self.n_emitted = 0

    # -- helpers ---------------------------------------------------------------
    def _need_history(self) -> bool:
        return bool(self.logits_processors)

    def _append_history(self, tokens: mx.array):
        if self._need_history():
            self.history = tokens if self.history is None else mx.concatenate([self.history, tokens])

    def _head(self, hidden: mx.array, tokens: mx.array) -> mx.array:
        """Head over hiddens [1, T, H] paired with tokens [T]; returns its hiddens."""
        return self.model.mtp(hidden, self.model.embed(tokens[None]), self.head_cache)

    def _draft_from(self, g: mx.array) -> mx.array:
        """Greedy draft token from one head hidden [1, 1, H] (shape [1])."""
        return mx.argmax(self.model.logits_from_hidden(g)[0, -1:], axis=-1)

    # -- prefill ----------------------------------------------------------------
    def prefill(self, prompt: mx.array, prefill_step_size: int = 2048, progress=None):
        """Process the prompt exactly as mlx_lm.generate_step does (same chunks,
        last token alone), filling the head's cache shifted by one. Returns the
        first token and its log-probabilities (not yet evaluated)."""
        model, total = self.model, prompt.size
        progress = progress or (lambda *_: None)
        processed = 0
        progress(0, total)
        while total - processed > 1:
            n = min(prefill_step_size, total - processed - 1)
            chunk = prompt[processed : processed + n]
            h = model.trunk_hidden(chunk[None], self.cache)
            if self.use_head:
                self._head(h, prompt[processed + 1 : processed + n + 1])
                mx.eval([c.state for c in self.head_cache])
            mx.eval([c.state for c in self.cache])
            self._append_history(chunk)
            processed += n
            progress(processed, total)
            mx.clear_cache()
        last = prompt[processed:]
        self._append_history(last)
        h = model.trunk_hidden(last[None], self.cache)
        logits = model.logits_from_hidden(h)[0]
        logprobs = _logprobs(logits, self.history[:-1] if self.history is not None else None,
                             last, self.logits_processors)
        y = self.sampler(logprobs)
        if self.use_head:
            self.g = self._head(h, y)
            self.d1 = self._draft_from(self.g)
        self.y = y
        self._append_history(y)
        self.n_emitted = 1
        return y, logprobs[0]

    # -- one cycle --------------------------------------------------------------
    def cycle(self, k: int) -> Tuple[List[int], mx.array, int]:
        """Draft k tokens, verify, commit. Returns (emitted tokens, their
        log-prob rows [a+1, V], a = accepted drafts). k == 0 is a plain step."""
        model = self.model
        if k == 0 or not self.use_head:
            return self._plain_step()

        # 1. draft chain (d1 and g come from the previous cycle / prefill)
        drafts, g = [self.d1], self.g
        for _ in range(k - 1):
            g = self._head(g, drafts[-1])
            drafts.append(self._draft_from(g))
        drafts = mx.concatenate(drafts)  # [k]
        if self.oracle is not None:
            drafts = self.oracle.propose(self.n_emitted, k)

        # 2. verify [y, d1..dk] in one trunk forward, capturing GDN states
        tokens = mx.concatenate([self.y, drafts])  # [k+1]
        set_capturing(self.cache, True)
        h = model.trunk_hidden(tokens[None], self.cache)  # [1, k+1, H]
        logits = model.logits_from_hidden(h)[0]
        history = self.history[:-1] if self.history is not None else None
        logprobs = _logprobs(logits, history, tokens, self.logits_processors)

        # 3. accept in-graph: a = length of the prefix where draft == target
        targets = self.sampler(logprobs).astype(mx.int32)  # [k+1]
        matches = (drafts.astype(mx.int32) == targets[:k]).astype(mx.int32)
        accepted = mx.cumprod(matches).sum()

        # 4. commit: GDN states by index; head rewritten from verified hiddens
        commit(self.cache, accepted + 1, k + 1, self.conv_kernel)
        set_capturing(self.cache, False)
        for c in self.head_cache:
            c.trim(k - 1)  # drop the drafting chain's own entries
        G = self._head(h, targets)  # [1, k+1, H]
        g_next = mx.take(G, accepted.reshape(1), axis=1)
        d1_next = self._draft_from(g_next)

        # the single host synchronization of the cycle
        packed = mx.concatenate([accepted.reshape(1), targets])
        mx.eval(packed, logprobs, g_next, d1_next, [c.state for c in self.cache],
                [c.state for c in self.head_cache])
        values = packed.tolist()
        a = values[0]
        emitted = values[1 : a + 2]

        trim_attention(self.cache, k - a)
        for c in self.head_cache:
            c.trim(k - a)
        self.y = targets[a : a + 1]
        self.g, self.d1 = g_next, d1_next
        if self._need_history():
            self._append_history(mx.array(emitted))
        self.stats.record(k, a, a + 1)
        self.n_emitted += a + 1
        return emitted, logprobs[: a + 1], a

    def _plain_step(self) -> Tuple[List[int], mx.array, int]:
        """One plain decoding step (depth 0); keeps the head's cache in sync."""
        model = self.model
        h = model.trunk_hidden(self.y[None], self.cache)
        logits = model.logits_from_hidden(h)[0]
        history = self.history[:-1] if self.history is not None else None
        logprobs = _logprobs(logits, history, self.y, self.logits_processors)
        y = self.sampler(logprobs)
        if self.use_head:
            self.g = self._head(h, y)
            self.d1 = self._draft_from(self.g)
            mx.eval(y, logprobs, self.d1)
        else:
            mx.eval(y, logprobs)
        self.y = y
        self._append_history(y)
        self.stats.record(0, 0, 1)
        self.n_emitted += 1
        return y.tolist(), logprobs, 0


def mtp_generate_step(
    prompt: mx.array,
    model,
    *,
    max_tokens: int = 256,
    draft_tokens: int = 2,
    sampler: Optional[Callable] = None,
    logits_processors: Optional[list] = None,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stats: Optional[MTPStats] = None,
    oracle: Optional[OracleDrafter] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft) like mlx_lm.generate_step, at most
    `max_tokens` of them (-1: no limit). draft_tokens=0, a model without a head,
    or MLX_MTP_DISABLE=1 give plain decoding."""
    k = 0 if mtp_disabled_by_env() else max(0, int(draft_tokens))
    dec = MTPDecoder(
        model, sampler=sampler, logits_processors=logits_processors, use_head=k > 0,
        oracle=oracle,
    )
    if stats is not None:
        dec.stats = stats
    with mx.stream(generation_stream):
        y, logprobs = dec.prefill(prompt, prefill_step_size, prompt_progress_callback)
        mx.eval(y, logprobs)
        if prompt_progress_callback:
            prompt_progress_callback(prompt.size, prompt.size)
        n = 0
        if max_tokens == 0:
            return
        yield y.item(), logprobs, False
        n += 1
        while max_tokens < 0 or n < max_tokens:
            remaining = max_tokens - n if max_tokens >= 0 else k + 1
            depth = min(k, remaining - 1) if dec.use_head else 0
            tokens, rows, a = dec.cycle(depth)
            for i, tok in enumerate(tokens):
                yield tok, rows[i], i < a
                n += 1
                if n == max_tokens:
                    return
            if n % 256 < len(tokens):
                mx.clear_cache()
