"""The decode loop: one row (`generate_tokens`) or many with continuous
batching (`decode_rows`), routing the events of `Batch.step` (batch.py).

The prompt cache (mlx_lm's objects) is turned into the decoding form after
the prompt and written back when the generator finishes, however it
finishes (max_tokens, a stop token, the caller stopping, close()): it then
holds exactly what mlx_lm's would — the prompt and every token yielded, the
last one included, and nothing drafted or rejected (rows.py).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Generator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .batch import Batch, Event, MTPStats, make_batch
from .depth import DepthController
from .mlx_lm_compat import generation_stream
from .rows import HeldCache, Request


def generate_events(
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
    lookahead: bool = True,
    compiled: bool = True,
    draft_vocab: Optional[mx.array] = None,
    stats: Optional[MTPStats] = None,
    drafter=None,
    controller: Optional[DepthController] = None,
    timeline: Optional[list] = None,
    stop_tokens: Sequence[int] = (),
) -> Generator[Event, None, None]:
    """One row's events (batch.Event), ending with the first of `stop_tokens`
    or the max_tokens-th token. See `mlx_mtp.generate_step` for the
    arguments; drafter, controller and timeline are for tests and benchmarks
    (timeline: a list that gets, per cycle read, the perf_counter stamps of
    the loop's host work)."""
    batch = make_batch(model, draft_tokens=draft_tokens, max_draft_tokens=max_draft_tokens,
                       sampler=sampler, logits_processors=logits_processors,
                       lookahead=lookahead, compiled=compiled,
                       draft_vocab=draft_vocab, drafter=drafter, controller=controller,
                       timeline=timeline)
    request = batch.prepare(prompt, prompt_cache, max_tokens, seed, prefill_step_size,
                            stats=stats if stats is not None else MTPStats(),
                            progress=prompt_progress_callback, stop_tokens=stop_tokens)
    owner = object()
    gen = _generate(batch, request, prefill_step_size, owner)
    if request.keep_cache:
        HeldCache.hold(request.prompt_cache, owner, gen)
    return gen


def generate_tokens(prompt: mx.array, model, **options
                    ) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft) like mlx_lm's
    speculative_generate_step (`generate_events`' options)."""
    for event in generate_events(prompt, model, **options):
        yield event.token, event.logprobs, event.from_draft


def _generate(batch: Batch, request: Request, prefill_step_size, owner):
    """One row: yield its events as its cycles are read;
    when the caller stops (max_tokens, a stop token, close) the row's prompt
    cache is written back (by `decode_rows`)."""
    try:
        for _, event in decode_rows(batch, [request], 1, prefill_step_size):
            if event is None:  # max_tokens 0
                return
            yield event
    finally:
        if request.keep_cache:
            HeldCache.release(request.prompt_cache, owner)


def decode_rows(batch: Batch, requests: List[Request], width: int = 32,
                prefill_step_size: int = 2048):
    """Continuous batching: up to `width` requests decode together, the next
    joining as one finishes (those waiting join together, their prompts
    prefilled in one batch). Yields (request index, event); a request with
    max_tokens 0 yields (index, None). A row still decoding when the caller
    stops is finished with the tokens yielded so far."""
    pending = deque(enumerate(requests))
    active: dict = {}  # Row -> request index
    with mx.stream(generation_stream):
        try:
            while pending or active:
                joining = []
                while pending and len(active) + len(joining) < width:
                    joining.append(pending.popleft())
                if joining:
                    rows = batch.add([r for _, r in joining], prefill_step_size)
                    for (i, _), row in zip(joining, rows):
                        if row is None:
                            yield i, None
                        else:
                            active[row] = i
                for event in batch.step():
                    if event.finish is not None:
                        i = active.pop(event.row)
                    else:
                        i = active[event.row]
                    yield i, event
        finally:
            for row in list(active):
                if not row.done:
                    batch.finish(row)
