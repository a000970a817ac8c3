"""The decode loop: prefill, then cycles, with a lookahead of 0 or 1.

With lookahead 1 (the default) cycle n+1 is built and queued
(`mx.async_eval`) before cycle n is read, so the device never waits for
Python; with 0 (logits processors, host-side drafters, `pipeline=False`)
each cycle is read before the next is built. Either way a cycle is read
with one host transfer, and a cycle launched past EOS or `max_tokens` is
never read.

The prompt cache (mlx_lm's objects, cache.py) is turned into the decoding
form after the prompt and written back when the generator finishes, however
it finishes (max_tokens, the caller stopping at EOS, close()): it then holds
exactly what mlx_lm's would — the prompt and every token yielded, the last
one included, and nothing drafted or rejected. The state before the cycle
that emitted the last yielded token is kept for that (its KV buffers are the
latest ones: later cycles only write past its lengths) and the tokens it
emitted up to there are fed on top.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from . import checks
from .cache import MTPCache, cache_length, check_prompt_cache, head_caches, set_last_hidden
from .cycle import RING, DecodeState, Graphs, Spec, feed, init_ring, prefill
from .depth import DepthController
from .distributed import agree, first_stage
from .sampling import MTPSampler, is_greedy


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

    def record(self, depth: int, accepted: int):
        self.cycles += 1
        self.emitted += accepted + 1
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


def mix_seed(seed: int) -> int:
    """splitmix64 of the user's seed. MLX keys of nearby seeds give measurably
    correlated samples; mixing makes runs with seeds 0, 1, 2, ... independent."""
    m = (1 << 64) - 1
    z = (int(seed) + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


@dataclass
class Lengths:
    """Host copies of the state's cache lengths (exact, or upper bounds)."""

    trunk: int
    head: int
    ring: int = 0

    def flushed(self) -> "Lengths":
        return Lengths(self.trunk, self.head + self.ring, 0)

    def after(self, k: int, accepted: int, ring: bool) -> "Lengths":
        if k == 0:
            return Lengths(self.trunk + 1, self.head, self.ring + int(ring))
        return Lengths(self.trunk + accepted + 1, self.head + accepted + 1, self.ring)


@dataclass
class Launched:
    k: int
    out: object  # StepOutput
    before: Optional[DecodeState]  # the state it started from, without KV buffers
    flushed: bool  # the ring was flushed right before it
    traced: bool  # its launch traced a graph (slow: not a cost sample)
    rows: list  # the batch's rows, in order, when it was launched
    stamps: dict  # perf_counter times of its launch
    flush_after: bool = False  # the ring was flushed right after it (a row joined)


