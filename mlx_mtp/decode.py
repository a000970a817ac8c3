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
  3. accept, computed in-graph; the accepted count and the emitted tokens
     are read with a single host transfer:
       - greedy (temp 0) and opaque samplers ("match"): targets
         t_i = sampler(p_i); keep drafts while d_i == t_{i-1}. Exact for any
         sampler, since each t_i is an independent sample of p_i;
       - an `MTPSampler` with temp > 0 (sampling.py): the head SAMPLES its
         drafts from q (its own logits through the same processors and
         filters), and drafts are verified by Leviathan–Chen; the emitted
         token after the accepted drafts is the residual sample (rejection)
         or the bonus sample from p_{k+1}. Randomness comes from an explicit
         key split per cycle (`seed`, else drawn from mx.random's state);
  4. commit: GDN layers take the state after the accepted prefix (by index),
     attention KV is trimmed; the head's cache drops its own drafting entries
     and is rewritten from the trunk's verified hiddens paired with the
     tokens actually emitted at each position (the accepted drafts, then the
     correction/bonus token; later positions are trimmed), which also yields
     the hidden of the next cycle's first draft (sampling mode drafts d1 at
     the start of the cycle, when the history the processors need is known).
Emitted per cycle: d1..da and the target after them (a+1 tokens).

`launch(k)` builds a cycle's graph, `land()` reads it. The synchronous loop
lands each cycle before launching the next (exact-length caches, host trims).
The pipelined loop (`start_pipeline`) first gives attention caches a device
length (caches.PaddedKVCache), so the trims are in-graph too and cycle n+1 is
queued before cycle n is read; compiled.py then runs each depth's cycle as one
mx.compile'd graph.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.sample_utils import greedy_sampler

from .depth import DepthController
from .caches import (PaddedKVCache, commit, make_trunk_cache, set_capturing, to_padded,
                     trim_attention)
