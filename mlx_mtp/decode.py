"""Decoding requests on a batch: one row (`generate_events`,
`generate_tokens`) or many with continuous batching (`decode_rows`: rows
join as others finish), handing out the events of `Batch.step` (batch.py,
where the cycles run: queued ahead, read, turned into events).

The prompt cache (mlx_lm's objects) is turned into the decoding form after
the prompt and written back when the generator finishes, however it
finishes (max_tokens, a stop token, the caller stopping, close()): it then
holds exactly what mlx_lm's would — the prompt and every token yielded, the
last one included, and nothing drafted or rejected (rows.py).
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Callable, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .batch import Batch, Event, make_batch
from .mlx_lm_compat import generation_stream
from .params import DecodeOptions
from .held_cache import HeldCache
from .rows import Request
from .stats import MTPStats


def generate_events(
    prompt: mx.array,
    model,
    options: Optional[DecodeOptions] = None,
    *,
    max_tokens: int = 256,
    sampler: Optional[Callable] = None,
    logits_processors: Optional[list] = None,
    prompt_cache: Optional[list] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    seed: Optional[int] = None,
    stats: Optional[MTPStats] = None,
    stop_tokens: Sequence[int] = (),
    constraint=None,
    tokenizer=None,
    media=None,
    **fields,
) -> Generator[Event, None, None]:
    """One row's events (batch.Event), ending with the first of `stop_tokens`
    or the max_tokens-th token, decoded with `options` (DecodeOptions; any
    of its fields also as keywords), under `constraint`'s grammar if given
    (with its tokenizer), `media`: the prompt's images (vision.prompt_media).
    See `mlx_mtp.generate_step` for the rest."""
    batch = make_batch(model, DecodeOptions.of(options, **fields), sampler=sampler,
                       logits_processors=logits_processors)
    request = batch.prepare(prompt, prompt_cache, max_tokens, seed,
                            stats=stats if stats is not None else MTPStats(),
                            progress=prompt_progress_callback, stop_tokens=stop_tokens,
                            constraint=constraint, tokenizer=tokenizer, media=media)
    owner = object()
    gen = _generate(batch, request, owner)
    if request.keep_cache:
        HeldCache.claim(request.prompt_cache, owner, gen)
    return gen


def generate_tokens(prompt: mx.array, model, options: Optional[DecodeOptions] = None, **kwargs
                    ) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft) like mlx_lm's
    speculative_generate_step (`generate_events`' arguments)."""
    for event in generate_events(prompt, model, options, **kwargs):
        yield event.token, event.logprobs, event.from_draft


def _generate(batch: Batch, request: Request, owner):
    """One row: yield its events as its cycles are read;
    when the caller stops (max_tokens, a stop token, close) the row's prompt
    cache is written back (by `decode_rows`)."""
    finalizing = sys.is_finalizing  # (bound here: `sys` is None once modules are torn down)
    try:
        for _, event in decode_rows(batch, [request], 1):
            if event is None:  # max_tokens 0
                return
            yield event
    finally:
        if request.keep_cache and not finalizing():
            HeldCache.release(request.prompt_cache, owner)


def decode_rows(batch: Batch, requests: List[Request], width: int = 32):
    """Continuous batching: up to `width` requests decode together, the next
    joining as one finishes (those waiting join together, their prompts
    prefilled in one batch). Yields (request index, event); a request with
    max_tokens 0 yields (index, None). A row still decoding when the caller
    stops is finished with the tokens yielded so far."""
    pending = deque(enumerate(requests))
    active: dict = {}  # Row -> request index
    # A generator left open until the interpreter exits is closed after its
    # modules are torn down (their names None): nothing is left to write back
    # then, so its cleanup is skipped rather than failing ("Exception ignored").
    finalizing = sys.is_finalizing
    with mx.stream(generation_stream):
        try:
            while pending or active:
                joining = []
                while pending and len(active) + len(joining) < width:
                    joining.append(pending.popleft())
                if joining:
                    rows = batch.add([r for _, r in joining])
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
            for row in list(active) if not finalizing() else ():
                if not row.done:
                    batch.finish(row)