def generate_tokens(
    prompt: mx.array,
    model,
    *,
    max_tokens: int = 256,
    draft_tokens: Union[int, str] = "auto",
    max_draft_tokens: int = 4,
    sampler: Optional[Callable] = None,
    logits_processors: Optional[list] = None,
    prompt_cache: Optional[list] = None,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    seed: Optional[int] = None,
    pipeline: bool = True,
    compiled: bool = True,
    draft_vocab: Optional[mx.array] = None,
    stats: Optional[MTPStats] = None,
    drafter=None,
    controller: Optional[DepthController] = None,
    timeline: Optional[list] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft) like mlx_lm's speculative_generate_step.
    See `mlx_mtp.generate_step` for the arguments; drafter, controller and
    timeline are for tests and benchmarks (timeline: a list that gets, per
    cycle read, the perf_counter stamps of the loop's host work)."""
    batch = make_batch(model, draft_tokens=draft_tokens, max_draft_tokens=max_draft_tokens,
                       sampler=sampler, logits_processors=logits_processors,
                       pipeline=pipeline, compiled=compiled, draft_vocab=draft_vocab,
                       drafter=drafter, controller=controller, timeline=timeline)
    prompt, prompt_cache, keep_cache, max_tokens, key = batch.prepare(
        prompt, prompt_cache, max_tokens, seed, prefill_step_size)
    request = Request(prompt, prompt_cache, keep_cache, max_tokens, key,
                      stats if stats is not None else MTPStats())
    owner = object()
    gen = _generate(batch, request, prefill_step_size,
                    prompt_progress_callback or (lambda *_: None), owner)
    if keep_cache:
        _OWNERS[id(prompt_cache)] = (owner, weakref.ref(gen))
    return gen


def make_batch(model, *, draft_tokens: Union[int, str] = "auto", max_draft_tokens: int = 4,
               sampler: Optional[Callable] = None, logits_processors: Optional[list] = None,
               pipeline: bool = True, compiled: bool = True,
               draft_vocab: Optional[mx.array] = None, drafter=None,
               controller: Optional[DepthController] = None,
               timeline: Optional[list] = None) -> "Batch":
    """An empty batch with these decoding settings (shared by all its rows);
    the arguments are checked here, once."""
    if not hasattr(model, "make_cache") or not hasattr(model, "has_mtp"):
        raise TypeError("model must come from mlx_mtp.load")
    depth = checks.depth(draft_tokens)
    checks.integer("max_draft_tokens", max_draft_tokens, 1, checks.MAX_DEPTH)
    if mtp_disabled_by_env():
        depth = 0
    auto = depth == "auto"
    use_head = model.has_mtp and depth != 0
    if not use_head:
        depth, controller = 0, None
    elif not auto:
        controller = None
    if use_head and not is_greedy(sampler) and not isinstance(sampler, MTPSampler):
        import warnings

        warnings.warn("mlx_mtp: this sampler cannot be introspected, so drafts are verified by "
                      "exact match (still exact, fewer accepted); build it with "
                      "mlx_mtp.make_sampler for Leviathan-Chen acceptance", stacklevel=4)
    if draft_vocab is not None and model.lm_head_group is not None:
        raise ValueError("a draft vocabulary needs the whole lm_head on each rank; this "
                         "model's is sharded over the vocabulary (tensor parallel)")
    spec = Spec(model, sampler, use_head=use_head, ring=auto and use_head,
                processors=tuple(logits_processors or ()),
                draft_vocab=draft_vocab if use_head else None,
                drafter=drafter if use_head else None, group=model.distributed_group,
                first_stage=first_stage(model))
    if drafter is not None and drafter.host_side and not spec.speculative:
        raise ValueError("a host-side drafter needs an MTPSampler with temp > 0")
    # a sampler of our own or greedy cannot leave the vocabulary; any other's
    # tokens are checked on the host before the next cycle reads them
    trusted = is_greedy(sampler) or isinstance(sampler, MTPSampler)
    lookahead = 1 if pipeline and not spec.host_history and trusted else 0
    return Batch(spec, Graphs(spec, compiled), lookahead, depth, max_draft_tokens, controller,
                 timeline=timeline, vocab=None if trusted else model.vocab_size)


# id(prompt cache) -> (token, the generator using it): the cache's objects are
# empty while a generation owns them (see _detach)
_OWNERS: dict = {}


def row_key(spec: Spec, seed: Optional[int]) -> Optional[mx.array]:
    """A row's sampling key [1, 2] (None when greedy): from the seed, else
    drawn from mx.random (so mx.random.seed makes runs repeatable too)."""
    if not spec.speculative:
        return None
    key = (mx.random.key(mix_seed(seed)) if seed is not None
           else mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32))
    return key[None]


def _generate(batch: "Batch", request: "Request", prefill_step_size, progress, owner):
    """One row: yield (token, log-probs, from_draft) as its cycles are read;
    when the caller stops (max_tokens, EOS, close) the row's prompt cache is
    written back (by `decode_rows`)."""
    try:
        for _, t, logprobs, _, from_draft in decode_rows(batch, [request], (), 1,
                                                          prefill_step_size, progress):
            if t is None:  # max_tokens 0
                return
            yield t, logprobs, from_draft
    finally:
        if _OWNERS.get(id(request.prompt_cache), (None,))[0] is owner:
            del _OWNERS[id(request.prompt_cache)]


@dataclass
class Request:
    """One sequence for `decode_rows` (the fields `Batch.prepare` returns)."""

    prompt: mx.array
    prompt_cache: list
    keep_cache: bool
    max_tokens: int
    key: Optional[mx.array]
    stats: MTPStats = field(default_factory=MTPStats)


