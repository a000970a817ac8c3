"""Drop-in replacements for mlx_lm's generate_step / generate /
stream_generate / batch_generate (the CLI is `mlx_mtp/generate.py`)."""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import BatchResponse, BatchStats, GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import checks, params
from .params import DecodeOptions
from .batch import make_batch
from .stats import MTPStats
from .decode import decode_rows, generate_events
from .mlx_lm_compat import generation_stream, wired_limit
from .sampling import RowSampling

@dataclass
class MTPGenerationResponse(GenerationResponse):
    """mlx_lm's GenerationResponse plus MTP statistics (cumulative so far)."""

    drafted: int = 0
    accepted: int = 0
    acceptance: List[float] = field(default_factory=list)
    tokens_per_cycle: float = 0.0
    draft_tokens: Union[int, str] = 0
    forced: int = 0  # drafts a grammar forced
    jumps: int = 0  # cycles that verified a forced run alone


def _wrapped(tokenizer) -> TokenizerWrapper:
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def _encode(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    checks.prompt(prompt)
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt)


def _with_images(model, prompt: mx.array, images, prompt_cache=None, name: str = "images"
                 ) -> Tuple[mx.array, object]:
    """The prompt with its images' pads expanded, and their rows.Media (None
    without images). The vision stage (the [vision] extra) loads only here."""
    if images is None:
        return prompt, None
    if not isinstance(images, (list, tuple)):  # (a str would be read as its characters)
        raise TypeError(f"{name} must be a list of images, one per image placeholder in the "
                        f"prompt (e.g. {name}=['photo.png']), not a {type(images).__name__}")
    if not images:
        return prompt, None
    if prompt_cache is not None:  # (its earlier images' positions are not known here)
        raise ValueError("images with a prompt cache are not supported yet: give the whole "
                         "conversation, without prompt_cache")
    from .vision import decode_image, prompt_media, tower_of

    limit = tower_of(model).max_input_pixels  # (a model without images says so first)
    decoded = [decode_image(_read(im, i), limit, _image_source(im, i))
               for i, im in enumerate(images)]
    ids, media = prompt_media(model, prompt.tolist(), decoded)
    return mx.array(ids), media


def _image_source(image, i: int) -> str:
    """How messages name image i: "image 1 (photo.png)", "image 2 (bytes)"."""
    what = image if isinstance(image, (str, Path)) else \
        "bytes" if isinstance(image, (bytes, bytearray, memoryview)) else type(image).__name__
    return f"image {i + 1} ({what})"


def _read(image, i: int = 0):
    """An image given as a file path: its bytes (a caller's own files; the
    server never takes paths)."""
    if not isinstance(image, (str, Path)):
        return image
    try:
        return Path(image).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {_image_source(image, i)}: {e.strerror or e}") from None


def _check_options(kwargs: dict) -> dict:
    """mlx_lm's generate_step options: refuse what mlx_mtp cannot do, map
    num_draft_tokens (mlx_lm's name) to draft_tokens, drop no-op defaults."""
    for name, what in params.UNSUPPORTED.items():
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"mlx_mtp does not support {name} ({what})")
    for name in ("kv_group_size", "quantized_kv_start"):  # only meaningful with kv_bits
        kwargs.pop(name, None)
    depth = kwargs.get("draft_tokens", DecodeOptions.draft_tokens)
    kwargs["draft_tokens"] = checks.one_depth(depth, kwargs.pop("num_draft_tokens", None))
    if "logits_processors" in kwargs:
        checks.logits_processors(kwargs["logits_processors"])
    return kwargs


def _lookahead(lookahead: bool, pipeline: Optional[bool]) -> bool:
    """`pipeline=` is lookahead's old name (it also meant pipeline parallelism)."""
    if pipeline is None:
        return lookahead
    import warnings

    warnings.warn("mlx_mtp: generate_step(pipeline=) is deprecated; use lookahead=",
                  DeprecationWarning, stacklevel=3)
    return pipeline


