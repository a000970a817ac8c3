"""Drop-in replacements for mlx_lm's generate / stream_generate, and the CLI
`python -m mlx_mtp.generate` (mlx_lm.generate's flags plus --draft-tokens;
--draft-model takes a folder holding the MTP head, not a separate model)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Generator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import BatchResponse, BatchStats, GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import checks, params
from .loop import MTPStats, decode_rows, generate_tokens, make_batch
from .mlx_lm_compat import generation_stream, wired_limit
from .sampling import RowSampling

# mlx_lm options that would change what is computed, refused with one line
UNSUPPORTED = {
    "max_kv_size": "a rotating KV cache",
    "kv_bits": "a quantized KV cache",
    "draft_model": "a separate draft model: the MTP head drafts; to draft with a head stored "
                   "in its own folder, load it with mlx_mtp.load(path, draft=FOLDER)",
    "input_embeddings": "input embeddings",
}


@dataclass
class MTPGenerationResponse(GenerationResponse):
    """mlx_lm's GenerationResponse plus MTP statistics (cumulative so far)."""

    drafted: int = 0
    accepted: int = 0
    acceptance: List[float] = field(default_factory=list)
    tokens_per_cycle: float = 0.0
    draft_tokens: Union[int, str] = 0


def _encode(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt)


