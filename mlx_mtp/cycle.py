"""One decode cycle: pure functions over an explicit state.

`DecodeState` holds every device array a cycle reads or writes (the caches,
the last token, the head's hidden, each row's sampler settings and key, ...).
Each step is a function state -> (state, output) with nothing kept elsewhere:

  drafted_cycle(k)  0. catch up (after plain steps): the head takes the
                       pairs the plain steps left in the ring, in one forward;
                    1. draft: the head drafts d1..dk by chaining itself (its
                       post-norm hidden + the token it drafted);
                    2. verify: the trunk runs [y, d1..dk] in ONE forward, its
                       GDN layers keeping a tape of what each position's
                       update consumed (k, v, g, beta);
                    3. accept, in-graph, per row (`acceptance.accept`, the one
                       rule every draft goes through): greedy rows keep drafts
                       while they equal the arg-max, sampled rows by
                       Leviathan–Chen, an opaque sampler by match;
                    4. commit: GDN states replayed from the state before the
                       cycle over each row's accepted prefix, attention lengths cut to
                       the accepted prefix, the head's cache rewritten from the
                       trunk's verified hiddens (which gives the next draft's hidden).
                    Emits a+1 tokens: the a accepted drafts, then the trunk's.
  plain_step        one token, no drafting (depth 0), no head forward: the
                    pair (trunk hidden, token) goes into a ring of the last
                    RING pairs, which the head catches up on when it drafts
                    again (after a longer run of plain steps it drafts from a
                    history with a gap: acceptance may dip, exactness cannot).
                    Parked with no probe due, the loop runs depth 0's own graph
                    instead: no pair is written and the ring is dropped (a gap).

A drafted cycle is three stages with typed seams between them: `propose`
(catch up, draft) -> `Proposals`; `verify` (the trunk's forward, each GDN
layer's `Capture` taken out of its cache) -> `Verified`; `settle` (accept,
commit). `drafted_cycle` runs the three in one graph. A plain step is two:
`plain_forward` -> `Forwarded` -> `plain_sample` (one graph, or two when a
constrained batch queues the forward before it has the mask).

Feeding mlx_lm's own caches (the prompt, the tokens a finished generation
leaves) is `prefill.py`'s: nothing here mutates a prompt cache.

Invariant at the start of a cycle (P = tokens in the trunk's cache): `y` is
the last emitted token, not yet fed; the head's cache holds the pairs
(h_p, tok_{p+1}) for p < P, the last one (h_{P-1}, y), but those waiting in
the ring (`ring_n` of them, the last RING kept) and those skipped (a gap:
older than the ring, or plain steps of depth 0's graph); when none wait or
were skipped, `g` is the head's hidden of that last pair (it drafts d1;
after a gap `g` is older, and only acceptance pays).

`Graphs.step` runs a step through a graph compiled once per depth and mode
with the state as its input (`DecodeState.tree()` lists every field, so a
new field is an input and output of the graph by construction) and keeps the
graphs on the model across generations. See docs/design.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple

import mlx.core as mx
import numpy as np

from . import metal
from .cache import Capture, CaptureCache, MTPCache
from .distributed import share
from .families.mrope import shifted
from .constraint import apply_bitmask
from .acceptance import DraftRun, accept
from .context_draft import append_tokens, propose_runs
from .sampling import (Filters, SamplerArrays, advance_window, sample_drafts, is_greedy,
                       penalize_rows, sample_opaque, sample_rows, split_rows)

RING = 16  # plain steps' pairs kept for the head (older ones are skipped)
CTX_FIELDS = ("ctx_tokens", "ctx_len", "ctx_table")  # DecodeState's context index



class Drafter(Protocol):
    """What the decode loop asks of a drafter."""

    host_side: bool  # proposals need the host: the loop reads every cycle before
    #                  building the next, runs it eagerly, and reports the tokens
    replaces_head: bool  # the head's own chain is skipped

    def arrays(self) -> list:
        """Device arrays the proposals read (passed to compiled graphs)."""

    def graph_key(self) -> tuple:
        """What a compiled graph bakes in."""

    def propose(self, arrays, state, k: int, head_drafts, head_q):
        """(drafts [B, k], q [B, k, V] or None) for a cycle of depth k; `state`
        is the cycle's DecodeState (its y and emitted are per row). q None:
        every draft is a point draft (q = δ at it: `acceptance.DraftRun`),
        what a deterministic drafter's drafts are."""

    def start(self) -> None:
        """Host-side drafters: a row starts (its generated tokens: none yet)."""

    def observe(self, tokens: List[int]) -> None:
        """Host-side drafters: tokens the row emitted, as each cycle is read."""


def is_host_side(drafter: Optional[Drafter]) -> bool:
    """A drafter whose proposals need the host: its batch decodes one row,
    eagerly, each cycle read before the next."""
    return drafter is not None and drafter.host_side