def generate_step(
    prompt: mx.array,
    model,
    *,
    max_tokens: int = 256,
    sampler=None,
    logits_processors=None,
    prompt_cache: Optional[list] = None,
    prefill_step_size: int = DecodeOptions.prefill_step_size,
    prompt_progress_callback=None,
    draft_tokens: Union[int, str] = DecodeOptions.draft_tokens,
    num_draft_tokens: Optional[int] = None,
    max_draft_tokens: int = DecodeOptions.max_draft_tokens,
    seed: Optional[int] = None,
    lookahead: bool = True,
    compiled: bool = True,
    draft_vocab: Optional[mx.array] = None,
    context_drafts: bool = DecodeOptions.context_drafts,
    stats: Optional[MTPStats] = None,
    max_kv_size: Optional[int] = None,
    kv_bits: Optional[int] = None,
    input_embeddings: Optional[mx.array] = None,
    pipeline: Optional[bool] = None,
    constraint=None,
    tokenizer=None,
    images=None,
) -> Generator[Tuple[int, mx.array], None, None]:
    """mlx_lm's `generate_step` with MTP: yields (token, logprobs), at most
    `max_tokens` of them (-1: no limit), exactly the tokens mlx_lm would give.

    prompt_cache: from `mlx_lm.models.cache.make_prompt_cache(model)` (or
        `model.make_cache()`); updated in place, as in mlx_lm: afterwards it
        holds the prompt and every token yielded, so the next call only
        prefills its new prompt. A trunk-only cache (mlx_lm's) is accepted.
    sampler: `mlx_mtp.make_sampler(...)` samples exactly with Leviathan–Chen
        acceptance; None is greedy; any other callable is still exact but
        accepts fewer drafts (verified by match).
    draft_tokens: depth k, or "auto" (per cycle from measured acceptance and
        cost, 0 included, up to max_draft_tokens); 0 decodes plainly.
        num_draft_tokens is mlx_lm's name for it.
    seed: the sampling key (None: drawn from mx.random, so mx.random.seed works).
    logits_processors: mlx_lm's, run on the host with the token history
        (the loop then reads each cycle before queuing the next); those of
        `mlx_mtp.make_logits_processors(...)` (logit bias, penalties) run
        in the compiled cycle instead.
    lookahead: queue cycle n+1 before reading cycle n (host logits
        processors turn it off; `pipeline=` is its old, deprecated name).
    compiled: one compiled graph per depth, kept across calls.
    draft_vocab: draft over these token ids only (see mlx_mtp.draft_vocab).
    context_drafts: where the last tokens occurred before in the prompt or
        the answer, draft what followed them there (up to 16 tokens a cycle)
        in place of the head's drafts: a copied span at copy speed, still
        exactly plain decoding's output (docs/design.md, "Context drafts").
    stats: an MTPStats to fill (drafted, accepted, acceptance per position).
    constraint: `mlx_mtp.constrain(...)`: every token is one the grammar
        allows (needs `tokenizer`); the generation then ends after the
        tokenizer's EOS, as the grammar's end.
    images: the prompt's images (paths' bytes, PIL images, H x W x 3 uint8
        arrays), one per image placeholder in the prompt, in order (a
        Qwen3.5/3.6 or qwen4_exp folder with its vision tower; the [vision]
        extra; no prompt_cache yet). docs/design.md, "Images";
        docs/qwen4_exp.md, "Images".
    """
    checks.prompt(prompt, text=False)
    prompt, media = _with_images(model, prompt, images, prompt_cache)
    checks.logits_processors(logits_processors)
    kwargs = _check_options(dict(max_kv_size=max_kv_size, kv_bits=kv_bits,
                                 input_embeddings=input_embeddings,
                                 draft_tokens=draft_tokens, num_draft_tokens=num_draft_tokens))
    options = DecodeOptions(draft_tokens=kwargs.pop("draft_tokens"),
                            max_draft_tokens=max_draft_tokens, prefill_step_size=prefill_step_size,
                            lookahead=_lookahead(lookahead, pipeline), compiled=compiled,
                            draft_vocab=draft_vocab, context_drafts=context_drafts)
    if constraint is not None:  # the row's grammar (Batch.prepare); it ends after EOS
        from .constraint import check

        check(constraint, tokenizer)
        kwargs.update(constraint=constraint, tokenizer=_wrapped(tokenizer),
                      stop_tokens=_wrapped(tokenizer).eos_token_ids)
    for event in generate_events(
            prompt, model, options, max_tokens=max_tokens, sampler=sampler,
            logits_processors=logits_processors, prompt_cache=prompt_cache,
            prompt_progress_callback=prompt_progress_callback, seed=seed, stats=stats,
            media=media, **kwargs):
        yield event.token, event.logprobs


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    draft_tokens: Union[int, str] = DecodeOptions.draft_tokens,
    **kwargs,
) -> Generator[MTPGenerationResponse, None, None]:
    """Like mlx_lm.stream_generate, decoding with the model's MTP head.

    kwargs: `generate_step`'s options (sampler, logits_processors,
    prompt_cache, prefill_step_size, prompt_progress_callback, seed,
    constraint, images, ...).
    """
    checks.tokenizer(tokenizer)
    checks.check("max_tokens", max_tokens)  # (0, the prefill only, is generate_step's)
    kwargs = _check_options(dict(kwargs, draft_tokens=draft_tokens))
    draft_tokens = checks.depth(kwargs["draft_tokens"])
    kwargs.pop("stream", None)
    tokenizer = _wrapped(tokenizer)
    if kwargs.get("constraint") is not None:
        kwargs["tokenizer"] = tokenizer
    prompt, media = _with_images(model, _encode(tokenizer, prompt), kwargs.pop("images", None),
                                 kwargs.get("prompt_cache"))
    detokenizer = tokenizer.detokenizer
    stats = kwargs.pop("stats", None) or MTPStats()
    if "pipeline" in kwargs:
        kwargs["lookahead"] = _lookahead(kwargs.pop("lookahead", True), kwargs.pop("pipeline"))
    options, kwargs = DecodeOptions.split(kwargs)
    gen = generate_events(prompt, model, options, max_tokens=max_tokens, stats=stats,
                          stop_tokens=tokenizer.eos_token_ids, media=media, **kwargs)

    def response(text, event, n):
        return MTPGenerationResponse(
            text=text, token=event.token, logprobs=event.logprobs, from_draft=event.from_draft,
            prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=event.finish,
            drafted=stats.drafted, accepted=stats.accepted, acceptance=stats.acceptance,
            tokens_per_cycle=stats.tokens_per_cycle, draft_tokens=draft_tokens,
            forced=stats.forced, jumps=stats.jumps,
        )

    finalizing = sys.is_finalizing  # (bound here: see decode.decode_rows)
    try:
        with wired_limit(model, [generation_stream]):
            tic = time.perf_counter()
            n, event = 0, None
            try:
                for n, event in enumerate(gen, start=1):
                    if n == 1:
                        prompt_tps = prompt.size / (time.perf_counter() - tic)
                        tic = time.perf_counter()
                    if event.finish == "stop":  # the stop token is not text (as in mlx_lm)
                        break
                    detokenizer.add_token(event.token)
                    if event.finish is not None:
                        break
                    yield response(detokenizer.last_segment, event, n)
            finally:
                gen.close()  # writes the prompt cache back
            detokenizer.finalize()
            yield response(detokenizer.last_segment, event, n)
    except BaseException:
        # left open until the interpreter exits: closed once modules are torn
        # down, when restoring the wired limit (mlx_lm's) can only fail
        if not finalizing():
            raise


