"""One decode cycle: pure functions over an explicit state.

`DecodeState` holds every device array a cycle reads or writes (the caches,
the last token, the head's hidden, the random key, ...). Each step is a
function state -> (state, output) with nothing kept elsewhere:

  drafted_cycle(k)  1. draft: the head drafts d1..dk by chaining itself (its
                       post-norm hidden + the token it drafted);
                    2. verify: the trunk runs [y, d1..dk] in ONE forward, its
                       GDN layers capturing the state after every position;
                    3. accept, in-graph: greedy / any sampler by match (keep
                       drafts while they equal the sampler's choice), an
                       MTPSampler with temp > 0 by Leviathan–Chen;
                    4. commit: GDN states by index, attention lengths cut to
                       the accepted prefix, the head's cache rewritten from the
                       trunk's verified hiddens (which gives the next draft's hidden).
                    Emits a+1 tokens: the a accepted drafts, then the trunk's.
  plain_step        one token, no drafting (depth 0); with adaptive depth the
                    (hidden, token) pair is kept in a small ring the head
                    catches up on (`flush_ring`) before it drafts again.
  prefill / feed    the prompt, and the tokens a finished generation leaves
                    in the cache, on mlx_lm's own caches exactly as mlx_lm
                    feeds them.

Invariant at the start of a cycle (P = tokens in the trunk's cache): `y` is
the last emitted token, not yet fed; the head's cache holds the pairs
(h_p, tok_{p+1}) for p < P, the last one (h_{P-1}, y), unless pairs wait in
the ring; `g` is the head's hidden of that last pair (it drafts d1).

`Graphs.step` runs a step through a graph compiled once per depth and mode
with the state as its input (`DecodeState.tree()` lists every field, so a
new field is an input and output of the graph by construction) and keeps the
graphs on the model across generations. See docs/design.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from . import metal as kernels
from .cache import (CaptureCache, MTPCache, PaddedKVCache, head_caches, last_hidden,
                    set_last_hidden)
from .distributed import share
from .sampling import MTPSampler, is_greedy, speculative_sample

RING = 8  # plain steps the head can fall behind before it catches up


@dataclass
class DecodeState:
    """Everything a cycle reads and writes, as device arrays."""

    cache: MTPCache
    y: mx.array  # [B] int32: last emitted token, not yet fed to the trunk
    emitted: mx.array  # [B] int32: tokens emitted so far (drafters index by it)
    g: Optional[mx.array] = None  # [B, 1, H]: head hidden that drafts the next d1
    key: Optional[mx.array] = None  # [B, 2]: each row's random key (sampling)
    ring_h: Optional[mx.array] = None  # [B, RING, H]: plain steps' hiddens ...
    ring_tok: Optional[mx.array] = None  # [B, RING]: ... paired with their tokens
    ring_n: Optional[mx.array] = None  # []: pairs waiting in the ring

    def tree(self) -> dict:
        """Every field (caches as their `state`): a compiled step's inputs."""
        return {f.name: self.cache.state if f.name == "cache" else getattr(self, f.name)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_tree(cls, tree: dict, layout: tuple) -> "DecodeState":
        """The state of cache `layout` holding `tree`'s arrays."""
        return cls(**{**tree, "cache": MTPCache.from_state(tree["cache"], layout)})

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)

    def without_buffers(self) -> "DecodeState":
        return self.replace(cache=self.cache.without_buffers())

    def take_rows(self, rows) -> "DecodeState":
        """These batch rows only (the ring's count is shared by all rows)."""
        rows = mx.array(rows, dtype=mx.int32)
        pick = lambda x: None if x is None else x[rows]
        return DecodeState(self.cache.take_rows(rows), pick(self.y), pick(self.emitted),
                           pick(self.g), pick(self.key), pick(self.ring_h), pick(self.ring_tok),
                           self.ring_n)

    @staticmethod
    def concat(a: "DecodeState", b: "DecodeState") -> "DecodeState":
        """a's rows, then b's; both with empty rings (flushed before)."""
        cat = lambda x, y: None if x is None else mx.concatenate([x, y])
        return DecodeState(MTPCache.concat(a.cache, b.cache), cat(a.y, b.y),
                           cat(a.emitted, b.emitted), cat(a.g, b.g), cat(a.key, b.key),
                           cat(a.ring_h, b.ring_h), cat(a.ring_tok, b.ring_tok), a.ring_n)