@dataclass
class DecodeState:
    """Everything a cycle reads and writes, as device arrays (batch axis first)."""

    cache: MTPCache
    y: mx.array  # [B] int32: last emitted token, not yet fed to the trunk
    emitted: mx.array  # [B] int32: tokens emitted so far (drafters index by it)
    g: Optional[mx.array] = None  # [B, 1, H]: head hidden that drafts the next d1
    ring_h: Optional[mx.array] = None  # [B, RING, H]: plain steps' hiddens ...
    ring_tok: Optional[mx.array] = None  # [B, RING]: ... paired with their tokens
    ring_n: Optional[mx.array] = None  # []: pairs written since the head caught up
    key: Optional[mx.array] = None  # [B, 2]: each row's random key (sampled rows)
    sampling: SamplerArrays = SamplerArrays()  # each row's sampler settings
    window: Optional[mx.array] = None  # [B, W]: the tokens fed before y (sampling.py)
    # [B] int32: each row's M-RoPE shift after its images (None: no row has one;
    # docs/design.md, "Images")
    rope_delta: Optional[mx.array] = None
    # each row's context index (context_draft.py, "on the device"; None: the
    # batch drafts no context runs): its last tokens, their count, the n-gram table
    ctx_tokens: Optional[mx.array] = None  # [B, WINDOW + 1] int32
    ctx_len: Optional[mx.array] = None  # [B] int32
    ctx_table: Optional[mx.array] = None  # [B, BUCKETS + 1] int32
    # [B, 2] float32: per row, how often its context runs' and the head's first
    # drafts were kept (moving averages): a row drafts its run where it has one
    # and the run's is at least the head's (`draft`)
    ctx_trust: Optional[mx.array] = None

    def tree(self) -> dict:
        """Every field (caches as their `state`): a compiled step's inputs."""
        return {f.name: self.cache.state if f.name == "cache" else self.sampling.tree()
                if f.name == "sampling" else getattr(self, f.name)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_tree(cls, tree: dict, layout: tuple) -> "DecodeState":
        """The state of cache `layout` holding `tree`'s arrays."""
        return cls(**{**tree, "cache": MTPCache.from_state(tree["cache"], layout),
                      "sampling": SamplerArrays(**tree["sampling"])})

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)

    def without_buffers(self) -> "DecodeState":
        """What a finishing point keeps (the caches' lengths and states, not
        their KV buffers nor the context index: nothing writes them back)."""
        return self.replace(cache=self.cache.without_buffers(), **{n: None for n in CTX_FIELDS})

    def with_context(self, tokens: mx.array, count: mx.array, sizes) -> "DecodeState":
        """The rows' context index after they emit tokens[b, :count[b]] (no index: as is)."""
        if self.ctx_tokens is None or sizes is None:
            return self
        return self.replace(**dict(zip(CTX_FIELDS, append_tokens(
            self.ctx_tokens, self.ctx_len, self.ctx_table, tokens, count, sizes))))

    def without_caches(self) -> "DecodeState":
        """The state of a step that neither reads nor writes the caches."""
        return self.replace(cache=MTPCache([], []))

    # the head's part of the state, which a parked plain step neither reads nor writes
    HEAD_FIELDS = ("g", "ring_h", "ring_tok", "ring_n")

    def without_head(self) -> "DecodeState":
        """What a plain step without the head reads (a batch parked at depth 0
        between probes: the graph is then depth 0's; docs/design.md §3)."""
        return self.replace(cache=MTPCache(self.cache.trunk, []),
                            **{n: None for n in self.HEAD_FIELDS})

    def with_head_of(self, other: "DecodeState") -> "DecodeState":
        """This state with `other`'s head part, its ring dropped (the pairs
        waiting there are skipped, like those of the plain steps since)."""
        head = {n: getattr(other, n) for n in self.HEAD_FIELDS}
        head["ring_n"] = mx.zeros_like(other.ring_n)
        return self.replace(cache=MTPCache(self.cache.trunk, other.cache.head), **head)

    def _rows(self) -> List[str]:
        """The array fields with a batch axis (the ring's count is the batch's)."""
        return [f.name for f in dataclasses.fields(self)
                if f.name not in ("cache", "ring_n", "sampling")]

    def take_rows(self, rows) -> "DecodeState":
        """These batch rows only."""
        rows = mx.array(rows, dtype=mx.int32)
        picked = {n: None if getattr(self, n) is None else getattr(self, n)[rows]
                  for n in self._rows()}
        return DecodeState(self.cache.take_rows(rows), ring_n=self.ring_n,
                           sampling=self.sampling.take_rows(rows), **picked)

    @staticmethod
    def concat(a: "DecodeState", b: "DecodeState") -> "DecodeState":
        """a's rows, then b's; both rings empty (caught up before). A field
        only one side has is dropped: the batch's settings decide which
        fields exist (`Batch._settings`)."""
        joined = {n: None if getattr(a, n) is None or getattr(b, n) is None
                  else mx.concatenate([getattr(a, n), getattr(b, n)]) for n in a._rows()}
        return DecodeState(MTPCache.concat(a.cache, b.cache), ring_n=a.ring_n,
                           sampling=SamplerArrays.concat(a.sampling, b.sampling), **joined)


@dataclass
class Guidance:
    """What the rows' grammars say before a cycle (constrained batches; a row
    without a grammar allows everything): the tokens allowed at the next
    position, which both the draft d1 and the verify's first position are
    sampled at, and the drafts the grammar forces (each the only token its
    position allows), which take the head's place."""

    first: mx.array  # [B, W] int32: packed mask (-1: every token)
    forced: Optional[mx.array] = None  # [B, k] int32: forced drafts, -1 where the head drafts
    forced_all: bool = False  # every row's k drafts forced: the head does not draft (static)

    def tree(self) -> dict:
        return {"first": self.first, "forced": self.forced}

    @classmethod
    def from_tree(cls, tree: dict, forced_all: bool) -> "Guidance":
        return cls(tree["first"], tree["forced"], forced_all)


@dataclass
class StepOutput:
    # [B, 1 + 2 (k + 1) + 2] int32: accepted count, the k+1 candidate tokens,
    # their log-probs as float32 bits, the drafts outside the vocabulary, whether
    # the row drafted its context run (one host transfer reads a cycle)
    packed: mx.array
    logprobs: mx.array  # [B, k + 1, V]: the (processed) log-probs of every candidate


class CycleRead(NamedTuple):
    """A read cycle's packed rows (`unpack`)."""

    accepted: np.ndarray  # [B]
    tokens: np.ndarray  # [B, k+1]: as the sampler gave them
    logprobs: np.ndarray  # [B, k+1]: theirs
    bad_drafts: np.ndarray  # [B]: drafts outside the vocabulary
    # [B] bool: a drafted cycle's row drafted its context run; a plain step's
    # row has one to draft now
    context: np.ndarray


def unpack(values: np.ndarray, k: int) -> CycleRead:
    return CycleRead(values[:, 0], values[:, 1:k + 2],
                     values[:, k + 2:2 * k + 3].copy().view(np.float32), values[:, 2 * k + 3],
                     values[:, 2 * k + 4].astype(bool))


def in_vocab(ids: mx.array, vocab_size: int) -> Tuple[mx.array, mx.array]:
    """(ids fit to gather with, per row the number outside the vocabulary).
    MLX's take and embedding do not check bounds: every id a sampler, a
    logits processor or a drafter produced passes here before the device
    uses it, and the host raises on the count or the raw ids it reads
    (docs/design.md, "Memory safety")."""
    ok = (ids >= 0) & (ids < vocab_size)
    return mx.where(ok, ids, 0), (~ok).astype(mx.int32).reshape(ids.shape[0], -1).sum(axis=1)