def decode_rows(batch: "Batch", requests: List[Request], stop_tokens, width: int = 32,
                prefill_step_size: int = 2048, progress=lambda *_: None):
    """Continuous batching: up to `width` requests decode together, the next
    joining as one finishes. Yields (request index, token, log-probs, finish
    reason or None, from_draft); a stop token comes with "stop", the
    max_tokens-th with "length". A request with max_tokens 0 yields (index,
    None, None, "length", False). A row still decoding when the caller stops
    is finished with the tokens yielded so far."""
    pending = deque(enumerate(requests))
    active: dict = {}  # Row -> [request index, tokens yielded]
    stop_tokens = set(stop_tokens)

    def emit(row, i, used, t, logprobs, from_draft):
        active[row][1] += 1
        row.used = used  # of its last read cycle's tokens: where it finishes
        reason = ("stop" if t in stop_tokens else
                  "length" if active[row][1] == row.max_tokens else None)
        if reason is not None:
            batch.finish(row)
            del active[row]
        return i, t, logprobs, reason, from_draft

    with mx.stream(generation_stream):
        try:
            while pending or active:
                while pending and len(active) < width:
                    i, r = pending.popleft()
                    row, first, logprobs = batch.add(r.prompt, r.prompt_cache, r.keep_cache,
                                                     r.max_tokens, r.key, r.stats,
                                                     prefill_step_size, progress)
                    if row is None:
                        yield i, None, None, "length", False
                        continue
                    active[row] = [i, 0]
                    yield emit(row, i, 0, first, logprobs, False)
                for row, tokens, logprobs, accepted in batch.step():
                    for j, t in enumerate(tokens):
                        if row not in active:
                            break
                        yield emit(row, active[row][0], j + 1, t, logprobs[j], j < accepted)
        finally:
            for row in list(active):
                batch.finish(row)


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """What the host keeps for one sequence of a batch."""

    prompt_cache: list
    keep_cache: bool  # write the cache back when the row finishes
    max_tokens: int  # -1: no limit
    stats: MTPStats
    lens: Lengths  # exact, after the cycles read so far
    landed: int = 1  # tokens read so far (the prefill's included)
    # finishing point: the state before the row's last read cycle (without KV
    # buffers), the row's index in it, its lengths then, its y then, and that
    # cycle's tokens, of which the caller used `used`
    last: tuple = None
    used: int = 0
    history: Optional[mx.array] = None  # logits processors (one row)
    generated: Optional[List[int]] = None  # host-side drafters (one row)
    done: bool = False