@dataclass
class StepOutput:
    packed: mx.array  # [B, 1 + k + 1] int32: accepted count, then candidate tokens
    logprobs: mx.array  # [B, k + 1, V]: the (processed) log-probs of every candidate


@dataclass
class Spec:
    """What stays fixed through a generation: the model and how to draft,
    sample and accept. Graphs are compiled per `graph_key()`."""

    model: Any
    sampler: Callable = greedy_sampler
    use_head: bool = True
    ring: bool = False  # adaptive depth: plain steps keep pairs for the head
    processors: tuple = ()
    draft_vocab: Optional[mx.array] = None  # greedy/sampled drafts over these ids only
    drafter: Any = None  # tests and benchmarks (drafters.py)
    draft_rows: Optional[dict] = field(default=None, repr=False)
    group: Any = None  # sharded model: the ranks that take rank 0's decisions
    first_stage: Optional[int] = None  # pipeline: the rank that embeds the tokens

    def shared(self, x: mx.array) -> mx.array:
        """Rank 0's decision on every rank (sharded models; see distributed.py)."""
        return share(x, self.group)

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
        self.sampler = self.sampler or greedy_sampler
        self.speculative = isinstance(self.sampler, MTPSampler) and self.sampler.speculative
        if self.draft_vocab is not None and self.draft_rows is None and self.speculative:
            self.draft_rows = _gather_rows(self.model, self.draft_vocab)  # sampled drafts project them

    @property
    def trusted_sampler(self) -> bool:
        """Its tokens are in the vocabulary by construction (greedy, MTPSampler)."""
        return is_greedy(self.sampler) or isinstance(self.sampler, MTPSampler)

    def safe_ids(self, ids: mx.array) -> mx.array:
        """Ids fit to gather with: another sampler's ids are clamped into the
        vocabulary (the host checks the raw ones and stops before using any)."""
        return ids if self.trusted_sampler else mx.clip(ids, 0, self.model.vocab_size - 1)

    @property
    def host_history(self) -> bool:
        """Its steps need the row's tokens on the host (processors, host-side
        drafters): one row at a time, each cycle read before the next."""
        return bool(self.processors) or (self.drafter is not None and self.drafter.host_side)

    @property
    def compilable(self) -> bool:
        """Processors need the host's token history, opaque samplers mx.random's
        global state, host drafters the host: those steps run eagerly."""
        return (not self.processors
                and (is_greedy(self.sampler) or self.speculative)
                and (self.drafter is None or not self.drafter.host_side)
                and not kernels.backend().startswith("emu"))

    def graph_key(self) -> tuple:
        s = self.sampler
        sampler = ("mtp", s.temp, s.top_p, s.min_p, s.min_tokens_to_keep, s.top_k,
                   s.draft_temp) if isinstance(s, MTPSampler) and not s.greedy else "greedy"
        vocab = None if self.draft_vocab is None else self.draft_vocab.size
        drafter = None if self.drafter is None else self.drafter.graph_key()
        return (sampler, self.use_head, self.ring, vocab, drafter, kernels.backend(),
                kernels.fused_default())

    def static(self) -> "Spec":
        """This spec without the arrays of one call (a graph gets those in `aux`)."""
        return dataclasses.replace(self, draft_vocab=None, draft_rows=None)

    def aux(self) -> dict:
        """Arrays a graph reads besides the state (passed, not baked in)."""
        return {"rows": self.draft_rows, "vocab": self.draft_vocab,
                "drafter": self.drafter.arrays() if self.drafter is not None else None}


def _gather_rows(model, ids: mx.array) -> dict:
    """The lm_head rows of a draft vocabulary, gathered once per generation."""
    w = dict(model.lm_head_weights())
    rows = {"weight": w["weight"][ids]}
    if w.get("scales") is not None:
        rows.update(scales=w["scales"][ids], biases=w["biases"][ids])
    mx.eval(rows)
    return rows