@dataclass
class Spec:
    """What a batch's graphs depend on: the model, how it drafts, samples and
    accepts. Graphs are compiled per `graph_key()`; a batch builds a new
    spec when rows with other needs join (`Batch._settings`)."""

    model: Any
    sampler: Optional[Callable] = None  # an opaque sampler every row shares (match)
    filters: Filters = field(default_factory=Filters)  # per-row sampling (sampler None)
    use_head: bool = True
    processors: bool = False  # some row has logits processors (host history)
    draft_vocab: Optional[mx.array] = None  # greedy/sampled drafts over these ids only
    drafter: Optional[Drafter] = None  # tests and benchmarks (testing/drafters.py)
    # context drafts: the n-gram sizes each row's index looks up (None: off;
    # context_draft.py), the rows' runs drafted in place of the head's
    context: Optional[tuple] = None
    vocab_head_rows: Optional[dict] = field(default=None, repr=False)
    group: Any = None  # sharded model: the ranks that take rank 0's decisions
    first_stage: Optional[int] = None  # pipeline: the rank that embeds the tokens

    def shared(self, x: mx.array) -> mx.array:
        """Rank 0's decision on every rank (sharded models; see distributed.py)."""
        return x if self.group is None else share(x, self.group)

    def verified_drafts(self, drafts: mx.array, h: Optional[mx.array] = None) -> mx.array:
        """The drafts every rank verifies. Tensor parallel: rank 0's, agreed
        before the forward (every rank embeds them). Pipeline: the first
        stage's (it alone embeds them), agreed after the forward (h given):
        before it, rank 0's receive of the hidden states, which has no
        inputs, could run first and wait on a stage waiting in the agreement."""
        if self.group is None or (h is None) != (self.first_stage is None):
            return drafts
        if h is None:
            return self.shared(drafts)
        return share(mx.depends(drafts, h), self.group, self.first_stage)

    def __post_init__(self):
        if self.sampler is not None and is_greedy(self.sampler):
            self.sampler = None  # greedy rows are per-row settings too
        if self.draft_vocab is not None and self.vocab_head_rows is None and self.speculative:
            self.vocab_head_rows = _vocab_head_rows(self.model, self.draft_vocab)  # sampled drafts project them

    @property
    def speculative(self) -> bool:
        """Some row samples with Leviathan–Chen acceptance (keys, q)."""
        return self.sampler is None and self.filters.sampled

    @property
    def trusted_sampler(self) -> bool:
        """Not an opaque sampler (those draw from mx.random's global state: their
        steps run eagerly, each read before the next)."""
        return self.sampler is None

    @property
    def host_history(self) -> bool:
        """Its steps need the rows' tokens on the host (processors, host-side
        drafters): each cycle read before the next."""
        return self.processors or is_host_side(self.drafter)

    @property
    def compilable(self) -> bool:
        """Processors need the host's token history, opaque samplers mx.random's
        global state, host drafters and tables on disk the host: those steps
        run eagerly."""
        return (not self.host_history and self.sampler is None and not self.model.host_lookups
                and not metal.backend().startswith("emu"))

    def graph_key(self) -> tuple:
        vocab = None if self.draft_vocab is None else self.draft_vocab.size
        drafter = None if self.drafter is None else self.drafter.graph_key()
        return (self.filters, self.use_head, vocab, drafter, self.context, metal.backend(),
                metal.fused_default())

    def static(self) -> "Spec":
        """This spec without the arrays of one call (a graph gets those in `aux`)."""
        return dataclasses.replace(self, draft_vocab=None, vocab_head_rows=None)

    def aux(self) -> dict:
        """Arrays a graph reads besides the state (passed, not baked in)."""
        return {"vocab_head_rows": self.vocab_head_rows, "vocab": self.draft_vocab,
                "drafter": self.drafter.arrays() if self.drafter is not None else None}


def _vocab_head_rows(model, ids: mx.array) -> dict:
    """The lm_head rows of a draft vocabulary, gathered once per generation."""
    w = dict(model.lm_head_weights())
    rows = {"weight": w["weight"][ids]}
    if w.get("scales") is not None:
        rows.update(scales=w["scales"][ids], biases=w["biases"][ids])
    mx.eval(rows)
    return rows


# -- shared pieces ---------------------------------------------------------------------
def _logprobs(spec: Spec, logits: mx.array, state: DecodeState, history: Optional[list],
              tokens: mx.array, offset: int = 0, words: Optional[mx.array] = None) -> mx.array:
    """Log-probs [B, T, V] of logits [B, T, V], with each row's logit bias and
    penalties, processed as plain decoding would at each position: row b's
    processors see its history + tokens[b, : offset + i + 1] at position i
    (history: per row, (processors, token history) or None; rows without
    processors untouched), then each row's grammar mask at each position
    (words [B, T, W] packed, -1: every token), last, as a masking processor."""
    if state.sampling.bias is not None:
        logits = logits + state.sampling.bias[:, None].astype(logits.dtype)
    if state.window is not None:
        logits = penalize_rows(logits, state.window, tokens, offset, state.sampling, spec.filters)
    if history is not None:
        rows = []
        for b, entry in enumerate(history):
            row = logits[b:b + 1]
            if entry is not None:
                procs, seen = entry
                cols = []
                for i in range(row.shape[1]):
                    context = mx.concatenate([seen, tokens[b, : offset + i + 1]])
                    col = row[:, i]
                    for proc in procs:
                        col = _processed(proc, context, col)
                    cols.append(col)
                row = mx.stack(cols, axis=1)
            rows.append(row)
        logits = mx.concatenate(rows)
    if words is not None:
        logits = apply_bitmask(logits, words)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _processed(proc, context: mx.array, logits: mx.array) -> mx.array:
    """A logits processor's output, which must keep the logits' shape (a
    wider row would let a sampler pick an id past the vocabulary)."""
    out = proc(context, logits)
    if not isinstance(out, mx.array) or out.shape != logits.shape:
        shape = getattr(out, "shape", type(out).__name__)
        raise TypeError(f"the logits processor {proc!r} returned {shape} for logits of shape "
                        f"{tuple(logits.shape)}: it must return the same shape")
    return out


def head_forward(model, hidden: mx.array, tokens: mx.array, cache: list,
                 embeddings: Optional[mx.array] = None) -> mx.array:
    """The head over hiddens [B, T, H] paired with tokens [B, T] (or with
    `embeddings` [B, T, H] for them: an image's features at its pads)."""
    return model.mtp(hidden, model.embed(tokens) if embeddings is None else embeddings, cache)


