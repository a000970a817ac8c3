"""A batch of rows decoding together: rows join and leave, each cycle is
queued as the schedule plans it (schedule.py) and read, and the host keeps
its books (docs/design.md, "One cycle, file by file").

One trunk forward per cycle for all rows, each row accepting its own number
of drafts (per-row lengths on the device) and sampling with its own
settings. Rows join (`add`: their prompts prefilled together, then merged)
and leave (`finish`) between cycles. With a lookahead of 1 (the default)
cycle n+1 is built and queued (`mx.async_eval`, the batch's `next`) before
cycle n (its `current`) is read, so the device never waits for Python;
with 0 (logits processors, host-side drafters, `lookahead=False`) each
cycle is read before the next is built.
Either way a cycle is read with one host transfer, and a cycle launched
past a row's end is never read.

`Batch.step()` yields one `Event` per token: (row, token, log-probs, its
log-prob, finish reason, from a draft). A row carries its stop tokens and
max_tokens; the batch alone decides where it ends and what its prompt cache
keeps (the tokens handed out up to there).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import checks
from .cache import cache_length, check_model_cache, entry_length, head_caches
from .context_draft import NGRAM_SIZES, context_state
from .cycle import (CTX_FIELDS, RING, DecodeState, Graphs, Guidance, Spec, init_ring,
                    is_host_side, unpack)
from .depth import cost_sample
from .distributed import first_stage, trunk_length
from .mlx_lm_compat import generation_stream
from .params import DecodeOptions
from .prefill import feed, prefill, prefill_media
from .held_cache import HeldCache
from .rows import FinishPoint, Launched, Ledger, Lengths, Media, Pending, Request, Row
from .schedule import CycleRecord, Schedule, needs_more
from .stats import MTPStats
from .sampling import (Filters, LogitsProcessors, MTPSampler, Penalties, RowSampling,
                       SamplerArrays, bias_row, row_key, start_window)


class Event(NamedTuple):
    """One token of one row, as `Batch.step` yields it."""

    row: Row
    token: int
    logprobs: mx.array  # [V]: the (processed) log-probs it was chosen from
    logprob: float  # its own
    finish: Optional[str]  # "stop" (a stop token), "length" (max_tokens) or None
    from_draft: bool  # an accepted draft


def make_batch(model, options: Optional[DecodeOptions] = None, *,
               sampler: Optional[Callable] = None, logits_processors: Optional[list] = None,
               **fields) -> "Batch":
    """An empty batch decoding with `options` (DecodeOptions, any of its
    fields also as keywords). `sampler`: an opaque sampler (any callable
    that is not greedy or an MTPSampler) is shared by every row; otherwise
    each row brings its own sampler (`Batch.prepare`), this one being the
    default; likewise `logits_processors` (mlx_lm's, run on the host with
    the row's history)."""
    if not hasattr(model, "make_cache") or not hasattr(model, "has_mtp"):
        raise TypeError("model must come from mlx_mtp.load")
    options = DecodeOptions.of(options, **fields)
    schedule, drafter = Schedule.of(options, model.has_mtp), options.drafter
    use_head = schedule.use_head
    opaque = None if RowSampling.of(sampler) is not None else sampler
    if use_head and opaque is not None and not isinstance(opaque, MTPSampler):
        import warnings

        warnings.warn("mlx_mtp: this sampler cannot be introspected, so drafts are verified by "
                      "exact match (still exact, fewer accepted); build it with "
                      "mlx_mtp.make_sampler for Leviathan-Chen acceptance", stacklevel=4)
    draft_vocab = options.draft_vocab
    if draft_vocab is not None and model.lm_head_group is not None:
        raise ValueError("a draft vocabulary needs the whole lm_head on each rank; this "
                         "model's is sharded over the vocabulary (tensor parallel)")
    spec = Spec(model, opaque, use_head=use_head,
                draft_vocab=draft_vocab if use_head else None,
                drafter=drafter if use_head else None, group=model.distributed_group,
                first_stage=first_stage(model),
                context=NGRAM_SIZES if options.context_drafts and use_head and drafter is None
                else None)
    return Batch(spec, Graphs(spec, options.compiled), options, schedule,
                 default_sampler=sampler, default_processors=logits_processors or ())


# prompts of at most this many new tokens join in one batched prefill
# (mlx_lm.server's --prompt-concurrency default); longer ones alone
PREFILL_BATCH = 8


class Batch:
    """Rows decoding together: one trunk forward per cycle for all of them,
    each row accepting its own number of drafts (per-row device lengths) and
    sampling with its own settings. Rows join (`add`: their prompts prefilled
    together, then merged) and leave (`finish`) between cycles. With
    lookahead 1 the next cycle is queued before one is read (see the module
    docstring)."""

    def __init__(self, spec: Spec, graphs: Graphs, options: DecodeOptions, schedule: Schedule,
                 default_sampler=None, default_processors=()):
        self.spec, self.graphs, self.options, self.schedule = spec, graphs, options, schedule
        self.timeline, self.default_sampler = options.timeline, default_sampler
        self.default_processors = default_processors
        self.limit_prefill(PREFILL_BATCH)
        self.state: Optional[DecodeState] = None
        self.rows: List[Row] = []
        # the double buffer: the cycle read next, and one queued behind it
        self.current: Optional[Launched] = None
        self.next: Optional[Launched] = None
        self.ledger = Ledger()
        self._parked: Optional[Graphs] = None  # depth 0's, for cold parked steps
        self.cycles = 0
        self._tic = time.perf_counter()
        self._launched = 0  # cycles launched since the last read
        self.starting = True  # no cycle read since the batch was last empty
        self.reads = 0  # host reads of device results (cycles, and a guided cycle's drafts)
        self._settings()

    # -- rows join and leave ---------------------------------------------------------------
    def accepts(self, sampling: Optional[RowSampling]) -> bool:
        """A row with these settings can decode in this batch (the sampled
        rows share top_k and min_tokens_to_keep; an opaque sampler is the
        batch's own)."""
        if self.spec.sampler is not None or sampling is None:
            return self.spec.sampler is not None and sampling is None
        shared = {r.sampling.shared for r in self.rows if not r.sampling.greedy}
        return sampling.greedy or not shared or shared == {sampling.shared}

    def host_row(self, processors=(), constraint=None) -> bool:
        """A row given these runs logits processors on the host, which makes
        the whole batch eager (sharded, a grammar is such a processor)."""
        return bool(processors) or (constraint is not None and self.spec.group is not None)

    def prepare(self, prompt, prompt_cache: Optional[list], max_tokens: int,
                seed: Optional[int] = None, *,
                sampler=None, logit_bias: Optional[Dict[int, float]] = None,
                penalties: Optional[Penalties] = None,
                logits_processors=None, stats: Optional[MTPStats] = None,
                progress=None, cached_tokens: Sequence[int] = (),
                stop_tokens: Sequence[int] = (), feed_tail: bool = True,
                constraint=None, tokenizer=None, media: Optional[Media] = None) -> Request:
        """Check one row's arguments against this batch's model: a Request.
        sampler: the row's own (default: the batch's; a RowSampling too);
        logit_bias and penalties are applied in-graph (mlx_lm's processors'
        arithmetic), logits_processors run on the host. Both see the row's
        history: `cached_tokens` (those the prompt cache already holds, as
        mlx_lm.server's batch passes them: `all_tokens`), the prompt, and the
        tokens emitted. The row ends with the first of `stop_tokens` it emits
        or its max_tokens-th token; feed_tail: see `finish`. constraint
        (`mlx_mtp.constrain(...)`, with the tokenizer): every token the row
        emits is one its grammar allows; the grammar belongs to the row (a
        matcher the batch advances as it reads), and the batch stays compiled
        (docs/design.md, "In the engine: the grammar belongs to the row").
        media: the prompt's images (vision.py builds it), on a fresh cache."""
        model = self.spec.model
        ids = checks.token_ids("prompt", prompt, model.vocab_size)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        max_tokens = checks.max_tokens(max_tokens)
        if seed is not None:
            checks.integer("seed", seed)
        sampler = self.default_sampler if sampler is None else sampler
        processors = self.default_processors if logits_processors is None else logits_processors
        if (isinstance(processors, LogitsProcessors) and processors.intact
                and self.spec.sampler is None and not isinstance(sampler, RowSampling)):
            # mlx_mtp.make_logits_processors': their bias and penalties run in-graph
            if processors.logit_bias and logit_bias:
                raise ValueError("a logit bias is given twice: as logit_bias and in "
                                 "logits_processors")
            logit_bias = processors.logit_bias or logit_bias
            penalties, processors = processors.penalties, ()
        processors = tuple(processors or ())
        sampling = (None if self.spec.sampler is not None else sampler
                    if isinstance(sampler, RowSampling)
                    else RowSampling.of(sampler, logit_bias, penalties))
        if penalties and sampling is None:
            raise ValueError("penalties with an opaque sampler: pass mlx_lm's processors "
                             "(logits_processors=)")
        if sampling is None and self.spec.sampler is None:
            raise ValueError("an opaque sampler is shared by a whole batch: make_batch(sampler=)")
        if logit_bias:
            checks.logit_bias(logit_bias, model.vocab_size)
        if sampling is not None and sampling.xtc_special:
            checks.token_ids("xtc_special_tokens", sampling.xtc_special, model.vocab_size)
        keep_cache = prompt_cache is not None  # else nobody sees it: no finishing work
        if prompt_cache is None:
            prompt_cache = model.make_cache()
        check_model_cache(prompt_cache, model)
        cached = cache_length(prompt_cache, model.is_linear)
        if media is not None:
            _check_media(media, ids, model, cached, self.spec.group)
        context = getattr(model.text_args, "max_position_embeddings", None)
        checks.prompt_length(cached + len(ids), context, id(model))
        matcher = None
        if constraint is not None:
            from .constraint import row_matcher

            matcher = row_matcher(constraint, tokenizer, model.vocab_size,
                                  context=[*cached_tokens, *ids])
            if self.host_row((), constraint):  # sharded: the grammar stays a host processor
                from .constraint import MaskingProcessor

                processors, matcher = (*processors, MaskingProcessor(constraint, tokenizer)), None
        return Request(ids, prompt_cache, keep_cache, max_tokens, row_key(sampling, seed),
                       stats if stats is not None else MTPStats(), sampling, processors,
                       progress, cached_tokens=tuple(cached_tokens) if (
                           processors or (sampling is not None and sampling.penalties)
                           or self.spec.context is not None) else (),
                       stop_tokens=frozenset(int(t) for t in stop_tokens), feed_tail=feed_tail,
                       matcher=matcher, media=media)

    def add(self, requests: List[Request]) -> List[Optional[Row]]:
        """Prefill new rows (short prompts together, long ones alone) and merge
        them into the batch; their first tokens come out of the next cycle.
        A row with max_tokens 0 only caches its prompt (None in its place)."""
        shared = {r.sampling.shared for r in self.rows if r.sampling is not None}
        for r in requests:
            if r.sampling is not None:
                shared.add(r.sampling.shared)
            if not self.accepts(r.sampling) or len(shared - {None}) > 1:
                raise ValueError("this row's sampler cannot share the batch (top_k and "
                                 "min_tokens_to_keep differ from its sampled rows)")
        drafter = self.spec.drafter
        if is_host_side(drafter) and (self.rows or len(requests) > 1):
            raise ValueError("a host-side drafter decodes one row at a time")
        step = self.options.prefill_step_size
        short = [r for r in requests if len(r.prompt) - 1 <= step and r.media is None]
        groups = [short[i:i + self.prefill_batch]
                  for i in range(0, len(short), self.prefill_batch)]
        groups += [[r] for r in requests if r not in short]
        made = {}
        for group in groups:
            for r, row in zip(group, self._join(group)):
                made[id(r)] = row
        return [made[id(r)] for r in requests]

    def feed_prefix(self, prompt_cache: list, tokens: Sequence[int]):
        """Feed all of `tokens` but the last to a prompt cache, as a row's
        prefill does, without a row (the server's idle-time prefill of a
        next turn, a piece at a time: the last token is the next piece's
        first; the final piece is a request with max_tokens 0)."""
        check_model_cache(prompt_cache, self.spec.model)
        with mx.stream(generation_stream):
            prefill(self.spec, [prompt_cache], [list(tokens)], self.options.prefill_step_size,
                    head_window=self.spec.model.head_context, last_pair=False)

    def _join(self, requests: List[Request]) -> List[Optional[Row]]:
        spec, model = self.spec, self.spec.model
        n_trunk = len(model.is_linear)
        use_head = spec.use_head

        def progress(i, done, total):
            if requests[i].progress is not None:
                requests[i].progress(done, total)

        def snapshot(i, n):
            if requests[i].snapshot is not None:
                requests[i].snapshot(n)

        # parked (auto at depth 0 for the batch these rows make), the head
        # does not follow the prompts: prefill then costs what mlx_lm's does,
        # and the head drafts from a history with a gap if it drafts again
        # (acceptance may dip, exactness cannot; docs/design.md, "Parking"); a
        # prompt only cached (max_tokens 0) is there for later drafting: it follows
        follows = use_head and (not self.schedule.parked(spec, len(self.rows) + len(requests))
                                or any(r.max_tokens == 0 for r in requests))
        fed = spec if follows else dataclasses.replace(spec, use_head=False)
        with mx.stream(generation_stream):
            if requests[0].media is not None:  # (alone: `add`)
                r = requests[0]
                prefilled = [prefill_media(fed, r.prompt_cache, r.prompt, r.media,
                                           self.options.prefill_step_size,
                                           lambda done, total: progress(0, done, total),
                                           r.stops, lambda n: snapshot(0, n))]
            else:
                prefilled = prefill(fed, [r.prompt_cache for r in requests],
                                    [r.prompt for r in requests], self.options.prefill_step_size,
                                    progress, [r.stops for r in requests], snapshot,
                                    model.head_context)  # (docs/design.md, "Head context")
        rows, states = [], []
        for r, pf in zip(requests, prefilled):
            y = r.prompt[-1]
            if r.max_tokens == 0:  # mlx_lm then leaves the whole prompt in the cache
                if r.keep_cache:
                    feed(spec, r.prompt_cache, [y])
                    mx.eval([c.state for c in r.prompt_cache])
                rows.append(None)
                continue
            lens = Lengths(trunk_length(r.prompt_cache, model),
                           entry_length(head_caches(r.prompt_cache, n_trunk)[0]) if use_head else 0)
            held = HeldCache(r.prompt_cache, r.keep_cache)
            state = DecodeState(held.take(model, use_head), mx.array([y], dtype=mx.int32),
                                mx.zeros((1,), mx.int32), key=r.key)
            if spec.sampler is None:  # (kept while some row of the batch has penalties)
                state = state.replace(window=start_window([*r.cached_tokens, *r.prompt[:-1]]))
            if r.media is not None:
                state = state.replace(rope_delta=mx.array([r.media.delta], dtype=mx.int32))
            if spec.context is not None:  # what its context runs copy from
                state = state.replace(**dict(zip(CTX_FIELDS, context_state(
                    [*r.cached_tokens, *r.prompt], spec.context))),
                    ctx_trust=mx.array([[1.0, 0.5]]))  # (its runs tried first)
            if use_head:
                # a one-token prompt on an empty cache has no trunk hidden yet: its
                # first drafts come from zeros (rejected; its first cycle fixes that)
                g = pf.g if pf.g is not None else mx.zeros(
                    (1, 1, model.hidden_width), mx.float32)
                state = init_ring(state.replace(g=g))
            row = Row(held, r.max_tokens, r.stop_tokens, r.feed_tail, r.stats, lens, r.sampling,
                      r.processors, matcher=r.matcher)
            row.last = FinishPoint(state.without_buffers() if held.keep else None, len(states),
                              lens, y, [])
            if r.processors:
                row.history = mx.array([*r.cached_tokens, *r.prompt], dtype=mx.int32)
            if is_host_side(spec.drafter):
                spec.drafter.start()  # such a drafter has one row
            if r.sampling is not None and r.sampling.logit_bias:
                row.bias = mx.array(bias_row(r.sampling.logit_bias, model.vocab_size),
                                    dtype=mx.float32)
            rows.append(row)
            states.append(state)
        if not states:
            return rows
        new = states[0]
        for s in states[1:]:
            new = _concat(new, s)
        if self.state is None:
            self.state = new
        else:
            if self.ledger.ring:  # every row's ring empty, so they stay in step
                self._grow(0, catch_up=True)
                self.state = self.graphs.flush(self.state)
                self._flushed()
            self.state = _concat(self.state, new)
        base = len(self.rows)
        for row in rows:
            if row is not None:
                before = row.last.before
                row.last = row.last._replace(
                    before=None if before is None else self.state.without_buffers(),
                    index=base + row.last.index)
                self.rows.append(row)
        self._settings()
        self._tic = time.perf_counter()  # the next cost sample starts here, not in the prefill
        return rows

    def finish(self, row: Row):
        """The row leaves: its prompt cache gets the state at its finishing
        point (the tokens handed out: through the last event yielded for it),
        then it is removed from the batch. A row whose request set
        feed_tail=False (the server's prefix cache, as mlx_lm.server keeps
        it): the cache keeps the state before the row's last read cycle as it
        is, without the tokens emitted since (no trunk forward when a row
        leaves); `trunk_length` of its prompt cache says how far it goes."""
        if row.done:
            return
        row.done = True
        index = self.rows.index(row)
        if row.held.keep:
            before, i, lens, y, tokens = row.last
            state = before.take_rows([i])
            state = state.replace(cache=state.cache.with_buffers_of(
                self.state.cache.take_rows(mx.array([index], dtype=mx.int32))))
            row.held.give_back(self.spec, state, lens,
                               [y] + tokens[:row.used] if row.feed_tail else [])
        self.rows.pop(index)
        keep = [i for i in range(len(self.rows) + 1) if i != index]
        self.state = self.state.take_rows(keep) if self.rows else None
        if not self.rows:
            self.current = self.next = None
            self.ledger = Ledger()
            self.starting = True
        self._settings()

    def _settings(self):
        """The spec and per-row sampler arrays the present rows need: a batch
        whose last sampled row left runs the greedy graph again."""
        spec = self.spec
        filters = spec.filters if spec.sampler is not None else Filters.of(
            r.sampling for r in self.rows)
        processors = any(r.processors for r in self.rows)
        if (filters, processors) != (spec.filters, spec.processors):
            self.spec = spec = dataclasses.replace(spec, filters=filters, processors=processors)
            self.graphs.use(spec)
            self._parked = None
        self.schedule.settle(spec, self.rows)
        if self.state is None or spec.sampler is not None:
            return
        f = spec.filters
        arrays = SamplerArrays.of([r.sampling for r in self.rows],
                                  dataclasses.replace(f, bias=False), spec.model.vocab_size)
        if f.bias:  # each row's bias row, built once when it joined
            zero = mx.zeros((spec.model.vocab_size,), mx.float32)
            arrays = arrays.replace(bias=mx.stack([r.bias if r.bias is not None else zero
                                                   for r in self.rows]))
        key = self.state.key
        if f.sampled and key is None:
            key = mx.zeros((len(self.rows), 2), mx.uint32)
        self.state = self.state.replace(key=key if f.sampled else None, sampling=arrays,
                                        window=self.state.window if any(f.penalties) else None)

    def limit_prefill(self, prompts: int):
        """Prompts prefilled together (mlx_lm.server's --prompt-concurrency)."""
        self.prefill_batch = max(1, prompts)

    # -- cycles ------------------------------------------------------------------------------
    @property
    def in_flight(self) -> tuple:
        """The cycles queued and not read yet, oldest first."""
        return tuple(c for c in (self.current, self.next) if c is not None)

    def _parked_graphs(self) -> Graphs:
        """Depth 0's graphs, for a parked batch's cold plain steps (Plan.cold)."""
        if self._parked is None:
            spec = dataclasses.replace(self.spec, use_head=False, draft_vocab=None,
                                       drafter=None, vocab_head_rows=None)
            self._parked = Graphs(spec, self.graphs.compiled)
        return self._parked

    def _flushed(self):
        """The head caught up on the ring: the rows' lengths count it once the
        cycles launched before it are read."""
        newest = self.next or self.current
        self.ledger.flushed(self.rows, in_flight=newest is not None)
        if self.next is not None:
            self.next = dataclasses.replace(self.next, flush_after=True)
        elif self.current is not None:
            self.current = dataclasses.replace(self.current, flush_after=True)

    def _grow(self, k: int, catch_up: bool):
        """Room in the caches for a cycle of depth k: the trunk's k + 1
        entries, the head's ring and k + 1 more. A catch-up runs the head over
        all RING slots at its length before trimming the unwritten ones, so
        it needs RING entries there (a write past a buffer's end would
        corrupt memory: MLX does not check a dynamic slice_update)."""
        bounds = [self.ledger.bound(r, self.in_flight) for r in self.rows]
        head = max(b.flushed().head + k + 1 for b in bounds)
        if catch_up:
            head = max(head, max(b.head for b in bounds) + RING)
        trunk = max(b.trunk for b in bounds) + k + 1
        cache = self.state.cache.grown(trunk, head)
        room = cache.room()
        if room[0] < trunk or (cache.head and room[1] < head):
            raise RuntimeError(f"internal error: buffers of {room} entries for a cycle that "
                               f"may write up to ({trunk}, {head})")
        self.state = self.state.replace(cache=cache)

    def _launch(self) -> bool:
        """Queue the next cycle as the schedule plans it; False when none may be."""
        if self.next is not None:
            raise RuntimeError("internal error: a third cycle queued (the lookahead is 1)")
        plan = self.schedule.plan(self.spec, self.rows, self.in_flight, self.ledger.ring)
        if plan is None:
            return False
        spec, k = self.spec, plan.k
        cold = self._parked_graphs() if plan.cold else None
        self._grow(k, plan.catch_up)
        history = None
        if spec.processors:  # rows' tokens are on the host (lookahead 0)
            history = [(r.processors, r.history[:-1]) if r.processors else None
                       for r in self.rows]
        guidance, masks = self._guidance(k, plan.runs) if plan.guided else (None, None)
        keep = any(r.held.keep for r in self.rows)
        before, traces = self.state.without_buffers() if keep else None, self.graphs.traces
        t0 = time.perf_counter()
        out, pending = None, None
        if plan.forward_only:
            graphs = cold if cold is not None else self.graphs
            mid, fwd = graphs.forward(self.state.without_head() if cold is not None
                                      else self.state)
            pending = Pending(graphs, mid, fwd, cold is not None)
        elif cold is not None:
            new, out = cold.step(self.state.without_head(), 0, False, history, guidance)
            self.state = new.with_head_of(self.state)
        elif guidance is not None and k:  # the host reads the drafts for the masks
            mid, proposals, verified = self.graphs.propose(self.state, k, plan.catch_up,
                                                           history, guidance, plan.head,
                                                           plan.context)
            words = masks(None if guidance.forced_all else np.array(proposals.drafts))
            self.state, out = self.graphs.settle(mid, proposals, verified, words,
                                                 plan.catch_up, history, guidance)
        else:
            self.state, out = self.graphs.step(self.state, k, plan.catch_up, history, guidance,
                                               plan.head, plan.context)
        built = time.perf_counter()
        if plan.forward_only:
            mx.async_eval(fwd.logits, fwd.h, _arrays(mid))
        else:
            mx.async_eval(out.packed, out.logprobs, _arrays(self.state))
        t1 = time.perf_counter()
        counts = None if plan.forward_only else self.ledger.launched(
            k, plan.cold, spec.use_head, self.state)
        launched = Launched(k, out, before, self.graphs.traces > traces, tuple(self.rows),
                            dict(build0=t0, build1=built, queued=t1), cold=plan.cold,
                            counts=counts, pending=pending, jump=plan.jump, head=plan.head)
        if self.current is None:
            self.current = launched
        else:
            self.next = launched
        self._launched += 1
        return True

    def _complete(self, cycle: Launched) -> Launched:
        """A guided plain step queued ahead, completed: its masked sample, now
        that the grammars have the tokens of the cycle before."""
        pending, traces = cycle.pending, self.graphs.traces
        guidance, _ = self._guidance(0)
        new, out = pending.graphs.sample(pending.state, pending.fwd, guidance)
        self.state = new.with_head_of(self.state) if pending.cold else new
        # (the caches were queued with the forward: only the sample's arrays now)
        mx.async_eval(out.packed, out.logprobs, _arrays(new.without_caches()))
        counts = self.ledger.launched(cycle.k, cycle.cold, self.spec.use_head, self.state)
        return dataclasses.replace(cycle, out=out, pending=None, counts=counts,
                                   traced=cycle.traced or self.graphs.traces > traces)

    def _guidance(self, k: int, runs: Optional[List[List[int]]] = None):
        """The rows' grammars before a cycle of depth k: the mask of the next
        position and the drafts each grammar forces (Guidance; `runs`: each
        row's forced run, when known), and the function that gives the masks
        after each draft prefix, from the drafts read, or from the forced
        drafts when the grammars force them all (no read: None is passed)
        (rows without a grammar: every token)."""
        from .constraint import batch_masks

        guided = [(i, r.matcher) for i, r in enumerate(self.rows) if r.matcher is not None]
        at = [i for i, _ in guided]
        width = guided[0][1].words
        first = np.full((len(self.rows), width), -1, np.int32)
        words, _ = batch_masks([(m, ()) for _, m in guided], 1)
        first[at] = words[:, 0].view(np.int32)
        forced = None
        if k:
            forced = np.full((len(self.rows), k), -1, np.int32)
            for i, m in guided:
                run = m.forced(limit=k) if runs is None else runs[i][:k]
                forced[i, :len(run)] = run
                self.rows[i].stats.forced += len(run)
        forced_all = forced is not None and bool((forced >= 0).all())

        def masks(drafts: Optional[np.ndarray]) -> mx.array:
            if drafts is None:
                drafts = forced
            else:
                self.reads += 1
            out = np.full((len(self.rows), k + 1, width), -1, np.int32)
            words, _ = batch_masks([(m, drafts[i].tolist()) for i, m in guided], k + 1)
            out[at] = words.view(np.int32)
            return mx.array(out)

        return Guidance(mx.array(first), None if forced is None else mx.array(forced),
                        forced_all), masks

    def step(self) -> Iterator[Event]:
        """Queue cycles up to the lookahead, read the oldest one, and yield its
        tokens as events, row by row. A row ends with its first stop token or
        its max_tokens-th token: the batch finishes it before yielding that
        event. A caller may `finish` a row between events (a stop string, a
        client gone): it keeps the tokens yielded so far."""
        for row, tokens, logprobs, token_lps, accepted in self._read():
            for j, t in enumerate(tokens):
                if row.done:
                    break
                row.used, row.emitted = j + 1, row.emitted + 1
                reason = ("stop" if t in row.stop_tokens else
                          "length" if row.emitted == row.max_tokens else None)
                if reason is not None:
                    self.finish(row)
                yield Event(row, t, logprobs[j], float(token_lps[j]), reason, j < accepted)

    def _read(self) -> list:
        """Queue cycles up to the lookahead and read the oldest one: per row
        still in the batch, (row, its tokens, their log-prob rows, the
        tokens' log-probs, drafts accepted), its bookkeeping done."""
        ahead = self.schedule.ahead(self.spec, self.rows, self.in_flight, self.starting)
        while self.rows and len(self.in_flight) <= ahead and any(
                needs_more(r, self.in_flight) for r in self.rows):
            if not self._launch():
                break
        if self.current is None:
            return []
        cycle, self.current, self.next = self.current, self.next, None
        if cycle.pending is not None:  # (completed when the one before was read, unless
            # that read raised before it got there)
            cycle = self._complete(cycle)
        first, self.starting = self.starting, False
        self.reads += 1
        wait0 = time.perf_counter()
        read = unpack(np.array(cycle.out.packed), cycle.k)
        accepted_all, tokens_all, lps_all, bad_drafts = read[:4]
        toc = time.perf_counter()
        k, out, accepted = cycle.k, [], []
        for i, row in enumerate(cycle.rows):
            if row.done:
                continue
            a = int(accepted_all[i])
            tokens = tokens_all[i, : a + 1].tolist()
            _check_ids(tokens, int(bad_drafts[i]), self.spec.model.vocab_size)
            before_lens = self.ledger.read(row, cycle, i, a)
            y = (row.last.tokens or [row.last.y])[-1]
            row.last, row.used = FinishPoint(cycle.before, i, before_lens, y, tokens), 0
            row.landed += len(tokens)
            row.stats.record(0 if cycle.jump else k, a)  # (a jump's drafts are not the head's)
            row.stats.jumps += cycle.jump
            if read.context[i]:
                row.stats.context_drafted += k
                row.stats.context_accepted += a
            if row.matcher is not None:  # drawn under its masks: up to a stop token, the
                # grammar allows them (advance checks); what follows a stop is never emitted
                row.matcher.advance(row.matcher.before_stop(tokens))
            accepted.append(a)
            if row.history is not None:
                row.history = mx.concatenate([row.history, mx.array(tokens, row.history.dtype)])
            if is_host_side(self.spec.drafter):
                self.spec.drafter.observe(tokens)
            out.append((row, tokens, cycle.out.logprobs[i], lps_all[i, : a + 1], a))
        if self.current is not None and self.current.pending is not None:
            self.current = self._complete(self.current)  # (the grammars now have this
            # cycle's tokens)
        measured = accepted and not cycle.jump and self.schedule.measures(self.spec,
                                                                         len(cycle.rows))
        sample = None if not measured else cost_sample(
            cycle, self.current or cycle, lookahead=self.current is not None,
            distributed=self.spec.group is not None, first=first, launches=self._launched,
            since=self._tic, now=toc)
        waited = None if sample is None else sample[0]
        # (rows counted as launched: a cheaper cycle of fewer rows must not count
        # as a sample of a larger batch's probe, nor the reverse)
        self.schedule.observe(self.spec, CycleRecord(
            k, cycle.head if cycle.head is not None else k, cycle.jump, len(cycle.rows),
            tuple(accepted),
            tuple(bool(read.context[i]) for i, row in enumerate(cycle.rows) if not row.done),
            None if waited is None else (waited.k, waited.head if waited.head is not None
                                         else waited.k, len(waited.rows), sample[1])))
        self._tic, self._launched = toc, 0
        if self.timeline is not None:
            stamps = (self.current or cycle).stamps
            self.timeline.append(dict(stamps, wait0=wait0, wait1=toc,
                                      land1=time.perf_counter(), k=k,
                                      accepted=int(accepted_all[0]) if len(accepted_all) else 0))
        self.cycles += 1
        if self.cycles % 128 == 0:
            mx.clear_cache()
        return out


def _concat(a: DecodeState, b: DecodeState) -> DecodeState:
    """Rows of two states; a key or a penalty window only one side has is
    filled on the other (greedy rows carry an unused key in a batch that
    samples; rows without penalties an empty window)."""
    for name, fill in (("key", 0), ("window", -1), ("rope_delta", 0)):
        if (getattr(a, name) is None) != (getattr(b, name) is None):
            like = getattr(a, name) if getattr(a, name) is not None else getattr(b, name)

            def filled(s):
                return s if getattr(s, name) is not None else s.replace(**{name: mx.full(
                    (s.y.shape[0],) + like.shape[1:], fill, like.dtype)})

            a, b = filled(a), filled(b)
    return DecodeState.concat(a, b)


def _check_media(media: Media, ids: List[int], model, cached: int, group):
    """A prompt's images fit its tokens, its prompt cache (holding the
    prompt's first `media.start` tokens) and this model (one line each)."""
    if not getattr(model, "takes_images", False):
        raise ValueError("this model takes no images (only Qwen3.5/3.6 and qwen4_exp folders "
                         "with a vision tower do)")
    if group is not None:
        raise ValueError("images are not supported on a sharded model yet")
    if cached != media.start:
        raise ValueError(f"the prompt cache holds {cached} tokens, the images' layout "
                         f"{media.start}")
    total = media.start + len(ids)
    if media.positions.shape != (3, total):
        raise ValueError(f"the images' positions cover {media.positions.shape[-1]} tokens, "
                         f"the prompt has {total}")
    if not (media.positions[:, -1] == total - 1 + media.delta).all():
        raise ValueError("the prompt ends inside an image: end it with text")
    need = model.text_after_images
    if need > 1:
        at_index = (media.positions == np.arange(total) + media.delta).all(axis=0)
        if not at_index[-need:].all():
            raise ValueError(f"the prompt needs at least {need} tokens after its last image "
                             "(a chat template's end of turn gives them)")


def _arrays(state: DecodeState) -> list:
    return [x for _, x in tree_flatten(state.tree()) if x is not None]


def _check_ids(tokens: List[int], bad_drafts: int, vocab: int):
    """A read cycle's ids, raw: the device used them clamped (cycle.in_vocab),
    so nothing out of bounds was read; the generation stops here."""
    for t in tokens:
        if not 0 <= t < vocab:
            raise ValueError(f"the sampler returned token id {t}, outside the vocabulary "
                             f"(0..{vocab - 1})")
    if bad_drafts:
        raise ValueError(f"the drafter proposed {bad_drafts} token id(s) outside the "
                         f"vocabulary (0..{vocab - 1})")