# -- shared pieces ---------------------------------------------------------------------
def _logprobs(logits: mx.array, processors, history: Optional[mx.array],
              tokens: mx.array) -> mx.array:
    """Log-probs [B, T, V] of logits [B, T, V], processed as plain decoding
    would at each position: row i sees history + tokens[: i+1] (B = 1)."""
    if processors:
        rows = []
        for i in range(logits.shape[1]):
            seen = tokens[0, : i + 1]
            seen = seen if history is None else mx.concatenate([history, seen])
            row = logits[:, i]
            for proc in processors:
                row = proc(seen, row)
            rows.append(row)
        logits = mx.stack(rows, axis=1)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _sample_rows(sampler, logprobs: mx.array) -> mx.array:
    """The sampler's token for every row of [B, T, V]. A random sampler is
    called once per row, as plain decoding calls it once per token (XTC, for
    one, draws one coin per call for all its rows)."""
    B, T, V = logprobs.shape
    if is_greedy(sampler):
        return sampler(logprobs.reshape(B * T, V)).astype(mx.int32).reshape(B, T)
    rows = []
    for t in range(T):
        out = sampler(logprobs[:, t])
        if not isinstance(out, mx.array) or out.size != B:
            shape = getattr(out, "shape", type(out).__name__)
            raise TypeError(f"the sampler returned {shape} for log-probabilities of shape "
                            f"{tuple(logprobs[:, t].shape)}: it must return one token id per row")
        rows.append(out.astype(mx.int32).reshape(B))
    return mx.stack(rows, axis=1)


def _head(model, hidden: mx.array, tokens: mx.array, cache: list) -> mx.array:
    """The head over hiddens [B, T, H] paired with tokens [B, T]."""
    return model.mtp(hidden, model.embed(tokens), cache)