def _draft_logprobs(spec: Spec, aux: dict, state: DecodeState, g: mx.array, history,
                    drafts: list, words: Optional[mx.array] = None) -> mx.array:
    """The head's processed log-probs [B, V] at hidden g [B, 1, H]. With a
    trimmed draft vocabulary only its rows are projected (the rest get -inf:
    q = 0 there, still exact since Leviathan–Chen's residual covers them)."""
    model = spec.model
    if aux["vocab_head_rows"] is None:
        logits = model.logits_from_hidden(g)[:, -1]
    else:
        r, h = aux["vocab_head_rows"], model.lm_input(g[:, -1])
        if "scales" in r:
            w = model.lm_head_weights()
            sub = mx.quantized_matmul(h, r["weight"], r["scales"], r["biases"], transpose=True,
                                      group_size=w["group_size"], bits=w["bits"])
        else:
            sub = h @ r["weight"].T
        logits = mx.full((h.shape[0], model.vocab_size), -float("inf"), dtype=sub.dtype)
        logits[:, aux["vocab"]] = sub
    seen = mx.stack(drafts, axis=1) if drafts else mx.zeros((g.shape[0], 0), mx.int32)
    tokens = mx.concatenate([state.y[:, None], seen], axis=1)
    return _logprobs(spec, logits[:, None], state, history, tokens, len(drafts),
                     None if words is None else words[:, None])[:, 0]


class Drafts(NamedTuple):
    """A cycle's drafts before the verify (`draft`)."""

    tokens: mx.array  # [B, k] int32
    q: Optional[mx.array]  # [B, k, V]: what each was drawn from (None: every one a point draft)
    point: Optional[mx.array]  # [B, k] bool: point drafts among drawn ones (None: by q alone)
    context: Optional[mx.array]  # [B] bool: the row's drafts are its context run
    chained: int  # entries the head's chain added to its cache


def draft(spec: Spec, aux: dict, state: DecodeState, g: mx.array, head_cache: list, k: int,
          keys: Optional[mx.array], history, guidance: Optional[Guidance] = None,
          head: Optional[int] = None, context: bool = False) -> Drafts:
    """k drafts per row: the head's chain of `head` (default k) drafts, then
    (a context run's width) the last one repeated; a row whose suffix occurred
    before in its context (spec.context) drafts its context run instead (point
    drafts); a draft the grammar forces replaces either (q one-hot there:
    Leviathan–Chen then keeps it with probability 1). Sampled drafts come with
    their q; greedy ones with none. Under guidance, d1 is drawn from the
    head's distribution masked by the grammar (the others unmasked: a draft
    the grammar refuses is rejected at its own verify position)."""
    model, drafter = spec.model, spec.drafter
    head = k if head is None else head
    if drafter is not None and drafter.replaces_head:
        drafts, q = drafter.propose(aux["drafter"], state, k, None, None)
        return Drafts(drafts, q, None, None, 0)
    forced = guidance.forced if guidance is not None else None
    if guidance is not None and guidance.forced_all:  # the grammar drafts alone
        q = (mx.arange(model.vocab_size) == forced[..., None]).astype(mx.float32) \
            if spec.speculative else None
        return Drafts(forced, q, None, None, 0)
    drafts, qs = [], []
    full = (spec.speculative or state.sampling.bias is not None or state.window is not None
            or history is not None or guidance is not None)
    for j in range(head):
        if j > 0:
            g = head_forward(model, g, drafts[-1][:, None], shifted(head_cache, state.rope_delta))
        words = guidance.first if guidance is not None and j == 0 else None
        if spec.speculative:  # each row with its own key
            lp = _draft_logprobs(spec, aux, state, g, history, drafts, words)
            d, q = sample_drafts(lp, state.sampling, spec.filters, keys[:, j])
        elif full:  # greedy drafts from processed logits
            d, q = mx.argmax(_draft_logprobs(spec, aux, state, g, history, drafts, words),
                             axis=-1), None
        else:
            d, q = model.draft_tokens_from_hidden(g[:, -1], aux["vocab"]), None
        d = d.astype(mx.int32)
        if forced is not None:  # (the chain goes on from the forced token)
            d = mx.where(forced[:, j] >= 0, forced[:, j], d)
        if q is not None:
            qs.append(q)
        drafts.append(d)
    B = state.y.shape[0]
    tokens = mx.stack(drafts, axis=1) if drafts else mx.zeros((B, 0), mx.int32)
    q = mx.stack(qs, axis=1) if qs else None
    point = None
    if head < k:  # a context run's width: the head's last draft repeated (point drafts)
        filler = tokens[:, -1:] if head else state.y[:, None]
        tokens = mx.concatenate([tokens, mx.repeat(filler, k - head, axis=1)], axis=1)
        if q is not None:
            q = mx.concatenate([q, mx.zeros((B, k - head, q.shape[-1]), q.dtype)], axis=1)
        point = mx.broadcast_to(mx.arange(k) >= head, (B, k))
    found = None
    if context and spec.context is not None:
        runs, found = propose_runs(state.ctx_tokens, state.ctx_len, state.ctx_table, k,
                                     spec.context)
        found = found & (state.ctx_trust[:, 0] >= state.ctx_trust[:, 1])
        tokens = mx.where(found[:, None], runs, tokens)
        point = found[:, None] if point is None else point | found[:, None]
    if forced is not None:
        f = forced >= 0
        tokens = mx.where(f, forced, tokens)
        if q is not None:
            q = mx.where(f[..., None], (mx.arange(q.shape[-1]) == forced[..., None]).astype(q.dtype),
                         q)
        point = None if point is None else point & ~f
    if q is not None and point is not None:
        point = mx.broadcast_to(point, tokens.shape)
    if drafter is not None:  # replaces the proposals; the head's chain still ran
        tokens, q = drafter.propose(aux["drafter"], state, k, tokens, q)
        point = None
    return Drafts(tokens, q, point if q is not None else None, found, max(head - 1, 0))