class Batch:
    """Rows decoding together: one trunk forward per cycle for all of them,
    each row accepting its own number of drafts (per-row device lengths).
    Rows join (`add`: prefilled alone, then merged) and leave (`finish`)
    between cycles. With lookahead 1 the next cycle is queued before one is
    read (see the module docstring)."""

    def __init__(self, spec: Spec, graphs: Graphs, lookahead: int, depth, max_draft_tokens=4,
                 controller=None, timeline: Optional[list] = None, vocab: Optional[int] = None):
        self.spec, self.graphs, self.lookahead = spec, graphs, lookahead
        self.depth, self.max_depth, self.controller = depth, max_draft_tokens, controller
        self.timeline, self.vocab = timeline, vocab
        self.state: Optional[DecodeState] = None
        self.rows: List[Row] = []
        self.inflight: deque = deque()
        self.ring = 0  # plain steps' pairs waiting for the head (the same for every row)
        self.cycles = 0
        self._tic = time.perf_counter()

    # -- rows join and leave ---------------------------------------------------------------
    def prepare(self, prompt, prompt_cache: Optional[list], max_tokens: int,
                seed: Optional[int], prefill_step_size: int = 2048):
        """Check one row's arguments against this batch's model: returns (prompt,
        prompt cache, whether the caller keeps it, max_tokens, sampling key)."""
        model = self.spec.model
        if self.rows and self.spec.host_history:
            raise ValueError("logits processors and host-side drafters decode one row at a time")
        ids = checks.token_ids("prompt", prompt, model.vocab_size)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        max_tokens = checks.max_tokens(max_tokens)
        checks.integer("prefill_step_size", prefill_step_size, lo=1)
        if seed is not None:
            checks.integer("seed", seed)
        keep_cache = prompt_cache is not None  # else nobody sees it: no finishing work
        if prompt_cache is None:
            prompt_cache = model.make_cache()
        else:  # a generation still open on this cache finishes first (writing it back)
            owner = _OWNERS.get(id(prompt_cache))
            if owner is not None and owner[1]() is not None:
                owner[1]().close()
        head_layers = len(model.mtp.layers) if model.has_mtp else 0
        check_prompt_cache(prompt_cache, model.is_linear, head_layers)
        context = getattr(model.text_args, "max_position_embeddings", None)
        checks.prompt_length(cache_length(prompt_cache, model.is_linear) + len(ids), context,
                             id(model))
        return (mx.array(ids, dtype=mx.int32), prompt_cache, keep_cache, max_tokens,
                row_key(self.spec, seed))

    def add(self, prompt: mx.array, prompt_cache: list, keep_cache: bool, max_tokens: int,
            key, stats: MTPStats, prefill_step_size: int = 2048, progress=lambda *_: None):
        """Prefill a new row on its own prompt cache and merge it into the batch.
        Returns (row, first token, its log-probs); row None when max_tokens == 0."""
        spec, model = self.spec, self.spec.model
        n_trunk = len(model.is_linear)
        y, y_safe, logprobs, g, key, h_last = prefill(spec, prompt_cache, prompt,
                                                      prefill_step_size, progress, key)
        mx.eval(y, logprobs)
        progress(prompt.size, prompt.size)
        first = y.item()
        if self.vocab is not None:
            _check_sampled([first], self.vocab)
        if max_tokens == 0:  # mlx_lm then leaves the prompt alone in the cache
            if keep_cache:
                _leave_prompt_only(spec, prompt_cache, h_last)
            return None, first, logprobs[0, -1]
        lens = Lengths(_trunk_length(prompt_cache, model),
                       head_caches(prompt_cache, n_trunk)[0].offset if spec.use_head else 0)
        # the decoding form; the prompt cache's objects let go of the buffers,
        # so the cycles update them in place
        state = DecodeState(MTPCache.from_prompt_cache(prompt_cache, n_trunk, spec.use_head),
                            y_safe.astype(mx.int32), mx.ones((1,), mx.int32), g, key)
        _detach(prompt_cache, n_trunk, spec.use_head)
        if spec.ring:
            state = init_ring(spec, state)
        row = Row(prompt_cache, keep_cache, max_tokens, stats, lens)
        row.last = (state.without_buffers() if keep_cache else None, 0, lens, first, [])
        if spec.processors:
            row.history = mx.concatenate([prompt, y_safe])
        if spec.drafter is not None and spec.drafter.host_side:
            row.generated = [first]
        if self.state is None:
            self.state = state
        else:
            if self.ring:  # every row's ring empty, so they stay in step
                self._flush()
                # the rows' lengths count the flush once the cycles before it land
                if self.inflight:
                    self.inflight[-1].flush_after = True
                else:
                    for r in self.rows:
                        r.lens = r.lens.flushed()
            self.state = DecodeState.concat(self.state, state)
        self.rows.append(row)
        self._tic = time.perf_counter()  # the next cost sample starts here, not in the prefill
        return row, first, logprobs[0, -1]

    def finish(self, row: Row):
        """The row leaves: its prompt cache gets the state at its finishing
        point (the tokens the caller used), then it is removed from the batch."""
        if row.done:
            return
        row.done = True
        index = self.rows.index(row)
        if row.keep_cache:
            before, i, lens, y, tokens = row.last
            state = before.take_rows([i])
            state = state.replace(cache=state.cache.with_buffers_of(
                self.state.cache.take_rows(mx.array([index], dtype=mx.int32))))
            _finish(self.spec, row.prompt_cache, state, lens, [y] + tokens[:row.used])
        self.rows.pop(index)
        keep = [i for i in range(len(self.rows) + 1) if i != index]
        self.state = self.state.take_rows(keep) if self.rows else None
        if not self.rows:
            self.inflight.clear()
            self.ring = 0

    # -- cycles ------------------------------------------------------------------------------
    def _flush(self):
        self.state = self.graphs.flush(self.state)
        self.ring = 0

    def _controller(self):
        if self.depth != "auto":
            return None
        if self.controller is not None:
            return self.controller
        return controller_for(self.spec, self.max_depth, len(self.rows))

    def _in_flight(self, row: Row) -> List[Launched]:
        return [c for c in self.inflight if row in c.rows]

    def _needs_more(self, row: Row) -> bool:
        """Each cycle emits at least one token for each of its rows."""
        return row.max_tokens < 0 or row.landed + len(self._in_flight(row)) < row.max_tokens

    def _launch(self):
        spec, ctl = self.spec, self._controller()
        k = ctl.next_depth() if ctl is not None else self.depth
        # the head catches up before it drafts, or when the ring is full
        flushed = self.ring > 0 and (k > 0 or self.ring == RING)
        if flushed:
            self._flush()
        bounds = [_upper_bound(r.lens, self._in_flight(r), spec.ring) for r in self.rows]
        self.state = self.state.replace(cache=self.state.cache.grown(
            max(b.trunk for b in bounds) + k + 1,
            max(b.head for b in bounds) + max(k + 1, RING if spec.ring else 0)))
        history = None
        if spec.processors:  # one row (its tokens are on the host)
            history = self.rows[0].history[:-1]
        if spec.drafter is not None and spec.drafter.host_side:
            spec.drafter.generated = self.rows[0].generated
        keep = any(r.keep_cache for r in self.rows)
        before, traces = self.state.without_buffers() if keep else None, self.graphs.traces
        t0 = time.perf_counter()
        self.state, out = self.graphs.step(self.state, k, history)
        built = time.perf_counter()
        mx.async_eval(out.packed, out.logprobs, _arrays(self.state))
        t1 = time.perf_counter()
        self.inflight.append(Launched(k, out, before, flushed, self.graphs.traces > traces,
                                      list(self.rows), dict(build0=t0, build1=built, queued=t1)))
        if k == 0 and spec.ring:
            self.ring += 1

    def step(self) -> List[Tuple[Row, List[int], mx.array, int]]:
        """Queue cycles up to the lookahead, read the oldest one: per row still
        in the batch, (row, its tokens, their log-prob rows, drafts accepted)."""
        while self.rows and len(self.inflight) <= self.lookahead and any(
                self._needs_more(r) for r in self.rows):
            self._launch()
        if not self.inflight:
            return []
        cycle = self.inflight.popleft()
        wait0 = time.perf_counter()
        values = cycle.out.packed.tolist()
        toc = time.perf_counter()
        k, out, spec, accepted = cycle.k, [], self.spec, []
        ctl = self._controller()
        for i, row in enumerate(cycle.rows):
            if row.done:
                continue
            a = values[i][0]
            tokens = values[i][1 : a + 2]
            if self.vocab is not None:
                _check_sampled(tokens, self.vocab)
            before_lens = row.lens.flushed() if cycle.flushed else row.lens
            row.lens = before_lens.after(k, a, spec.ring)
            if cycle.flush_after:
                row.lens = row.lens.flushed()
            y = (row.last[4] or [row.last[3]])[-1]
            row.last, row.used = (cycle.before, i, before_lens, y, tokens), 0
            row.landed += len(tokens)
            row.stats.record(k, a)
            accepted.append(a)
            if row.history is not None:
                row.history = mx.concatenate([row.history, mx.array(tokens, row.history.dtype)])
            if row.generated is not None:
                row.generated.extend(tokens)
            out.append((row, tokens, cycle.out.logprobs[i], a))
        if ctl is not None and accepted:
            ctl.update_acceptance(k, accepted)
            # the cost sample goes to the cycle the host waited on: on MLX's CPU
            # backend async_eval itself runs most queued work (at most ~10 tasks
            # in flight), so there it is the one just launched
            launched = self.inflight[-1] if self.inflight else cycle
            t0, t1 = launched.stamps["build0"], launched.stamps["queued"]
            waited_on = launched if self.lookahead and t1 - t0 > toc - t1 else cycle
            if spec.group is not None:  # which depth gets the sample must not differ by rank
                waited_on = cycle
            if not (cycle.traced or launched.traced):
                ctl.update_cost(waited_on.k, toc - self._tic)
        self._tic = toc
        if self.timeline is not None:
            stamps = (self.inflight[-1] if self.inflight else cycle).stamps
            self.timeline.append(dict(stamps, wait0=wait0, wait1=toc,
                                      land1=time.perf_counter(), k=k,
                                      accepted=values[0][0] if values else 0))
        self.cycles += 1
        if self.cycles % 128 == 0:
            mx.clear_cache()
        return out