def _draft_logprobs(spec: Spec, aux: dict, g: mx.array, history, drafts: list) -> mx.array:
    """The head's processed log-probs [B, V] at hidden g [B, 1, H]. With a
    trimmed draft vocabulary only its rows are projected (the rest get -inf:
    q = 0 there, still exact since Leviathan–Chen's residual covers them)."""
    model = spec.model
    if aux["rows"] is None:
        logits = model.logits_from_hidden(g)[:, -1]
    else:
        r, h = aux["rows"], g[:, -1]
        if "scales" in r:
            w = model.lm_head_weights()
            sub = mx.quantized_matmul(h, r["weight"], r["scales"], r["biases"], transpose=True,
                                      group_size=w["group_size"], bits=w["bits"])
        else:
            sub = h @ r["weight"].T
        logits = mx.full((h.shape[0], model.vocab_size), -float("inf"), dtype=sub.dtype)
        logits[:, aux["vocab"]] = sub
    if spec.processors:
        seen = mx.concatenate([history] + drafts) if drafts else history
        for proc in spec.processors:
            logits = proc(seen, logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def draft(spec: Spec, aux: dict, state: DecodeState, head_cache: list, k: int,
          keys: Optional[mx.array], history) -> Tuple[mx.array, Optional[mx.array], int]:
    """Drafts [B, k], their distributions q [B, k, V] (sampling; None when
    greedy) and how many entries the chain added to the head's cache."""
    model, drafter = spec.model, spec.drafter
    if drafter is not None and drafter.replaces_head:
        drafts, q = drafter.propose(aux["drafter"], state, k, None, None)
        return drafts, q, 0
    g, drafts, qs = state.g, [], []
    for j in range(k):
        if j > 0:
            g = _head(model, g, drafts[-1][:, None], head_cache)
        if spec.speculative:  # each row with its own key
            lp = _draft_logprobs(spec, aux, g, history, drafts)
            rows = [spec.sampler.draft(lp[b:b + 1], keys[b][j]) for b in range(lp.shape[0])]
            d = mx.concatenate([r[0] for r in rows])
            qs.append(mx.concatenate([r[1] for r in rows]))
        else:
            d = model.draft_tokens_from_hidden(g[:, -1], aux["vocab"])
        drafts.append(d.astype(mx.int32))
    drafts = mx.stack(drafts, axis=1)
    q = mx.stack(qs, axis=1) if qs else None
    if drafter is not None:  # replaces the proposals; the head's chain still ran
        drafts, q = drafter.propose(aux["drafter"], state, k, drafts, q)
    return drafts, q, k - 1


def commit_gdn(trunk: list, consumed: mx.array, conv_kernel: int):
    """Every GDN layer takes the state and conv window after `consumed` [B]
    verify tokens (chosen by index on the device)."""
    gdn = [c for c in trunk if isinstance(c, CaptureCache)]
    states = [c.captured_states for c in gdn]
    inputs = [c.captured_conv_input for c in gdn]
    if consumed.shape[0] == 1:
        picked = kernels.commit(states, inputs, consumed[0], conv_kernel)
    else:  # one index per row
        n = consumed.astype(mx.int32)
        rows = (n[:, None] + mx.arange(conv_kernel - 1))[:, :, None]
        picked = [(mx.take_along_axis(ci, rows, axis=1),
                   mx.take_along_axis(st, (n - 1)[:, None, None, None, None], axis=1)[:, 0])
                  for st, ci in zip(states, inputs)]
    for c, (window, st) in zip(gdn, picked):
        c.cache = [window, st]
        c.capturing = False
        c.captured_states = c.captured_conv_input = None


# -- the steps ----------------------------------------------------------------------------
def drafted_cycle(spec: Spec, aux: dict, state: DecodeState, k: int,
                  history: Optional[mx.array] = None) -> Tuple[DecodeState, StepOutput]:
    """Draft k tokens, verify them in one trunk forward, accept, commit."""
    model = spec.model
    cache = state.cache.copy()
    key, keys = state.key, None
    if spec.speculative:  # per row: k draft keys and one for the acceptance
        splits = [mx.random.split(row_key, k + 2) for row_key in state.key]
        key, keys = mx.stack([s[0] for s in splits]), [s[1:] for s in splits]

    # 1. draft
    seen = None if history is None else mx.concatenate([history, state.y])
    drafts, q, chained = draft(spec, aux, state, cache.head, k, keys, seen)
    drafts = spec.verified_drafts(drafts)

    # 2. verify [y, d1..dk] in one trunk forward, capturing GDN states
    tokens = mx.concatenate([state.y[:, None], drafts], axis=1)  # [B, k+1]
    for c in cache.trunk:
        if isinstance(c, CaptureCache):
            c.capturing = True
    h = model.trunk_hidden(tokens, cache.trunk)  # [B, k+1, H]
    drafts = spec.verified_drafts(drafts, h)
    logprobs = _logprobs(model.logits_from_hidden(h), spec.processors, history, tokens)

    # 3. accept: `accepted` drafts, then out[accepted] after them
    if spec.speculative:  # Leviathan–Chen: residual or bonus sample, per row
        target = spec.sampler.target_logits(logprobs)
        rows = [speculative_sample(target[b:b + 1], q[b:b + 1], drafts[b:b + 1], keys[b][k])
                for b in range(target.shape[0])]
        accepted = mx.concatenate([r[0] for r in rows])
        out = mx.concatenate([r[1] for r in rows])
    else:  # match: keep drafts while they equal the sampler's choice
        out = _sample_rows(spec.sampler, logprobs)  # [B, k+1]
        accepted = mx.cumprod((drafts == out[:, :k]).astype(mx.int32), axis=1).sum(axis=1)
    packed = spec.shared(mx.concatenate([accepted[:, None], out], axis=1))
    accepted, out = packed[:, 0].astype(accepted.dtype), packed[:, 1:].astype(out.dtype)
    out = spec.safe_ids(out)

    # 4. commit: the trunk keeps [y, d1..da]; the head drops its drafting
    #    entries and is rewritten from the trunk's verified hiddens paired
    #    with the emitted tokens, which yields the next cycle's hidden
    commit_gdn(cache.trunk, accepted + 1, model.text_args.linear_conv_kernel_dim)
    for c in cache.trunk:
        if isinstance(c, PaddedKVCache):
            c.trim(k - accepted)
    for c in cache.head:
        c.trim(chained)
    G = _head(model, h, out, cache.head)  # [B, k+1, H]
    for c in cache.head:
        c.trim(k - accepted)
    g = mx.take_along_axis(G, accepted[:, None, None], axis=1)
    y = mx.take_along_axis(out, accepted[:, None], axis=1)[:, 0]
    new = state.replace(cache=cache, y=y, emitted=state.emitted + accepted + 1, g=g, key=key)
    return new, StepOutput(packed, logprobs)


def plain_step(spec: Spec, aux: dict, state: DecodeState,
               history: Optional[mx.array] = None) -> Tuple[DecodeState, StepOutput]:
    """One token without drafting. With the ring, the pair (hidden, token)
    waits there for the head."""
    model = spec.model
    cache = state.cache.copy()
    h = model.trunk_hidden(state.y[:, None], cache.trunk)  # [B, 1, H]
    logprobs = _logprobs(model.logits_from_hidden(h), spec.processors, history,
                         state.y[:, None])
    key = state.key
    if spec.speculative:  # per row, its own key
        splits = [mx.random.split(row_key) for row_key in key]
        key = mx.stack([s[0] for s in splits])
        y = mx.concatenate([spec.sampler.sample(logprobs[b:b + 1, 0], s[1])
                            for b, s in enumerate(splits)])
    else:
        y = _sample_rows(spec.sampler, logprobs)[:, 0]
    y = spec.shared(y)
    packed = mx.concatenate([mx.zeros_like(y)[:, None], y[:, None]], axis=1)
    y = spec.safe_ids(y)
    new = state.replace(cache=cache, y=y, emitted=state.emitted + 1, key=key)
    if spec.ring:
        at = state.ring_n.reshape(1)
        new = new.replace(
            ring_h=mx.slice_update(state.ring_h, h.astype(state.ring_h.dtype), at, axes=(1,)),
            ring_tok=mx.slice_update(state.ring_tok, y[:, None], at, axes=(1,)),
            ring_n=state.ring_n + 1)
    return new, StepOutput(packed, logprobs)


def flush_ring(spec: Spec, aux: dict, state: DecodeState) -> DecodeState:
    """The head catches up on the ring's pairs (one forward over all RING
    slots; the causal mask keeps the unused ones from the used ones)."""
    cache = state.cache.copy()
    G = _head(spec.model, state.ring_h, state.ring_tok, cache.head)
    for c in cache.head:
        c.trim(RING - state.ring_n)
    g = mx.take(G, (state.ring_n - 1).reshape(1), axis=1)
    return state.replace(cache=cache, g=g, ring_n=mx.zeros_like(state.ring_n))


def init_ring(spec: Spec, state: DecodeState) -> DecodeState:
    B, _, H = state.g.shape
    return state.replace(ring_h=mx.zeros((B, RING, H), state.g.dtype),
                         ring_tok=mx.zeros((B, RING), mx.int32),
                         ring_n=mx.array(0, dtype=mx.int32))


# -- compiled graphs ------------------------------------------------------------------------
class Graphs:
    """Runs steps through graphs compiled once per (step, depth, spec key) and
    kept on the model (`model.runtime`), so later generations do not retrace;
    MLX keeps one trace per input shape (a capacity block). Eager when the
    spec cannot be compiled."""

    def __init__(self, spec: Spec, compiled: bool = True):
        self.spec, self.aux = spec, spec.aux()
        self.runtime = spec.model.runtime
        self.compiled = compiled and spec.compilable

    @property
    def traces(self) -> int:
        return sum(self.runtime.traces.values())

    def _fn(self, name: str, k: int, layout: tuple):
        key = (name, k, layout) + self.spec.graph_key()
        # the graph keeps only what its key describes (no arrays of this call)
        spec, runtime = self.spec.static(), self.runtime
        step = {"cycle": drafted_cycle, "plain": plain_step}.get(name)

        def run(tree, aux):
            runtime.traces[key] = runtime.traces.get(key, 0) + 1
            state = DecodeState.from_tree(tree, layout)
            if name == "flush":
                return flush_ring(spec, aux, state).tree()
            new, out = step(spec, aux, state, k) if name == "cycle" else step(spec, aux, state)
            return new.tree(), out.packed, out.logprobs

        # the weights are inputs, read at every call: a graph never runs with
        # weights the model no longer has (and keeps none alive)
        return runtime.graph(key, lambda: mx.compile(run, inputs=spec.model.state))

    def step(self, state: DecodeState, k: int, history=None) -> Tuple[DecodeState, StepOutput]:
        """A drafted cycle of depth k, or a plain step (k == 0)."""
        if not self.compiled:
            if k == 0:
                return plain_step(self.spec, self.aux, state, history)
            return drafted_cycle(self.spec, self.aux, state, k, history)
        layout = state.cache.layout
        tree, packed, logprobs = self._fn("cycle" if k else "plain", k, layout)(
            state.tree(), self.aux)
        return DecodeState.from_tree(tree, layout), StepOutput(packed, logprobs)

    def flush(self, state: DecodeState) -> DecodeState:
        if not self.compiled:
            return flush_ring(self.spec, self.aux, state)
        layout = state.cache.layout
        return DecodeState.from_tree(self._fn("flush", 0, layout)(state.tree(), self.aux), layout)


# -- feeding tokens on mlx_lm's caches -------------------------------------------------------
def prefill(spec: Spec, prompt_cache: list, prompt: mx.array, prefill_step_size: int,
            progress: Callable, key: Optional[mx.array]):
    """Process the prompt exactly as mlx_lm.generate_step does (same chunks, the
    last token alone) on the prompt cache's own objects, the head's cache
    following shifted by one. Returns (first token [B], its log-probs [B, 1, V],
    the head's hidden g, the key, the trunk's hidden at the last prompt
    token); nothing is evaluated but the chunks."""
    model = spec.model
    n_trunk = len(model.is_linear)
    trunk = prompt_cache[:n_trunk]
    head = head_caches(prompt_cache, n_trunk) if spec.use_head else None
    pending = last_hidden(prompt_cache, model.is_linear) if spec.use_head else None
    total, processed = prompt.size, 0
    progress(0, total)
    while total - processed > 1:
        n = min(prefill_step_size, total - processed - 1)
        h = model.trunk_hidden(prompt[None, processed : processed + n], trunk)
        if head is not None:  # pairs (h_p, tok_{p+1}); the next token is known
            start = processed if pending is not None else processed + 1
            hh = h if pending is None else mx.concatenate([pending, h], axis=1)
            _head(model, hh, prompt[None, start : processed + n + 1], head)
            pending = None
            mx.eval([c.state for c in head])
        mx.eval([c.state for c in trunk])
        processed += n
        progress(processed, total)
        mx.clear_cache()
    last = prompt[None, processed:]
    h = model.trunk_hidden(last, trunk)
    history = prompt[:-1] if spec.processors else None
    logprobs = _logprobs(model.logits_from_hidden(h), spec.processors, history, last)
    if spec.speculative:  # key: [1, 2], this row's
        key, sub = mx.random.split(key[0])
        key = key[None]
        y = spec.sampler.sample(logprobs[:, 0], sub)
    else:  # one dtype for every cycle's y
        y = _sample_rows(spec.sampler, logprobs)[:, 0]
    y = spec.shared(y)
    safe = spec.safe_ids(y)
    g = None
    if head is not None:
        hh = h if pending is None else mx.concatenate([pending, h], axis=1)
        toks = safe[:, None] if pending is None else mx.concatenate([last, safe[:, None]], axis=1)
        g = _head(model, hh, toks, head)[:, -1:]
    return y, safe, logprobs, g, key, h


def feed(spec: Spec, prompt_cache: list, tokens: List[int], ring: Optional[Tuple]):
    """Feed tokens that were emitted but not fed (the end of a generation) to
    the prompt cache's trunk, after the head caught up on the ring's pairs
    (ring: (hiddens, tokens, n) or None); the head follows shifted by one,
    and the trunk's last hidden is kept for the next call's first pair."""
    model = spec.model
    n_trunk = len(model.is_linear)
    head = head_caches(prompt_cache, n_trunk) if spec.use_head else None
    if head is not None and ring is not None and ring[2] > 0:
        _head(model, ring[0][:, : ring[2]], ring[1][:, : ring[2]], head)
    toks = mx.array(tokens, dtype=mx.int32)[None]
    h = model.trunk_hidden(toks, prompt_cache[:n_trunk])
    if head is not None:
        if toks.shape[1] > 1:
            _head(model, h[:, :-1], toks[:, 1:], head)
        set_last_hidden(prompt_cache, h[:, -1:], model.is_linear)
    elif len(prompt_cache) > n_trunk:
        set_last_hidden(prompt_cache, None, model.is_linear)  # the head did not follow
