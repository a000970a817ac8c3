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
    before: DecodeState  # the state it started from, without KV buffers
    flushed: bool  # the ring was flushed right before it
    traced: bool  # its launch traced a graph (slow: not a cost sample)


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
    if not hasattr(model, "make_cache") or not hasattr(model, "has_mtp"):
        raise TypeError("model must come from mlx_mtp.load")
    ids = checks.token_ids("prompt", prompt, model.vocab_size)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    prompt = mx.array(ids, dtype=mx.int32)
    max_tokens = checks.max_tokens(max_tokens)
    depth = checks.depth(draft_tokens)
    checks.integer("max_draft_tokens", max_draft_tokens, 1, checks.MAX_DEPTH)
    checks.integer("prefill_step_size", prefill_step_size, lo=1)
    if seed is not None:
        checks.integer("seed", seed)
    if mtp_disabled_by_env():
        depth = 0
    auto = depth == "auto"
    use_head = model.has_mtp and depth != 0
    if not use_head:
        depth, controller = 0, None
    elif not auto:
        controller = None
    elif controller is None:  # the model keeps the measurements across calls
        key = (max_draft_tokens, isinstance(sampler, MTPSampler) and sampler.speculative,
               None if draft_vocab is None else draft_vocab.size)
        controller = model.runtime.controllers.get(key)
        if controller is None:
            controller = model.runtime.controllers[key] = DepthController(max_depth=max_draft_tokens)
    if use_head and not is_greedy(sampler) and not isinstance(sampler, MTPSampler):
        import warnings

        warnings.warn("mlx_mtp: this sampler cannot be introspected, so drafts are verified by "
                      "exact match (still exact, fewer accepted); build it with "
                      "mlx_mtp.make_sampler for Leviathan-Chen acceptance", stacklevel=3)
    spec = Spec(model, sampler, use_head=use_head, ring=auto and use_head,
                processors=tuple(logits_processors or ()),
                draft_vocab=draft_vocab if use_head else None,
                drafter=drafter if use_head else None)
    if drafter is not None and drafter.host_side and not spec.speculative:
        raise ValueError("a host-side drafter needs an MTPSampler with temp > 0")
    host_history = bool(spec.processors) or (spec.drafter is not None and spec.drafter.host_side)
    # a sampler of our own or greedy cannot leave the vocabulary; any other's
    # tokens are checked on the host before the next cycle reads them
    trusted = is_greedy(sampler) or isinstance(sampler, MTPSampler)
    lookahead = 1 if pipeline and not host_history and trusted else 0
    graphs = Graphs(spec, compiled)
    stats = stats if stats is not None else MTPStats()

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
    checks.prompt_length(cache_length(prompt_cache, model.is_linear) + len(ids), context, id(model))
    key = None
    if spec.speculative:
        key = (mx.random.key(mix_seed(seed)) if seed is not None
               else mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32))
    progress = prompt_progress_callback or (lambda *_: None)
    token = object()
    vocab = None if trusted else model.vocab_size
    gen = _generate(spec, graphs, prompt, prompt_cache, keep_cache, token, key, max_tokens,
                    depth, controller, lookahead, stats, prefill_step_size, progress, timeline,
                    vocab)
    if keep_cache:
        _OWNERS[id(prompt_cache)] = (token, weakref.ref(gen))
    return gen


# id(prompt cache) -> (token, the generator using it): the cache's objects are
# empty while a generation owns them (see _detach)
_OWNERS: dict = {}