def controller_for(spec: Spec, max_depth: int, batch_size: int) -> DepthController:
    """The adaptive controller for this model, mode and batch size (a verify
    costs more at a larger batch, so each size learns its own depth; sizes
    share a controller within powers of two). Kept on the model across calls."""
    bucket = 1 << max(0, batch_size - 1).bit_length()
    key = (max_depth, spec.speculative,
           None if spec.draft_vocab is None else spec.draft_vocab.size, bucket)
    ctl = spec.model.runtime.controllers.get(key)
    if ctl is None:
        # sharded: every rank switches depth when rank 0 does (timings differ by rank)
        agreed = None if spec.group is None else (lambda v: agree(v, spec.group))
        ctl = spec.model.runtime.controllers[key] = DepthController(max_depth=max_depth,
                                                                    agree=agreed)
    return ctl


def _arrays(state: DecodeState) -> list:
    return [x for _, x in tree_flatten(state.tree()) if x is not None]


def _trunk_length(prompt_cache: list, model) -> int:
    # (sharded_load refuses a pipeline stage without an attention layer)
    return next(c.offset for c, lin in zip(prompt_cache, model.is_linear) if not lin)


def _check_sampled(tokens: List[int], vocab: int):
    for t in tokens:
        if not 0 <= t < vocab:
            raise ValueError(f"the sampler returned token id {t}, outside the vocabulary "
                             f"(0..{vocab - 1})")