def _check_options(kwargs: dict) -> dict:
    """mlx_lm's generate_step options: refuse what mlx_mtp cannot do, map
    num_draft_tokens (mlx_lm's name) to draft_tokens, drop no-op defaults."""
    for name, what in UNSUPPORTED.items():
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"mlx_mtp does not support {name} ({what})")
    for name in ("kv_group_size", "quantized_kv_start"):  # only meaningful with kv_bits
        kwargs.pop(name, None)
    if kwargs.get("num_draft_tokens") is not None:
        kwargs["draft_tokens"] = kwargs.pop("num_draft_tokens")
    kwargs.pop("num_draft_tokens", None)
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
    prefill_step_size: int = 2048,
    prompt_progress_callback=None,
    draft_tokens: Union[int, str] = "auto",
    num_draft_tokens: Optional[int] = None,
    max_draft_tokens: int = 4,
    seed: Optional[int] = None,
    lookahead: bool = True,
    compiled: bool = True,
    draft_vocab: Optional[mx.array] = None,
    stats: Optional[MTPStats] = None,
    max_kv_size: Optional[int] = None,
    kv_bits: Optional[int] = None,
    input_embeddings: Optional[mx.array] = None,
    pipeline: Optional[bool] = None,
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
    stats: an MTPStats to fill (drafted, accepted, acceptance per position).
    """
    kwargs = _check_options(dict(max_kv_size=max_kv_size, kv_bits=kv_bits,
                                 input_embeddings=input_embeddings,
                                 draft_tokens=draft_tokens, num_draft_tokens=num_draft_tokens))
    for token, logprobs, _ in generate_tokens(
            prompt, model, max_tokens=max_tokens, sampler=sampler,
            logits_processors=logits_processors, prompt_cache=prompt_cache,
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=prompt_progress_callback, max_draft_tokens=max_draft_tokens,
            seed=seed, lookahead=_lookahead(lookahead, pipeline), compiled=compiled, draft_vocab=draft_vocab,
            stats=stats, **kwargs):
        yield token, logprobs


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    draft_tokens: Union[int, str] = "auto",
    **kwargs,
) -> Generator[MTPGenerationResponse, None, None]:
    """Like mlx_lm.stream_generate, decoding with the model's MTP head.

    kwargs: `generate_step`'s options (sampler, logits_processors,
    prompt_cache, prefill_step_size, prompt_progress_callback, seed, ...).
    """
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    kwargs = _check_options(dict(kwargs, draft_tokens=draft_tokens))
    draft_tokens = checks.depth(kwargs["draft_tokens"])
    kwargs.pop("stream", None)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode(tokenizer, prompt)
    detokenizer = tokenizer.detokenizer
    stats = kwargs.pop("stats", None) or MTPStats()
    gen = generate_tokens(prompt, model, max_tokens=max_tokens, stats=stats, **kwargs)

    def response(text, token, logprobs, from_draft, n, finish):
        return MTPGenerationResponse(
            text=text, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish,
            drafted=stats.drafted, accepted=stats.accepted, acceptance=stats.acceptance,
            tokens_per_cycle=stats.tokens_per_cycle, draft_tokens=draft_tokens,
        )

    with wired_limit(model, [generation_stream]):
        tic = time.perf_counter()
        n = 0
        token, logprobs, from_draft = None, None, False
        try:
            for n, (token, logprobs, from_draft) in enumerate(gen, start=1):
                if n == 1:
                    prompt_tps = prompt.size / (time.perf_counter() - tic)
                    tic = time.perf_counter()
                if token in tokenizer.eos_token_ids:
                    break
                detokenizer.add_token(token)
                if n == max_tokens:
                    break
                yield response(detokenizer.last_segment, token, logprobs, from_draft, n, None)
        finally:
            gen.close()  # writes the prompt cache back
        detokenizer.finalize()
        finish = "stop" if token in tokenizer.eos_token_ids else "length"
        yield response(detokenizer.last_segment, token, logprobs, from_draft, n, finish)


def generate(
    model,
    tokenizer,
    prompt: Union[str, List[int]],
    max_tokens: int = 256,
    draft_tokens: Union[int, str] = "auto",
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
    draft_tokens: Union[int, str] = "auto",
    max_draft_tokens: int = 4,
    sampler=None,
    logits_processors=None,
    seeds: Optional[List[Optional[int]]] = None,
    completion_batch_size: int = 32,
    prefill_step_size: int = 2048,
    stats: Optional[List[MTPStats]] = None,
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
    (None: drawn from mx.random). stats: a list that gets one MTPStats per prompt."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    n = len(prompts)
    max_tokens = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    seeds = [None] * n if seeds is None else list(seeds)
    samplers = list(sampler) if isinstance(sampler, (list, tuple)) else [sampler] * n
    processors = (list(logits_processors) if logits_processors and isinstance(
        logits_processors[0], (list, tuple)) else [logits_processors] * n)
    for name, values in (("prompt_caches", prompt_caches), ("max_tokens", max_tokens),
                         ("seeds", seeds), ("sampler", samplers),
                         ("logits_processors", processors)):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    checks.check("completion_batch_size", completion_batch_size)
    opaque = [s for s in samplers if s is not None and RowSampling.of(s) is None]
    if opaque and any(s is not opaque[0] for s in samplers):
        raise ValueError("a sampler other than greedy or mlx_mtp.make_sampler's is shared by "
                         "the whole batch: pass one sampler for every prompt")
    batch = make_batch(model, draft_tokens=draft_tokens, max_draft_tokens=max_draft_tokens,
                       sampler=opaque[0] if opaque else None)
    requests = []
    for i, prompt in enumerate(prompts):
        cache = None
        if prompt_caches is not None:  # read, not updated: decode on a copy
            cache = copy.deepcopy(prompt_caches[i])
        elif return_prompt_caches:
            cache = model.make_cache()
        request = batch.prepare(prompt, cache, max_tokens[i], seeds[i], prefill_step_size,
                                sampler=None if opaque else samplers[i],
                                logits_processors=processors[i])
        if request.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1 for each prompt")
        requests.append(request)
    results: List[List[int]] = [[] for _ in range(n)]
    counters = BatchStats(prompt_tokens=sum(len(r.prompt) for r in requests))
    tic = time.perf_counter()
    done = 0
    with wired_limit(model, [generation_stream]):
        for i, token, _, reason, _ in decode_rows(batch, requests, tokenizer.eos_token_ids,
                                                  completion_batch_size, prefill_step_size):
            if reason != "stop":
                results[i].append(token)
            if reason is not None:
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
    if response.drafted:
        acc = ", ".join(f"{a:.0%}" for a in response.acceptance)
        print(f"MTP: draft depth {response.draft_tokens}, acceptance per position [{acc}], "
              f"{response.tokens_per_cycle:.2f} tokens per cycle "
              f"({response.accepted}/{response.drafted} drafts accepted)", file=file)
    elif model is not None and not getattr(model, "has_mtp", False):
        print("MTP: off (the model has no MTP head)", file=file)
    else:
        print("MTP: off (plain decoding)", file=file)


# -- CLI ------------------------------------------------------------------------
DEFAULT_PROMPT = "def fibonacci(n):"


def _json_object(name):
    """An argparse type: a JSON object (argparse prints the message, exits 2)."""
    def parse(text):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(
                f"{name} is not valid JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object")
        return value
    return parse


def setup_arg_parser() -> argparse.ArgumentParser:
    """mlx_lm.generate's flags (same names and defaults but --top-p's 0, also
    off, and --verbose off), plus the MTP ones; the numeric ones are
    range-checked by the table in params.py (a bad value: one `error:` line,
    exit 2)."""
    flag = params.flag
    p = argparse.ArgumentParser(
        prog="python -m mlx_mtp.generate",
        description="Generate text with MTP speculative decoding (exact; same output as mlx_lm).",
    )
    p.add_argument("--model", type=str, default=None,
                   help="Model folder or Hugging Face repo (default: the embedded demo model)")
    p.add_argument("--prompt", "-p", type=str, default=DEFAULT_PROMPT,
                   help="Message to the model ('-' reads stdin)")
    p.add_argument("--system-prompt", type=str, default=None)
    p.add_argument("--max-tokens", "-m", type=flag("max_tokens"), default=100,
                   help="tokens to generate (-1: no limit)")
    p.add_argument("--draft-tokens", "--num-draft-tokens", type=flag("draft_tokens"),
                   default="auto",
                   help="MTP draft depth k, or 'auto' (default): chosen per cycle from "
                        "measured acceptance and cost, 0 (plain decoding) included")
    p.add_argument("--draft-model", type=str, default=None, metavar="FOLDER",
                   help="A folder holding the model's MTP head, drafted with instead of the "
                        "checkpoint's own (mlx-vlm's split drafter, or mtp.* safetensors with "
                        "their config). A separate draft model is refused: the head drafts")
    p.add_argument("--max-draft-tokens", type=flag("max_draft_tokens"), default=4,
                   help="largest depth 'auto' tries")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the layers over the ranks (pipeline "
                        "parallel) instead of sharding each layer (tensor parallel)")
    p.add_argument("--no-lookahead", action="store_true",
                   help="read every cycle before building the next (default: cycle n+1 is "
                        "queued before cycle n is read)")
    p.add_argument("--no-pipeline", action="store_true", help=argparse.SUPPRESS)  # deprecated
    p.add_argument("--draft-vocab", type=str, default=None,
                   help="draft over a trimmed vocabulary: N (the tokenizer's first N ids) or "
                        "a JSON file from `python -m mlx_mtp.evaluate --write-draft-vocab`")
    p.add_argument("--temp", type=flag("temp"), default=0.0, help="Sampling temperature")
    p.add_argument("--top-p", type=flag("top_p"), default=0.0)
    p.add_argument("--min-p", type=flag("min_p"), default=0.0)
    p.add_argument("--top-k", type=flag("top_k"), default=0)
    p.add_argument("--min-tokens-to-keep", type=flag("min_tokens_to_keep"), default=1)
    p.add_argument("--xtc-probability", type=flag("xtc_probability"), default=0.0)
    p.add_argument("--xtc-threshold", type=flag("xtc_threshold"), default=0.1)
    p.add_argument("--repetition-penalty", type=flag("repetition_penalty"), default=None)
    p.add_argument("--repetition-context-size", type=flag("repetition_context_size"),
                   default=20)
    p.add_argument("--logit-bias", type=_json_object("--logit-bias"), default=None,
                   help='JSON object of token id -> additive bias, e.g. \'{"13": -5}\'')
    p.add_argument("--draft-temp", type=flag("draft_temp"), default=None,
                   help="Temperature the MTP head drafts at when sampling (default: --temp; "
                        "0: greedy drafts). Any value keeps the output exact")
    p.add_argument("--seed", type=flag("seed"), default=None,
                   help="Seed of mx.random: the same seed gives the same output")
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument("--chat-template-config", type=_json_object("--chat-template-config"),
                   default=None, help="JSON of extra chat-template arguments")
    p.add_argument("--extra-eos-token", type=str, nargs="+", default=())
    p.add_argument("--prefill-step-size", type=flag("prefill_step_size"), default=2048)
    p.add_argument("--prompt-cache-file", type=str, default=None,
                   help="A prompt cache from mlx_lm.cache_prompt (or save_prompt_cache): "
                        "the prompt continues after the cached one")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"),
                   nargs="?", const=True, default=False,
                   help="Print tokens as they come and timing / MTP statistics")
    return p


def read_prompt(args) -> str:
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt != "-":
        return prompt
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the prompt on stdin is not valid UTF-8 (byte {e.start})") from None


def build_prompt(tokenizer, args, using_cache: bool = False) -> list:
    prompt = read_prompt(args)
    use_chat = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat:
        messages = []
        if args.system_prompt is not None:
            messages.append({"role": "system", "content": args.system_prompt})
        messages.append({"role": "user", "content": prompt})
        kwargs = args.chat_template_config or {}
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        if using_cache:  # as mlx_lm: the cached prompt is the prefix of this one
            messages[-1]["content"] = "<query>"
            test = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs)
            prompt = prompt[test.index("<query>"):]
    ids = tokenizer.encode(prompt, add_special_tokens=not use_chat)
    if not ids:
        raise ValueError("the prompt is empty (give --prompt some text)")
    return ids


def main(argv=None):
    from .distributed import sharded_load, world
    from .load import CheckpointError, load
    from .mlx_lm_compat import xtc_special_tokens
    from .sampling import make_logits_processors, make_sampler

    args = setup_arg_parser().parse_args(argv)
    if args.no_pipeline:
        print("mlx_mtp: --no-pipeline is deprecated; use --no-lookahead", file=sys.stderr)
        args.no_lookahead = True
    if args.seed is not None:
        mx.random.seed(args.seed)
    prompt_cache, model_path, tokenizer_config = None, args.model, None
    try:
        if args.prompt_cache_file is not None:
            from mlx_lm.models.cache import load_prompt_cache

            try:
                prompt_cache, metadata = load_prompt_cache(args.prompt_cache_file,
                                                           return_metadata=True)
            except (OSError, ValueError, KeyError) as e:
                print(f"error: cannot read the prompt cache {args.prompt_cache_file}: {e}",
                      file=sys.stderr)
                return 1
            tokenizer_config = json.loads(metadata.get("tokenizer_config", "{}"))
            cached_model = metadata.get("model")
            if model_path is None:
                model_path = cached_model
            elif cached_model is not None and model_path != cached_model:
                print(f"error: the prompt cache was made with {cached_model}, not {model_path}",
                      file=sys.stderr)
                return 1
        group = world()
        try:
            if group is not None:  # under mlx.launch: this rank's share of the model
                if args.draft_model is not None:
                    raise ValueError("--draft-model is not supported on a sharded model")
                model, tokenizer = sharded_load(
                    model_path, pipeline_group=group if args.pipeline else None,
                    tensor_group=None if args.pipeline else group,
                    tokenizer_config=tokenizer_config)
            else:
                model, tokenizer = load(model_path, tokenizer_config=tokenizer_config,
                                        draft=args.draft_model)
        except (FileNotFoundError, CheckpointError, ValueError) as e:
            rank = "" if group is None else f"rank {group.rank()}: "
            print(f"error: {rank}{e}", file=sys.stderr)
            return 1
        # every rank decodes; rank 0 prints
        out = sys.stdout if group is None or group.rank() == 0 else open(os.devnull, "w")
        from . import draft_vocab

        try:
            for eos in args.extra_eos_token:
                tokenizer.add_eos_token(eos)
            prompt = build_prompt(tokenizer, args, using_cache=prompt_cache is not None)
            checks.top_k(args.top_k, model.vocab_size)
            sampler = make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep,
                                   top_k=args.top_k, draft_temp=args.draft_temp,
                                   xtc_probability=args.xtc_probability,
                                   xtc_threshold=args.xtc_threshold,
                                   xtc_special_tokens=xtc_special_tokens(tokenizer))
            processors = make_logits_processors(checks.logit_bias(args.logit_bias, model.vocab_size),
                                                args.repetition_penalty,
                                                args.repetition_context_size)
            vocab = draft_vocab.load(args.draft_vocab, tokenizer, model.vocab_size)
        except (TypeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        text, last = "", None
        try:
            if args.verbose:
                print("=" * 10, file=out)
            for last in stream_generate(
                    model, tokenizer, prompt, max_tokens=args.max_tokens,
                    draft_tokens=args.draft_tokens, sampler=sampler,
                    logits_processors=processors, prefill_step_size=args.prefill_step_size,
                    draft_vocab=vocab, max_draft_tokens=args.max_draft_tokens,
                    lookahead=not args.no_lookahead, prompt_cache=prompt_cache):
                text += last.text
                if args.verbose:
                    print(last.text, end="", flush=True, file=out)
        except KeyboardInterrupt:  # keep what was generated
            print("" if args.verbose else text, flush=True, file=out)
            n = last.generation_tokens if last is not None else 0
            print(f"interrupted after {n} generated tokens", file=sys.stderr)
            return 130
        if args.verbose:
            print(file=out)
            print("=" * 10, file=out)
            print_stats(last, model, file=out)
        else:
            print(text, file=out)
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # under mlx.launch: another rank stopped (its line says why)
        group = mx.distributed.init()
        if group.size() == 1:
            raise
        print(f"error: rank {group.rank()}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