def commit_gdn(trunk: list, captures: List[Capture], consumed: mx.array, conv_kernel: int):
    """Every GDN layer takes the state and conv window after `consumed` [B]
    verify tokens (chosen on the device): its captured state by index, or
    its tape's replay of each row's accepted prefix (metal.gdn_replay)."""
    gdn = [c for c in trunk if isinstance(c, CaptureCache)]
    inputs = [c.conv_input for c in captures]
    n = consumed.astype(mx.int32)
    if any(c.tape is not None for c in captures):
        rows = (n[:, None] + mx.arange(conv_kernel - 1))[:, :, None]
        picked = [(mx.take_along_axis(c.conv_input, rows, axis=1),
                   metal.gdn_replay(c.tape, n) if c.tape is not None else
                   mx.take_along_axis(c.states, (n - 1)[:, None, None, None, None], axis=1)[:, 0])
                  for c in captures]
    elif consumed.shape[0] == 1:
        picked = metal.commit([c.states for c in captures], inputs, consumed[0], conv_kernel)
    else:  # one index per row
        rows = (n[:, None] + mx.arange(conv_kernel - 1))[:, :, None]
        picked = [(mx.take_along_axis(c.conv_input, rows, axis=1),
                   mx.take_along_axis(c.states, (n - 1)[:, None, None, None, None], axis=1)[:, 0])
                  for c in captures]
    for c, capture, (window, st) in zip(gdn, captures, picked):
        c.commit(window, st, consumed, capture)


TRUST_DECAY = 0.8  # a row's first-draft averages' weight on the past
TRUST_REGROWTH = 0.02  # a row's run not drafted regains this much trust a cycle (tried again)


def trusted(trust: mx.array, used: Optional[mx.array], accepted: mx.array) -> mx.array:
    """Each row's (context, head) first-draft averages after a cycle: the
    source it drafted from learns whether its first draft was kept; a run
    not drafted regains TRUST_REGROWTH (so a row tries its runs again)."""
    hit = (accepted > 0).astype(mx.float32)
    used = mx.zeros(hit.shape, mx.bool_) if used is None else used
    ctx, head = trust[:, 0], trust[:, 1]
    ctx = mx.where(used, TRUST_DECAY * ctx + (1 - TRUST_DECAY) * hit,
                   mx.minimum(ctx + TRUST_REGROWTH, 1.0))
    head = mx.where(used, head, TRUST_DECAY * head + (1 - TRUST_DECAY) * hit)
    return mx.stack([ctx, head], axis=1)


def _pack(accepted: mx.array, raw: mx.array, safe: mx.array, logprobs: mx.array,
          bad_drafts: mx.array, context: Optional[mx.array] = None) -> mx.array:
    """One int32 row per batch row, read with one host transfer (`unpack`)."""
    chosen = mx.take_along_axis(logprobs, safe[..., None], axis=-1)[..., 0]
    context = mx.zeros_like(bad_drafts) if context is None else context
    return mx.concatenate([accepted[:, None].astype(mx.int32), raw.astype(mx.int32),
                           chosen.astype(mx.float32).view(mx.int32),
                           bad_drafts[:, None].astype(mx.int32),
                           context[:, None].astype(mx.int32)], axis=1)


# -- the steps ----------------------------------------------------------------------------
@dataclass
class Proposals:
    """What drafting leaves for the verify: k drafts per row (in the
    vocabulary; `bad_drafts` counts those that were not), the distributions
    they were drawn from (sampled rows; None: point drafts), the keys the verify's acceptance and
    the next cycle use, and how many entries the head's chain added."""

    drafts: mx.array  # [B, k] int32
    q: Optional[mx.array]  # [B, k, V]
    bad_drafts: mx.array  # [B]
    keys: Optional[mx.array]  # [B, k+1, 2]: the drafts' keys, then the acceptance's
    chained: int  # a static count: part of a graph's key
    point: Optional[mx.array] = None  # [B, k] bool: point drafts among drawn ones
    context: Optional[mx.array] = None  # [B] bool: the row drafted its context run

    def tree(self) -> dict:
        return {"drafts": self.drafts, "q": self.q, "bad_drafts": self.bad_drafts,
                "keys": self.keys, "point": self.point, "context": self.context}

    @classmethod
    def from_tree(cls, tree: dict, chained: int) -> "Proposals":
        return cls(chained=chained, **tree)


@dataclass
class Verified:
    """The trunk's forward over [y, d1..dk]: its hiddens, its raw logits (no
    bias, penalty or mask yet) and each GDN layer's capture."""

    tokens: mx.array  # [B, k+1]
    h: mx.array  # [B, k+1, H]
    logits: mx.array  # [B, k+1, V]
    captures: List[Capture]

    def tree(self) -> dict:
        return {"tokens": self.tokens, "h": self.h, "logits": self.logits,
                "captures": [c.tree() for c in self.captures]}

    @classmethod
    def from_tree(cls, tree: dict) -> "Verified":
        return cls(tree["tokens"], tree["h"], tree["logits"],
                   [Capture.from_tree(c) for c in tree["captures"]])


def propose(spec: Spec, aux: dict, state: DecodeState, k: int, catch_up: bool = False,
            history: Optional[list] = None, guidance: Optional[Guidance] = None,
            head: Optional[int] = None, context: bool = False) -> Tuple[DecodeState, Proposals]:
    """(Catch the head up,) draft k tokens, the head's chain `head` of them
    (`draft`). The state returned holds the head's cache after its chain and
    the next cycle's key."""
    model = spec.model
    cache = state.cache.copy()
    key, keys = state.key, None
    if spec.speculative:  # per row: k draft keys and one for the acceptance
        split = split_rows(state.key, k + 2)
        key, keys = split[:, 0], split[:, 1:]
    # the head takes the pairs it missed while the batch decoded plainly
    g = catch_up_ring(model, state, cache.head) if catch_up else state.g
    d = draft(spec, aux, state, g, cache.head, k, keys, history, guidance, head, context)
    drafts, bad_drafts = in_vocab(spec.verified_drafts(d.tokens), model.vocab_size)
    new = state.replace(cache=cache, key=key)
    if catch_up:
        new = new.replace(ring_n=mx.zeros_like(state.ring_n))
    return new, Proposals(drafts, d.q, bad_drafts, keys, d.chained, d.point, d.context)