from .sampling import MTPSampler, is_greedy, speculative_sample


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
    (e.g. the trunk's own greedy output), the draft for each position right
    with probability `accept_rate` and otherwise deliberately wrong. It
    replaces only the head's proposals; verify, commit and the head-cache
    rewrite run as usual. Proposals are a device-side table lookup at the
    decoder's device-resident position, so pipelined cycles can use it."""

    def __init__(self, sequence: List[int], accept_rate: float = 1.0, vocab_size: int = 2,
                 seed: int = 0, margin: int = 64):
        import random

        rng = random.Random(seed)
        table = []
        for j in range(len(sequence) + margin):
            true = sequence[j] if j < len(sequence) else rng.randrange(vocab_size)
            right = rng.random() < accept_rate
            table.append(true if right else (true + 1) % vocab_size)
        self.table = mx.array(table, dtype=mx.int32)

    def propose(self, position, k: int) -> mx.array:
        """Drafts [k] for emitted positions position..position+k-1 (position:
        int or device scalar; index 0 is the prompt's first generated token)."""
        idx = mx.minimum(position + mx.arange(k, dtype=mx.int32), self.table.size - 1)
        return mx.take(self.table, idx)


class DistributionDrafter:
    """Test/benchmark drafter for sampling: draws each draft on the host from a
    known distribution q(. | tokens generated so far + earlier drafts) and
    reports it (or, to test the tests, a deliberately wrong `claimed` one).

    dist(prefix: tuple of generated token ids) -> probabilities [V];
    claimed(prefix) -> the q reported to the decoder (default: dist).
    Like OracleDrafter it replaces only the head's proposals.
    """

    def __init__(self, dist: Callable, vocab_size: int, seed: int = 0,
                 claimed: Optional[Callable] = None):
        import numpy as np

        self.dist = dist
        self.claimed = claimed or dist
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def propose_dist(self, generated: List[int], k: int) -> Tuple[mx.array, mx.array]:
        import numpy as np

        prefix, drafts, qs = tuple(generated), [], []
        for _ in range(k):
            q = np.asarray(self.dist(prefix), dtype=np.float64)
            d = int(self.rng.choice(self.vocab_size, p=q / q.sum()))
            qs.append(np.asarray(self.claimed(prefix), dtype=np.float32))
            drafts.append(d)
            prefix = prefix + (d,)
        return mx.array(drafts, dtype=mx.int32), mx.array(np.stack(qs))


def _mix_seed(seed: int) -> int:
    """splitmix64 of the user's seed. MLX keys of nearby seeds (key(i), then
    split) give measurably correlated samples (counts over seeds 0..N-1 are
    under-dispersed, as with mx.random.seed(i) in mlx_lm); mixing makes runs
    with seeds 0, 1, 2, ... independent."""
    m = (1 << 64) - 1
    z = (int(seed) + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


class MTPDecoder:
    """State of one MTP generation over a model from `mlx_mtp.load`."""

    def __init__(
        self,
        model,
        *,
        sampler: Optional[Callable] = None,
        logits_processors: Optional[list] = None,
        use_head: bool = True,
        oracle=None,
        seed: Optional[int] = None,
        draft_vocab: Optional[mx.array] = None,
    ):
        self.model = model
        self.draft_vocab = draft_vocab  # greedy drafts over these ids only
        self._draft_rows = self._gather_draft_rows() if draft_vocab is not None else None
        self.sampler = sampler or greedy_sampler
        # Leviathan–Chen verification for samplers with known settings
        self.speculative = isinstance(sampler, MTPSampler) and sampler.speculative
        if oracle is not None and hasattr(oracle, "propose_dist") and not self.speculative:
            raise ValueError("a DistributionDrafter needs an MTPSampler with temp > 0")
        if self.speculative:
            self.key = (mx.random.key(_mix_seed(seed)) if seed is not None
                        else mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32))
        self.generated: List[int] = []  # host copy, kept for DistributionDrafter
        self._y0: Optional[mx.array] = None  # prefill's token, not yet in `generated`
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
        self.position = None  # device copy of n_emitted (an oracle's index)
        self.pipelined = False
        self.compiled = None
        # (hidden, token) pairs of plain steps the head has not seen yet: plain
        # steps leave the head idle and it catches up before the next draft
        self._pending: List[Tuple[mx.array, mx.array]] = []

    # -- helpers ---------------------------------------------------------------
    def _need_history(self) -> bool:
        return bool(self.logits_processors)

    def _append_history(self, tokens: mx.array):
        if self._need_history():
            self.history = tokens if self.history is None else mx.concatenate([self.history, tokens])

    def _head(self, hidden: mx.array, tokens: mx.array) -> mx.array:
        """Head over hiddens [1, T, H] paired with tokens [T]; returns its hiddens."""
        return self.model.mtp(hidden, self.model.embed(tokens[None]), self.head_cache)

    def _next_key(self, n: int) -> mx.array:
        """n fresh keys [n, 2]; the decoder's key advances (lazily, in-graph)."""
        keys = mx.random.split(self.key, n + 1)
        self.key = keys[0]
        return keys[1:]

    def _sync_generated(self):
        if self._y0 is not None:  # already evaluated by then: no extra sync
            self.generated = self._y0.tolist() + self.generated
            self._y0 = None

    def _draft_logprobs(self, g: mx.array, drafts: List[mx.array]) -> mx.array:
        """The head's log-probs [1, V] from hidden g, processed with the history
        the drafted position would have (history + drafts so far). With a
        trimmed draft vocabulary only its rows are projected; the others get
        -inf (q = 0 there: still exact, Leviathan–Chen's residual covers them)."""
        if self.draft_vocab is None:
            logits = self.model.logits_from_hidden(g)[0, -1:]
        else:
            logits = self._trimmed_draft_logits(g[0, -1:])
        if self.logits_processors:
            tokens = mx.concatenate([self.history] + drafts) if drafts else self.history
            for proc in self.logits_processors:
                logits = proc(tokens, logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _gather_draft_rows(self) -> dict:
        """The lm_head rows of the draft vocabulary, gathered once per
        generation (eagerly, so a compiled cycle captures them as constants)."""
        w = dict(self.model.lm_head_weights())
        ids = self.draft_vocab
        rows = {"weight": w["weight"][ids]}
        if w.get("scales") is not None:
            rows.update(scales=w["scales"][ids], biases=w["biases"][ids],
                        group_size=w["group_size"], bits=w["bits"])
        mx.eval({k: v for k, v in rows.items() if isinstance(v, mx.array)})
        return rows

    def _trimmed_draft_logits(self, h: mx.array) -> mx.array:
        """Head logits [1, V] over the draft vocabulary rows only (-inf elsewhere)."""
        r = self._draft_rows
        if "scales" in r:
            sub = mx.quantized_matmul(h, r["weight"], r["scales"], r["biases"], transpose=True,
                                      group_size=r["group_size"], bits=r["bits"])
        else:
            sub = h @ r["weight"].T
        V = self.model.lm_head_weights()["weight"].shape[0]
        full = mx.full((1, V), -float("inf"), dtype=sub.dtype)
        full[:, self.draft_vocab] = sub
        return full

    def _draft_from(self, g: mx.array) -> mx.array:
        """Greedy draft token from one head hidden [1, 1, H] (shape [1])."""
        return self.model.draft_tokens_from_hidden(g[0, -1:], self.draft_vocab)

    def _catch_up_head(self):
        """Feed the head the pairs of the plain steps since it last ran (one
        batched call), giving the hidden and first draft for the next cycle."""
        if not self._pending:
            return
        h = mx.concatenate([p[0] for p in self._pending], axis=1)
        toks = mx.concatenate([p[1] for p in self._pending])
        self._pending = []
        self.g = self._head(h, toks)[:, -1:]
        if not self.speculative:
            self.d1 = self._draft_from(self.g)

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
        self.position = mx.array(1, dtype=mx.int32)
        if self.speculative:
            y = self.sampler.sample(logprobs, self._next_key(1)[0]).astype(mx.int32)
            if self.use_head:
                self.g = self._head(h, y)
            self.y = self._y0 = y
            self._append_history(y)
            self.n_emitted = 1
            return y, logprobs[0]
        y = self.sampler(logprobs).astype(mx.int32)  # one dtype for every cycle's y
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
        pending = self.launch(k)
        mx.eval(pending.outputs)
        return self.land(pending)

    def launch(self, k: int) -> "PendingCycle":
        """Build one cycle's graph (nothing is evaluated); see `_launch_drafted`."""
        k = k if self.use_head else 0
        if self.compiled is not None:
            pending = self.compiled.launch(k)
        elif k == 0:
            pending = self._launch_plain()
        else:
            pending = self._launch_drafted(k)
        if self.pipelined:
            self._inflight.append(pending.k)
        return pending

    def _launch_drafted(self, k: int) -> "PendingCycle":
        """Build one cycle's graph (nothing is evaluated). Every state the next
        cycle needs is left as a lazy device array; only the host-side trims of
        exact-length caches wait for `land`. With padded caches
        (`start_pipeline`) those trims are in-graph too, so the next cycle can
        be launched before this one is read."""
        model = self.model
        self._reserve(k + 1 + len(self._pending))
        self._catch_up_head()

        # 1. draft (d1 and g come from the previous cycle / prefill)
        if self.speculative:
            keys = self._next_key(k + 1)
            drafts, q, chained = self._draft_sampled(k, keys)
        else:
            drafts, chained = self._draft_greedy(k)

        # 2. verify [y, d1..dk] in one trunk forward, capturing GDN states
        tokens = mx.concatenate([self.y, drafts])  # [k+1]
        set_capturing(self.cache, True)
        h = model.trunk_hidden(tokens[None], self.cache)  # [1, k+1, H]
        logits = model.logits_from_hidden(h)[0]
        history = self.history[:-1] if self.history is not None else None
        logprobs = _logprobs(logits, history, tokens, self.logits_processors)

        # 3. accept in-graph: `accepted` drafts, then out[accepted] is emitted
        #    after them (out[:accepted] == drafts[:accepted])
        if self.speculative:  # Leviathan–Chen: residual or bonus sample
            accepted, out = speculative_sample(self.sampler.target_logits(logprobs), q,
                                               drafts, keys[k])
        else:  # match: keep drafts while they equal the sampler's choice
            out = self.sampler(logprobs).astype(mx.int32)  # [k+1]
            matches = (drafts.astype(mx.int32) == out[:k]).astype(mx.int32)
            accepted = mx.cumprod(matches).sum()

        # 4. commit: GDN states by index; the head's drafting entries are
        #    dropped and rewritten from the verified hiddens paired with the
        #    emitted tokens, which yields the next cycle's first draft
        commit(self.cache, accepted + 1, k + 1, self.conv_kernel)
        if self.oracle is not None:
            self.position = self.position + accepted + 1
        set_capturing(self.cache, False)
        for c in self.head_cache:
            c.trim(chained)
        G = self._head(h, out)  # [1, k+1, H]
        g_next = mx.take(G, accepted.reshape(1), axis=1)
        self.g = g_next
        self.d1 = None if self.speculative else self._draft_from(g_next)
        if self.pipelined:  # roll back on the device: no host value needed
            trim_attention(self.cache, k - accepted)
            trim_attention(self.head_cache, k - accepted)
            self.y = mx.take(out, accepted.reshape(1))

        packed = mx.concatenate([accepted.reshape(1), out])
        outputs = [packed, logprobs, self.g, self.d1, self.key if self.speculative else None,
                   [c.state for c in self.cache], [c.state for c in self.head_cache]]
        return PendingCycle(k, packed, logprobs, out, outputs)

    def land(self, pending: "PendingCycle") -> Tuple[List[int], mx.array, int]:
        """Read a launched cycle (the one host transfer of the cycle) and do its
        host bookkeeping. Returns (emitted tokens, log-prob rows, accepted)."""
        k = pending.k
        values = pending.packed.tolist()
        a = values[0]
        emitted = values[1 : a + 2]
        if k > 0 and not self.pipelined:
            trim_attention(self.cache, k - a)
            trim_attention(self.head_cache, k - a)
            self.y = pending.out[a : a + 1]
        if self.pipelined:
            self._landed_len += a + 1
            self._inflight.popleft()
            bound = self._landed_len + sum(j + 1 for j in self._inflight)
            for c in self._padded_caches():
                c.set_bound(bound)
        if self._need_history():
            self._append_history(mx.array(emitted))
        if self.speculative:
            self._sync_generated()
            self.generated.extend(emitted)
        self.stats.record(k, a, a + 1)
        self.n_emitted += a + 1
        return emitted, pending.logprobs[: a + 1], a

    def _draft_greedy(self, k: int) -> Tuple[mx.array, int]:
        """d1 (from the previous cycle) and k-1 chained greedy drafts [k];
        returns them and how many entries the chain added to the head's cache."""
        drafts, g = [self.d1], self.g
        for _ in range(k - 1):
            g = self._head(g, drafts[-1])
            drafts.append(self._draft_from(g))
        drafts = mx.concatenate(drafts)
        if self.oracle is not None:
            drafts = self.oracle.propose(self.position, k)
        return drafts, k - 1

    def _draft_sampled(self, k: int, keys: mx.array) -> Tuple[mx.array, mx.array, int]:
        """Drafts d_j ~ q_j with q_j the head's processed, filtered, tempered
        distribution (d1 from g, the previous cycle's rewrite). Returns
        (drafts [k], q [k, V], entries the chain added to the head's cache)."""
        if self.oracle is not None and hasattr(self.oracle, "propose_dist"):
            self._sync_generated()
            drafts, q = self.oracle.propose_dist(self.generated, k)
            return drafts, q, 0
        g, dl, ql = self.g, [], []
        for j in range(k):
            if j > 0:
                g = self._head(g, dl[-1])
            d, qj = self.sampler.draft(self._draft_logprobs(g, dl), keys[j])
            dl.append(d)
            ql.append(qj)
        drafts, q = mx.concatenate(dl), mx.concatenate(ql)  # [k], [k, V]
        if self.oracle is not None:  # OracleDrafter: claims q one-hot
            drafts = self.oracle.propose(self.position, k)
            q = (mx.arange(q.shape[-1]) == drafts[:, None]).astype(mx.float32)
        return drafts, q, k - 1

    def _launch_plain(self) -> "PendingCycle":
        """One plain decoding step (depth 0); the head stays idle."""
        model = self.model
        self._reserve(1)
        h = model.trunk_hidden(self.y[None], self.cache)
        logits = model.logits_from_hidden(h)[0]
        history = self.history[:-1] if self.history is not None else None
        logprobs = _logprobs(logits, history, self.y, self.logits_processors)
        if self.speculative:
            y = self.sampler.sample(logprobs, self._next_key(1)[0])
        else:
            y = self.sampler(logprobs)
        y = y.astype(mx.int32)
        if self.oracle is not None:
            self.position = self.position + 1
        if self.use_head:
            self._pending.append((h, y))
        self.y = y
        packed = mx.concatenate([mx.zeros((1,), mx.int32), y])
        outputs = [packed, logprobs, self.key if self.speculative else None,
                   [c.state for c in self.cache]]
        return PendingCycle(0, packed, logprobs, y, outputs)

    # -- pipelining -------------------------------------------------------------
    def start_pipeline(self, reserve: int = 0, compiled: bool = False):
        """Switch to device-resident cache lengths (after prefill), so cycles
        can be launched before the previous one is read (`launch`/`land`)."""
        if self.logits_processors or hasattr(self.oracle, "propose_dist"):
            raise ValueError("pipelined decoding needs no logits processors and no "
                             "DistributionDrafter")
        self.cache = to_padded(self.cache, reserve)
        if self.head_cache is not None:
            self.head_cache = to_padded(self.head_cache, reserve)
        self.pipelined = True
        from . import metal as kernels

        # emulated kernels (tests) run on the host: they cannot be traced
        if compiled and not kernels.backend().startswith("emu"):
            from .compiled import CompiledCycles

            # a lazy weight captured by the trace would be recomputed every call
            mx.eval(self.model.parameters())

            self.compiled = CompiledCycles(self)
        self._landed_len = next((c.bound for c in self._padded_caches()), 0)
        self._inflight = deque()

    def _padded_caches(self):
        for c in list(self.cache) + list(self.head_cache or []):
            if isinstance(c, PaddedKVCache):
                yield c

    def _reserve(self, n: int):
        """Room for n more entries in every padded cache (one cycle's worth)."""
        if self.pipelined:
            for c in self._padded_caches():
                c.reserve(c.bound + n)


@dataclass
class PendingCycle:
    """A launched cycle: `packed` = [accepted, emitted candidates...]."""

    k: int
    packed: mx.array
    logprobs: mx.array
    out: mx.array
    outputs: list
    traced: bool = False  # its launch traced a compiled graph (slow, not a cost sample)


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
    oracle=None,
    seed: Optional[int] = None,
    draft_vocab: Optional[mx.array] = None,
    max_draft_tokens: int = 4,
    controller: Optional[DepthController] = None,
    pipeline: bool = True,
    compiled: bool = True,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft) like mlx_lm.generate_step, at most
    `max_tokens` of them (-1: no limit). draft_tokens="auto" picks the depth
    per cycle (0..max_draft_tokens) from measured acceptance and cost;
    draft_tokens=0, a model without a head, or MLX_MTP_DISABLE=1 give plain
    decoding. pipeline=True double-buffers cycles (device-resident cache
    lengths) and compiled=True runs each depth's cycle as one mx.compile'd
    graph; logits processors and a DistributionDrafter use the synchronous
    loop (exact-length caches, every cycle read before the next is built)."""
    if draft_tokens == "auto":
        controller = controller or DepthController(max_depth=max_draft_tokens)
        k = max_draft_tokens
    elif isinstance(draft_tokens, str) and not draft_tokens.isdigit():
        raise ValueError(f"draft_tokens must be an integer >= 0 or 'auto', not {draft_tokens!r}")
    else:
        k, controller = max(0, int(draft_tokens)), None
    if mtp_disabled_by_env():
        k, controller = 0, None
    if k > 0 and not is_greedy(sampler) and not isinstance(sampler, MTPSampler):
        import warnings

        warnings.warn("mlx_mtp: this sampler cannot be introspected, so drafts are verified by "
                      "exact match (still exact, fewer accepted); build it with "
                      "mlx_mtp.make_sampler for Leviathan-Chen acceptance", stacklevel=2)
    dec = MTPDecoder(
        model, sampler=sampler, logits_processors=logits_processors, use_head=k > 0,
        oracle=oracle, seed=seed, draft_vocab=draft_vocab,
    )
    if controller is not None and not dec.use_head:
        controller = None
    if stats is not None:
        dec.stats = stats
    pipelined = pipeline and not logits_processors and not hasattr(oracle, "propose_dist")
    with mx.stream(generation_stream):
        y, logprobs = dec.prefill(prompt, prefill_step_size, prompt_progress_callback)
        mx.eval(y, logprobs)
        if prompt_progress_callback:
            prompt_progress_callback(prompt.size, prompt.size)
        if max_tokens == 0:
            return
        yield y.item(), logprobs, False
        if max_tokens == 1:
            return
        if pipelined:
            yield from _pipelined_cycles(dec, k, controller, max_tokens, compiled)
        else:
            yield from _synchronous_cycles(dec, k, controller, max_tokens)


def _emit(tokens, rows, a, n, max_tokens):
    """Yield one cycle's tokens, never past max_tokens; returns the new count."""
    for i, tok in enumerate(tokens):
        yield tok, rows[i], i < a
        n += 1
        if n == max_tokens:
            break
    if n % 256 < len(tokens):
        mx.clear_cache()
    return n


def _synchronous_cycles(dec, k, controller, max_tokens):
    """Launch a cycle, read it, yield its tokens; then the next."""
    n = 1
    while max_tokens < 0 or n < max_tokens:
        # the depth is never capped by max_tokens (extra tokens are dropped):
        # both loops then split the same random keys for a seed
        depth = controller.next_depth() if controller is not None else k
        tic = time.perf_counter()
        tokens, rows, a = dec.cycle(depth)
        if controller is not None:
            controller.update(depth, a, time.perf_counter() - tic)
        n = yield from _emit(tokens, rows, a, n, max_tokens)
        if n == max_tokens:
            return


def _pipelined_cycles(dec, k, controller, max_tokens, compiled=False):
    """Double-buffered: cycle n+1 is built and queued (mx.async_eval) before
    cycle n is read, so the device never waits for Python. Tokens are read one
    cycle late; a cycle launched past EOS or max_tokens is simply never read
    (nothing of it reaches the caller).

    The controller learns acceptance when a cycle is read. A cost sample is
    the time between two reads, given to the cycle the host waited on: on GPU
    backends the one being read; on MLX's CPU backend async_eval itself runs
    all but the last few queued ops (its scheduler keeps at most ~10 tasks in
    flight), so there it is the one just launched."""
    n = 1
    # room for the whole generation, including the last cycles' drafts past
    # max_tokens, so the compiled graphs never see the capacity change
    reserve = (max_tokens if max_tokens > 0 else 0) + 2 * (k + 1) + 2
    dec.start_pipeline(reserve, compiled=compiled)
    inflight: Optional[PendingCycle] = None
    tic = time.perf_counter()
    while True:
        launched = None
        # the in-flight cycle emits at least one token
        remaining = max_tokens - n - (1 if inflight is not None else 0)
        t0 = time.perf_counter()
        if max_tokens < 0 or remaining > 0:
            launched = dec.launch(controller.next_depth() if controller is not None else k)
            mx.async_eval(launched.outputs)
        t1 = time.perf_counter()
        if inflight is None:
            inflight = launched
            tic = t1
            continue
        tokens, rows, a = dec.land(inflight)
        toc = time.perf_counter()
        if controller is not None:
            controller.update_acceptance(inflight.k, a)
            waited_on = launched if launched is not None and t1 - t0 > toc - t1 else inflight
            # a period that traced (or first ran) a compiled graph is not a cost sample
            if not (waited_on.traced or (launched is not None and launched.traced)):
                controller.update_cost(waited_on.k, toc - tic)
        tic = toc
        n = yield from _emit(tokens, rows, a, n, max_tokens)
        if n == max_tokens:
            return
        inflight = launched