def _generate(spec: Spec, graphs: Graphs, prompt, prompt_cache, keep_cache, token, key,
              max_tokens, depth, controller, lookahead, stats, prefill_step_size, progress,
              timeline, vocab):
    model, use_head = spec.model, spec.use_head
    n_trunk = len(model.is_linear)
    with mx.stream(generation_stream):
        y, y_safe, logprobs, g, key, h_last = prefill(spec, prompt_cache, prompt,
                                                      prefill_step_size, progress, key)
        mx.eval(y, logprobs)
        progress(prompt.size, prompt.size)
        first = y.item()
        if vocab is not None:
            _check_sampled([first], vocab)
        lens = Lengths(_trunk_length(prompt_cache, model),
                       head_caches(prompt_cache, n_trunk)[0].offset if use_head else 0)
        if max_tokens == 0:  # mlx_lm then leaves the prompt alone in the cache
            if keep_cache:
                _leave_prompt_only(spec, prompt_cache, h_last)
            return
        # the decoding form; the prompt cache's objects let go of the buffers,
        # so the cycles update them in place
        state = DecodeState(MTPCache.from_prompt_cache(prompt_cache, n_trunk, use_head),
                            y_safe.astype(mx.int32), mx.ones((1,), mx.int32), g, key)
        _detach(prompt_cache, n_trunk, use_head)
        if spec.ring:
            state = init_ring(spec, state)
        history = (mx.concatenate([prompt, y_safe]) if spec.processors else None)
        generated = [first]
        # finishing point: (state before the cycle, its lengths, tokens it emitted up to
        # here); the states are kept only when a prompt cache is written back
        without_buffers = DecodeState.without_buffers if keep_cache else (lambda s: None)
        stop = (without_buffers(state), lens, first, [])
        bound = Lengths(lens.trunk, lens.head)  # upper bounds over launched cycles
        inflight: deque = deque()
        n = 1
        try:
            yield first, logprobs[0, -1], False
            tic = time.perf_counter()
            while max_tokens < 0 or n < max_tokens:
                # launch until `lookahead` cycles wait behind the one to read; each
                # launched cycle emits at least one token
                while len(inflight) <= lookahead and (
                        max_tokens < 0 or n + len(inflight) < max_tokens):
                    k = controller.next_depth() if controller is not None else depth
                    # the head catches up before it drafts, or when the ring is full
                    flushed = bound.ring > 0 and (k > 0 or bound.ring == RING)
                    if flushed:
                        state = graphs.flush(state)
                        bound = bound.flushed()
                    state = state.replace(cache=state.cache.grown(
                        bound.trunk + k + 1, bound.head + max(k + 1, RING if spec.ring else 0)))
                    if spec.drafter is not None and spec.drafter.host_side:
                        spec.drafter.generated = generated
                    before, traces = without_buffers(state), graphs.traces
                    t0 = time.perf_counter()
                    state, out = graphs.step(state, k, history[:-1] if history is not None else None)
                    built = time.perf_counter()
                    mx.async_eval(out.packed, out.logprobs, _arrays(state))
                    t1 = time.perf_counter()
                    stamps = dict(build0=t0, build1=built, queued=t1)
                    inflight.append(Launched(k, out, before, flushed, graphs.traces > traces))
                    bound = bound.after(k, k, spec.ring)
                cycle = inflight.popleft()
                wait0 = time.perf_counter()
                values = cycle.out.packed.tolist()[0]
                toc = time.perf_counter()
                k, a = cycle.k, values[0]
                tokens = values[1 : a + 2]
                if vocab is not None:
                    _check_sampled(tokens, vocab)
                before_lens = lens.flushed() if cycle.flushed else lens
                lens = before_lens.after(k, a, spec.ring)
                bound = _upper_bound(lens, inflight, spec.ring)
                stats.record(k, a)
                if controller is not None:
                    controller.update_acceptance(k, a)
                    # the cost sample goes to the cycle the host waited on: on MLX's CPU
                    # backend async_eval itself runs most queued work (at most ~10 tasks
                    # in flight), so there it is the one just launched
                    launched = inflight[-1] if inflight else cycle
                    waited_on = launched if lookahead and t1 - t0 > toc - t1 else cycle
                    if not (cycle.traced or launched.traced):
                        controller.update_cost(waited_on.k, toc - tic)
                tic = toc
                if history is not None:
                    history = mx.concatenate([history, mx.array(tokens, dtype=history.dtype)])
                generated.extend(tokens)
                rows = cycle.out.logprobs[0]
                last = stop[2] if not stop[3] else stop[3][-1]
                if timeline is not None:
                    record = dict(stamps, wait0=wait0, wait1=toc, land1=time.perf_counter(),
                                  k=k, accepted=a)
                    timeline.append(record)
                for i, t in enumerate(tokens):
                    stop = (cycle.before, before_lens, last, tokens[: i + 1])
                    yield t, rows[i], i < a
                    n += 1
                    if n == max_tokens:
                        return
                if timeline is not None:
                    record["yield"] = time.perf_counter()
                if n % 256 < len(tokens):
                    mx.clear_cache()
        finally:
            if keep_cache:
                try:
                    _finish(spec, prompt_cache, stop, state)
                finally:
                    if _OWNERS.get(id(prompt_cache), (None,))[0] is token:
                        del _OWNERS[id(prompt_cache)]


def _arrays(state: DecodeState) -> list:
    return [x for _, x in tree_flatten(state.tree()) if x is not None]


def _trunk_length(prompt_cache: list, model) -> int:
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


def _finish(spec: Spec, prompt_cache: list, stop, latest: DecodeState):
    """Write the state at the finishing point back into the prompt cache, and
    feed what it had emitted up to there (the last token yielded included)."""
    before, lens, y, extra = stop
    state = before.replace(cache=before.cache.with_buffers_of(latest.cache))
    n_trunk = len(spec.model.is_linear)
    state.cache.write_back(prompt_cache, n_trunk, lens.trunk, lens.head)
    ring = (state.ring_h, state.ring_tok, lens.ring) if spec.ring else None
    with mx.stream(generation_stream):
        feed(spec, prompt_cache, [y] + list(extra), ring)
        mx.eval([c.state for c in prompt_cache])