def verify(spec: Spec, state: DecodeState, proposals: Proposals) -> Tuple[DecodeState, Verified]:
    """The trunk over [y, d1..dk] in one forward, every GDN layer keeping what
    its rollback needs (a `Capture`: a tape, `cache.rollback_by_tape`)."""
    model = spec.model
    cache = state.cache.copy()
    tokens = mx.concatenate([state.y[:, None], proposals.drafts], axis=1)  # [B, k+1]
    CaptureCache.start(cache.trunk)
    h = model.trunk_hidden(tokens, shifted(cache.trunk, state.rope_delta))  # [B, k+1, H]
    captures = CaptureCache.take_all(cache.trunk)
    return state.replace(cache=cache), Verified(tokens, h, model.logits_from_hidden(h), captures)


def settle(spec: Spec, state: DecodeState, proposals: Proposals, verified: Verified,
           history: Optional[list] = None,
           words: Optional[mx.array] = None) -> Tuple[DecodeState, StepOutput]:
    """Accept drafts against the verify's distributions (masked by `words`
    [B, k+1, W], the rows' grammars after each draft prefix), then commit:
    the trunk keeps [y, d1..da]; the head drops its drafting entries and is
    rewritten from the trunk's verified hiddens paired with the emitted
    tokens, which yields the next cycle's hidden. Emits a+1 tokens."""
    model, k = spec.model, proposals.drafts.shape[1]
    cache = state.cache.copy()
    tokens, keys = verified.tokens, proposals.keys
    drafts = spec.verified_drafts(proposals.drafts, verified.h)
    logprobs = _logprobs(spec, verified.logits, state, history, tokens, words=words)

    # accept: `accepted` drafts, then out[accepted] after them (acceptance.py)
    accepted, out = accept(logprobs, DraftRun(drafts, proposals.q, proposals.point),
                           state.sampling, spec.filters, None if keys is None else keys[:, k],
                           spec.sampler)
    packed = spec.shared(mx.concatenate([accepted[:, None], out], axis=1))
    accepted, raw = packed[:, 0].astype(mx.int32), packed[:, 1:].astype(mx.int32)
    out, _ = in_vocab(raw, model.vocab_size)  # the host reads the raw ones

    # commit
    commit_gdn(cache.trunk, verified.captures, accepted + 1,
               model.text_args.linear_conv_kernel_dim)
    for c in cache.trunk:
        if not isinstance(c, CaptureCache):  # attention: KV (and a family's other KV) by length
            c.trim(k - accepted)
    for c in cache.head:
        c.trim(proposals.chained)
    G = head_forward(model, verified.h, out, shifted(cache.head, state.rope_delta))  # [B, k+1, H]
    for c in cache.head:
        c.trim(k - accepted)
    new = state.replace(cache=cache, y=mx.take_along_axis(out, accepted[:, None], axis=1)[:, 0],
                        emitted=state.emitted + accepted + 1,
                        g=mx.take_along_axis(G, accepted[:, None, None], axis=1))
    if state.window is not None:
        new = new.replace(window=advance_window(state.window, tokens, accepted + 1))
    new = new.with_context(out, accepted + 1, spec.context)
    if state.ctx_trust is not None:
        new = new.replace(ctx_trust=trusted(state.ctx_trust, proposals.context, accepted))
    return new, StepOutput(_pack(accepted, raw, out, logprobs, proposals.bad_drafts,
                                 proposals.context), logprobs)


def drafted_cycle(spec: Spec, aux: dict, state: DecodeState, k: int, catch_up: bool = False,
                  history: Optional[list] = None, head: Optional[int] = None,
                  context: bool = False) -> Tuple[DecodeState, StepOutput]:
    """(Catch up,) draft k tokens (the head's chain `head` of them), verify
    them in one trunk forward, accept, commit: the three stages in one graph."""
    state, proposals = propose(spec, aux, state, k, catch_up, history, None, head, context)
    state, verified = verify(spec, state, proposals)
    return settle(spec, state, proposals, verified, history)


@dataclass
class Forwarded:
    """A plain step's trunk forward over `y`: its hidden [B, 1, H] and raw
    logits [B, 1, V]; the seam between `plain_forward` and `plain_sample`
    (a constrained batch queues the forward before the host has the mask)."""

    h: mx.array
    logits: mx.array

    def tree(self) -> dict:
        return {"h": self.h, "logits": self.logits}

    @classmethod
    def from_tree(cls, tree: dict) -> "Forwarded":
        return cls(tree["h"], tree["logits"])


def plain_forward(spec: Spec, state: DecodeState) -> Tuple[DecodeState, Forwarded]:
    """The trunk takes `y` (its caches advance one token)."""
    model = spec.model
    cache = state.cache.copy()
    h = model.trunk_hidden(state.y[:, None], shifted(cache.trunk, state.rope_delta))  # [B, 1, H]
    return state.replace(cache=cache), Forwarded(h, model.logits_from_hidden(h))


def plain_sample(spec: Spec, state: DecodeState, fwd: Forwarded, history: Optional[list] = None,
                 guidance: Optional[Guidance] = None) -> Tuple[DecodeState, StepOutput]:
    """The token after the forward: processed, masked, sampled; the pair
    (hidden, token) goes into the head's ring."""
    model = spec.model
    logprobs = _logprobs(spec, fwd.logits, state, history, state.y[:, None],
                         words=None if guidance is None else guidance.first[:, None])
    key = state.key
    if spec.sampler is not None:
        y = sample_opaque(spec.sampler, logprobs)[:, 0]
    else:
        keys = None
        if spec.speculative:
            split = split_rows(key, 2)
            key, keys = split[:, 0], split[:, 1]
        y = sample_rows(logprobs[:, 0], state.sampling, spec.filters, keys)
    raw = spec.shared(y)
    y, _ = in_vocab(raw, model.vocab_size)  # the host reads the raw ones
    packed = _pack(mx.zeros_like(y), raw[:, None], y[:, None], logprobs, mx.zeros_like(y))
    new = state.replace(y=y, emitted=state.emitted + 1, key=key)
    if state.window is not None:
        new = new.replace(window=advance_window(state.window, state.y[:, None],
                                                mx.ones_like(state.y)))
    new = new.with_context(y[:, None], mx.ones_like(y), spec.context)
    if new.ctx_tokens is not None and spec.context is not None:  # a run is there now: the
        # schedule may draft it though the head is parked (ContextPolicy.observe_plain)
        _, found = propose_runs(new.ctx_tokens, new.ctx_len, new.ctx_table, 1, spec.context)
        packed = packed.at[:, -1].add(found.astype(mx.int32))
    if spec.use_head:  # the pair waits in the ring (the oldest is overwritten)
        at = (state.ring_n % RING).reshape(1)
        new = new.replace(
            ring_h=mx.slice_update(state.ring_h, fwd.h.astype(state.ring_h.dtype), at, axes=(1,)),
            ring_tok=mx.slice_update(state.ring_tok, y[:, None], at, axes=(1,)),
            ring_n=state.ring_n + 1)
    return new, StepOutput(packed, logprobs)