def generate(
    model,
    tokenizer,
    prompt: Union[str, List[int]],
    max_tokens: int = 256,
    draft_tokens: Union[int, str] = DecodeOptions.draft_tokens,
    verbose: bool = False,
    sampler=None,
    logits_processors=None,
    **kwargs,
) -> str:
    """Like mlx_lm.generate; returns the generated text."""
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, draft_tokens=draft_tokens,
        sampler=sampler, logits_processors=logits_processors, **kwargs,
    ):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        print_stats(response, model)
    return text


def batch_generate(
    model,
    tokenizer,
    prompts: List[List[int]],
    prompt_caches: Optional[List[list]] = None,
    max_tokens: Union[int, List[int]] = 128,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    *,
    draft_tokens: Union[int, str] = DecodeOptions.draft_tokens,
    max_draft_tokens: int = DecodeOptions.max_draft_tokens,
    sampler=None,
    logits_processors=None,
    seeds: Optional[List[Optional[int]]] = None,
    completion_batch_size: int = 32,
    prefill_step_size: int = DecodeOptions.prefill_step_size,
    stats: Optional[List[MTPStats]] = None,
    constraint=None,
    images: Optional[List[Optional[list]]] = None,
) -> BatchResponse:
    """Like mlx_lm.batch_generate, decoding with the MTP head: the prompts
    decode together (one trunk forward per cycle; each row accepts its own
    drafts), up to `completion_batch_size` at a time, the next joining as one
    finishes. Every row's tokens are those it gets decoded alone; the stop
    token is left out of the text, as in mlx_lm. prompt_caches are read, not
    updated (as in mlx_lm); return_prompt_caches gives each row's cache after
    it. sampler: one for every prompt or a list, one per prompt (greedy and
    `mlx_mtp.make_sampler` samplers with different settings decode in one
    batch; an opaque sampler must be shared); logits_processors: one list for
    every prompt or a list of lists; seeds: one per prompt for sampling
    (None: drawn from mx.random). stats: a list that gets one MTPStats per
    prompt. constraint: `mlx_mtp.constrain(...)` for every prompt, or a list
    (None for an unconstrained row). images: one list per prompt (None or []
    for a text row; see `generate_step`)."""
    checks.tokenizer(tokenizer)
    for i, prompt in enumerate(prompts):
        checks.prompt(prompt, f"prompts[{i}]", text=False)
    if callable(logits_processors):
        checks.logits_processors(logits_processors)  # (one processor, not a list: refused)
    tokenizer = _wrapped(tokenizer)
    n = len(prompts)
    max_tokens = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    seeds = [None] * n if seeds is None else list(seeds)
    samplers = list(sampler) if isinstance(sampler, (list, tuple)) else [sampler] * n
    processors = (list(logits_processors) if logits_processors and isinstance(
        logits_processors[0], (list, tuple)) else [logits_processors] * n)
    constraints = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * n
    if images is not None and not isinstance(images, (list, tuple)):
        raise TypeError(f"images must be a list with one list of images per prompt (None or "
                        f"[] for a text row), not a {type(images).__name__}")
    images = [None] * n if images is None else list(images)
    for name, values in (("prompt_caches", prompt_caches), ("max_tokens", max_tokens),
                         ("seeds", seeds), ("sampler", samplers),
                         ("logits_processors", processors), ("constraint", constraints),
                         ("images", images)):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    checks.check("completion_batch_size", completion_batch_size)
    opaque = [s for s in samplers if s is not None and RowSampling.of(s) is None]
    if opaque and any(s is not opaque[0] for s in samplers):
        raise ValueError("a sampler other than greedy or mlx_mtp.make_sampler's is shared by "
                         "the whole batch: pass one sampler for every prompt")
    batch = make_batch(model, DecodeOptions(draft_tokens=draft_tokens,
                                            max_draft_tokens=max_draft_tokens,
                                            prefill_step_size=prefill_step_size),
                       sampler=opaque[0] if opaque else None)
    requests = []
    for i, prompt in enumerate(prompts):
        cache = None
        if prompt_caches is not None:  # read, not updated: decode on a copy
            cache = copy.deepcopy(prompt_caches[i])
        elif return_prompt_caches:
            cache = model.make_cache()
        prompt, media = _with_images(model, mx.array(prompt), images[i],
                                     None if prompt_caches is None else prompt_caches[i],
                                     f"images[{i}]")
        request = batch.prepare(prompt, cache, max_tokens[i], seeds[i], media=media,
                                sampler=None if opaque else samplers[i],
                                logits_processors=processors[i],
                                stop_tokens=tokenizer.eos_token_ids,
                                constraint=constraints[i], tokenizer=tokenizer)
        if request.max_tokens == 0:  # (prepare takes 0: the prefill only)
            checks.check("max_tokens", 0, f"max_tokens[{i}]")
        requests.append(request)
    results: List[List[int]] = [[] for _ in range(n)]
    counters = BatchStats(prompt_tokens=sum(len(r.prompt) for r in requests))
    tic = time.perf_counter()
    done = 0
    with wired_limit(model, [generation_stream]):
        for i, event in decode_rows(batch, requests, completion_batch_size):
            if event.finish != "stop":  # the stop token is left out, as in mlx_lm
                results[i].append(event.token)
            if event.finish is not None:
                done += 1
                if verbose:
                    print(f"[batch_generate] Finished processing {done}/{n} ...", end="\r")
    counters.wall_time = time.perf_counter() - tic
    counters.generation_tokens = sum(len(r) for r in results)
    counters.peak_memory = mx.get_peak_memory() / 1e9
    if stats is not None:
        stats.extend(r.stats for r in requests)
    if verbose:
        print(f"[batch_generate] Finished processing {done}/{n}")
        print(f"[batch_generate] Generation: {counters.generation_tokens} tokens in "
              f"{counters.wall_time:.3f} s (prompts included), "
              f"{counters.generation_tokens / max(counters.wall_time, 1e-9):.3f} tokens-per-sec")
        print(f"[batch_generate] Peak memory: {counters.peak_memory:.3f} GB")
    return BatchResponse(
        texts=[tokenizer.decode(r) for r in results], stats=counters,
        caches=[r.prompt_cache for r in requests] if return_prompt_caches else None,
        token_ids=results if return_token_ids else None)


def print_stats(response: MTPGenerationResponse, model=None, file=None):
    file = file or sys.stdout
    if response is None:
        print("No text generated for this prompt", file=file)
        return
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec", file=file)
    print(f"Generation: {response.generation_tokens} tokens, "
          f"{response.generation_tps:.3f} tokens-per-sec", file=file)
    print(f"Peak memory: {response.peak_memory:.3f} GB", file=file)
    if response.drafted or response.jumps:
        acc = ", ".join(f"{a:.0%}" for a in response.acceptance)
        forced = (f"; {response.forced} drafts forced by the grammar, {response.jumps} runs "
                  "verified in one forward" if response.forced else "")
        print(f"MTP: draft depth {response.draft_tokens}, acceptance per position [{acc}], "
              f"{response.tokens_per_cycle:.2f} tokens per cycle "
              f"({response.accepted}/{response.drafted} drafts accepted{forced})", file=file)
    elif model is not None and not getattr(model, "has_mtp", False):
        print("MTP: off (the model has no MTP head)", file=file)
    else:
        print("MTP: off (plain decoding)", file=file)