def _upper_bound(lens: Lengths, inflight, ring: bool) -> Lengths:
    """Lengths after the launched cycles if each accepted every draft."""
    for c in inflight:
        lens = (lens.flushed() if c.flushed else lens).after(c.k, c.k, ring)
        if c.flush_after:
            lens = lens.flushed()
    return lens


def _detach(prompt_cache: list, n_trunk: int, use_head: bool):
    """Empty the prompt cache's objects while the decoding form owns their
    arrays (a buffer referenced twice would be copied by every write)."""
    for c in prompt_cache[:n_trunk] + (head_caches(prompt_cache, n_trunk) if use_head else []):
        if isinstance(c, KVCache):
            c.keys = c.values = None
            c.offset = 0
        else:
            c.cache = [None] * len(c.cache)


def _leave_prompt_only(spec: Spec, prompt_cache: list, h_last: mx.array):
    """max_tokens=0: the head drops the pair with the unused first token."""
    n_trunk = len(spec.model.is_linear)
    if spec.use_head:
        for c in head_caches(prompt_cache, n_trunk):
            c.trim(1)
        set_last_hidden(prompt_cache, h_last, spec.model.is_linear)
    elif len(prompt_cache) > n_trunk:
        set_last_hidden(prompt_cache, None, spec.model.is_linear)  # the head did not follow
    mx.eval([c.state for c in prompt_cache])


def _finish(spec: Spec, prompt_cache: list, state: DecodeState, lens: Lengths, tail: List[int]):
    """Write a row's state at its finishing point back into its prompt cache,
    and feed the tokens it had emitted up to there (the last one used included)."""
    n_trunk = len(spec.model.is_linear)
    state.cache.write_back(prompt_cache, n_trunk, lens.trunk, lens.head)
    ring = (state.ring_h, state.ring_tok, lens.ring) if spec.ring else None
    feed(spec, prompt_cache, tail, ring)
    mx.eval([c.state for c in prompt_cache])