def plain_step(spec: Spec, aux: dict, state: DecodeState, history: Optional[list] = None,
               guidance: Optional[Guidance] = None) -> Tuple[DecodeState, StepOutput]:
    """One token without drafting; the head does not run (it catches up on
    the last pair before it drafts again)."""
    state, fwd = plain_forward(spec, state)
    return plain_sample(spec, state, fwd, history, guidance)


def ring_order(ring_n):
    """The ring's slots holding its last min(ring_n, RING) pairs, oldest first
    (ring_n: a count on the host, or the state's device count: then all RING
    slots, the written ones first, and their number)."""
    if isinstance(ring_n, int):
        m = min(ring_n, RING)
        return [(ring_n - m + j) % RING for j in range(m)]
    m = mx.minimum(ring_n, RING)
    return (ring_n - m + mx.arange(RING)) % RING, m


def catch_up_ring(model, state: DecodeState, head_cache: list) -> mx.array:
    """The head takes the ring's pairs in one forward over all RING slots (the
    causal mask keeps the unwritten ones, last, from the written ones, and
    they are trimmed after); returns its hidden of the last pair."""
    order, m = ring_order(state.ring_n)
    G = head_forward(model, state.ring_h[:, order], state.ring_tok[:, order],
                     shifted(head_cache, state.rope_delta))
    for c in head_cache:
        c.trim(RING - m)
    return mx.take(G, (m - 1).reshape(1), axis=1)


def flush_ring(spec: Spec, aux: dict, state: DecodeState) -> DecodeState:
    """Catch the head up without drafting (before rows join: every row's ring
    must be empty)."""
    cache = state.cache.copy()
    g = catch_up_ring(spec.model, state, cache.head)
    return state.replace(cache=cache, g=g, ring_n=mx.zeros_like(state.ring_n))


def init_ring(state: DecodeState) -> DecodeState:
    B, _, H = state.g.shape
    return state.replace(ring_h=mx.zeros((B, RING, H), state.g.dtype),
                         ring_tok=mx.zeros((B, RING), mx.int32),
                         ring_n=mx.array(0, dtype=mx.int32))


# -- compiled graphs ------------------------------------------------------------------------
class Static(NamedTuple):
    """What a compiled graph knows besides its inputs (part of its key)."""

    spec: Spec  # without the arrays of one call (Spec.static)
    k: int
    catch_up: bool
    chained: int  # entries the head's chain adds (Proposals.chained)
    forced_all: bool  # the grammars force every draft (no read between the halves)
    head: int  # the head's chain: its first drafts (a context run's width past it)
    context: bool  # rows draft their context runs (spec.context on)


def _chained(spec: Spec, head: int, forced_all: bool) -> int:
    replaced = spec.drafter is not None and spec.drafter.replaces_head
    return 0 if forced_all or replaced else max(head - 1, 0)


def _emitted(state: DecodeState, out: StepOutput) -> tuple:
    return state.tree(), out.packed, out.logprobs


def _stage_forward(g: Static, state: DecodeState, aux: dict):
    state, fwd = plain_forward(g.spec, state)
    return state.tree(), fwd.tree()


def _stage_propose(g: Static, state: DecodeState, aux: dict, guidance):
    state, proposals = propose(g.spec, aux, state, g.k, g.catch_up, None,
                               Guidance.from_tree(guidance, g.forced_all), g.head, g.context)
    state, verified = verify(g.spec, state, proposals)
    return state.tree(), proposals.tree(), verified.tree()


# The graphs a batch runs, by name: each a function of (what the graph knows,
# the state, the spec's arrays, the call's other inputs as trees).
STAGES: Dict[str, Callable] = {
    # a drafted cycle, and a plain step (depth 0)
    "cycle": lambda g, state, aux: _emitted(*drafted_cycle(g.spec, aux, state, g.k, g.catch_up,
                                                           None, g.head, g.context)),
    "plain": lambda g, state, aux: _emitted(*plain_step(g.spec, aux, state)),
    # the head catches up without drafting (before rows join)
    "flush": lambda g, state, aux: flush_ring(g.spec, aux, state).tree(),
    # a plain step under the grammars' masks
    "guided-plain": lambda g, state, aux, guidance: _emitted(*plain_step(
        g.spec, aux, state, None, Guidance.from_tree(guidance, g.forced_all))),
    # a guided drafted cycle's halves (the host reads the drafts between them)
    "propose": _stage_propose,
    "settle": lambda g, state, aux, proposals, verified, words: _emitted(*settle(
        g.spec, state, Proposals.from_tree(proposals, g.chained),
        Verified.from_tree(verified), None, words)),
    # a guided plain step queued ahead, its halves (the host reads the cycle before)
    "forward": _stage_forward,
    "sample": lambda g, state, aux, fwd, guidance: _emitted(*plain_sample(
        g.spec, state, Forwarded.from_tree(fwd), None, Guidance.from_tree(guidance, False))),
}


class Graphs:
    """Runs steps through graphs compiled once per (step, depth, spec key) and
    kept on the model (`model.runtime`), so later generations do not retrace;
    MLX keeps one trace per input shape (a capacity block). Eager when the
    spec cannot be compiled."""

    def __init__(self, spec: Spec, compiled: bool = True):
        self.compiled, self.runtime = compiled, spec.model.runtime
        self.use(spec)

    def use(self, spec: Spec):
        """The batch's spec changed (rows with other needs joined or left)."""
        self.spec, self.aux = spec, spec.aux()
        # the spec's graphs by (k, catch_up, layout): the key (kernel backend and
        # environment included) is built once per spec, not every cycle
        self._fns: Dict[tuple, Callable] = {}

    @property
    def traces(self) -> int:
        """Slow launches so far: traces, and eager runs of a graph not compiled yet."""
        return sum(self.runtime.traces.values()) + self.runtime.eager_runs

    def _fn(self, name: str, k: int, catch_up: bool, layout: tuple, forced_all: bool = False,
            head: Optional[int] = None, context: bool = False):
        key = (name, k, catch_up, layout, forced_all, k if head is None else head, context)
        fn = self._fns.get(key)
        if fn is None:
            fn, compiled = self._build(*key)
            if compiled:
                self._fns[key] = fn
        return fn

    def _build(self, name: str, k: int, catch_up: bool, layout: tuple, forced_all: bool,
               head: int, context: bool):
        """One of the graphs: a stage of `STAGES` compiled for this depth (the
        head's chain `head` of it), catch-up, cache layout, context runs and spec."""
        key = (name, k, catch_up, layout, forced_all) + self.spec.graph_key() + (
            (head, context) if head != k or context else ())
        # the graph keeps only what its key describes (no arrays of this call)
        static = Static(self.spec.static(), k, catch_up, _chained(self.spec, head, forced_all),
                        forced_all, head, context)
        stage, runtime = STAGES[name], self.runtime

        def apply(tree, aux, *rest):
            return stage(static, DecodeState.from_tree(tree, layout), aux, *rest)

        def run(tree, aux, *rest):
            runtime.traces[key] = runtime.traces.get(key, 0) + 1
            return apply(tree, aux, *rest)

        if key not in runtime.graphs and runtime.runs_eagerly():
            return apply, False  # (params.CPU_EAGER_RUNS)
        # the weights are inputs, read at every call: a graph never runs with
        # weights the model no longer has (and keeps none alive)
        return runtime.graph(key, lambda: mx.compile(run, inputs=static.spec.model.state)), True

    def step(self, state: DecodeState, k: int, catch_up: bool = False, history=None,
             guidance: Optional[Guidance] = None, head: Optional[int] = None,
             context: bool = False) -> Tuple[DecodeState, StepOutput]:
        """A drafted cycle of depth k (catching the head up first; the head's
        chain `head` of it, default k), or a plain step (k == 0; under the
        grammars' masks with `guidance`). A guided drafted cycle is two calls
        with a read of the drafts between them: `propose`, then `settle`."""
        if guidance is not None and k:
            raise ValueError("a guided drafted cycle runs as propose and settle")
        if not (self.compiled and self.spec.compilable):
            if k == 0:
                return plain_step(self.spec, self.aux, state, history, guidance)
            return drafted_cycle(self.spec, self.aux, state, k, catch_up, history, head, context)
        layout = state.cache.layout
        if guidance is not None:  # (k == 0)
            tree, packed, logprobs = self._fn("guided-plain", 0, False, layout)(
                state.tree(), self.aux, guidance.tree())
        else:
            tree, packed, logprobs = self._fn("cycle" if k else "plain", k, catch_up, layout,
                                              head=head, context=context and k > 0)(
                state.tree(), self.aux)
        return DecodeState.from_tree(tree, layout), StepOutput(packed, logprobs)

    def propose(self, state: DecodeState, k: int, catch_up: bool, history,
                guidance: Guidance, head: Optional[int] = None, context: bool = False
                ) -> Tuple[DecodeState, Proposals, Verified]:
        """A guided drafted cycle's first half: (catch the head up,) draft k
        tokens and verify them. The batch then reads the drafts for the
        grammars' masks after each draft prefix (none to read when the
        grammars forced every draft) and calls `settle`."""
        head = k if head is None else head
        if not (self.compiled and self.spec.compilable):
            state, proposals = propose(self.spec, self.aux, state, k, catch_up, history, guidance,
                                       head, context)
            state, verified = verify(self.spec, state, proposals)
            return state, proposals, verified
        layout, forced_all = state.cache.layout, guidance.forced_all
        tree, ptree, vtree = self._fn("propose", k, catch_up, layout, forced_all, head, context)(
            state.tree(), self.aux, guidance.tree())
        return (DecodeState.from_tree(tree, layout),
                Proposals.from_tree(ptree, _chained(self.spec, head, forced_all)),
                Verified.from_tree(vtree))

    def settle(self, state: DecodeState, proposals: Proposals, verified: Verified, words,
               catch_up: bool, history, guidance: Guidance
               ) -> Tuple[DecodeState, StepOutput]:
        """Its second half: acceptance under the grammars' masks `words`
        ([B, k+1, W]), the commit, the head's next hidden."""
        if not (self.compiled and self.spec.compilable):
            return settle(self.spec, state, proposals, verified, history, words)
        layout, k = state.cache.layout, proposals.drafts.shape[1]
        tree, packed, logprobs = self._fn("settle", k, catch_up, layout, guidance.forced_all,
                                          proposals.chained + 1)(
            state.tree(), self.aux, proposals.tree(), verified.tree(), words)
        return DecodeState.from_tree(tree, layout), StepOutput(packed, logprobs)

    def forward(self, state: DecodeState) -> Tuple[DecodeState, Forwarded]:
        """A plain step's first half: the trunk's forward (no mask needed yet)."""
        if not (self.compiled and self.spec.compilable):
            return plain_forward(self.spec, state)
        layout = state.cache.layout
        tree, fwd = self._fn("forward", 0, False, layout)(state.tree(), self.aux)
        return DecodeState.from_tree(tree, layout), Forwarded.from_tree(fwd)

    def sample(self, state: DecodeState, fwd: Forwarded, guidance: Guidance
               ) -> Tuple[DecodeState, StepOutput]:
        """Its second half: the grammars' masks applied, the token sampled.
        The caches are no inputs (the forward left them as they stay), so
        few arrays cross the graph's boundary."""
        light = state.without_caches()
        if not (self.compiled and self.spec.compilable):
            new, out = plain_sample(self.spec, light, fwd, None, guidance)
        else:
            layout = light.cache.layout
            tree, packed, logprobs = self._fn("sample", 0, False, layout)(
                light.tree(), self.aux, fwd.tree(), guidance.tree())
            new, out = DecodeState.from_tree(tree, layout), StepOutput(packed, logprobs)
        return new.replace(cache=state.cache), out

    def flush(self, state: DecodeState) -> DecodeState:
        if not (self.compiled and self.spec.compilable):
            return flush_ring(self.spec, self.aux, state)
        layout = state.cache.layout
        return DecodeState.from_tree(self._fn("flush", 0, True, layout)(state.tree(), self.aux),
                                     layout)
