"""The CLI `python -m mlx_mtp.generate`: mlx_lm.generate's flags plus
--draft-tokens (--draft-model takes a folder holding the MTP head, not a
separate model) and structured output (--json-schema, --regex, --grammar). The library functions are in `api.py` (`mlx_mtp.generate`,
...); `generate.py` only runs `main` (see there why)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import mlx.core as mx

from . import checks, params
from .ngram_tables import MEMORY_SHARE, MODES
from .params import SAMPLER_DEFAULTS
from .api import print_stats, stream_generate


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


def read_constraint(kind: str, text: str):
    """mlx_mtp.constrain of a flag's value: kind "json_schema" (a file, or the
    schema itself when it starts with '{'), "regex" (the regex) or "grammar"
    (a Lark file). ValueError, one line, for a bad one (llguidance is
    imported only here)."""
    from .constraint import constrain

    value = text
    if kind == "grammar" or (kind == "json_schema" and not text.lstrip().startswith("{")):
        try:
            with open(text, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            what = "a file" if kind == "grammar" else "a file or a JSON object"
            raise ValueError(f"not {what}: cannot read {text!r} "
                             f"({getattr(e, 'strerror', None) or e})") from None
    return constrain(**{kind: value})


def _constraint(kind: str):
    """An argparse type: --json-schema FILE_OR_JSON, --regex REGEX or --grammar
    FILE (Lark), compiled by mlx_mtp.constrain (`read_constraint`); a bad one
    is argparse's one `error:` line, exit 2."""
    def parse(text):
        try:
            return read_constraint(kind, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "--" + kind.replace("_", "-")
    return parse


def setup_arg_parser() -> argparse.ArgumentParser:
    """mlx_lm.generate's flags (same names and defaults but --top-p's 0, also
    off, and --verbose off), plus the MTP ones; the numeric ones are
    range-checked by the table in params.py (a bad value: one `error:` line,
    exit 2)."""
    flag = params.flag
    p = params.ArgumentParser(
        prog="python -m mlx_mtp.generate",
        description="Generate text with MTP speculative decoding (exact; same output as mlx_lm).",
    )
    p.add_argument("--model", type=str, default=None,
                   help="Model folder or Hugging Face repo (default: the embedded demo model)")
    p.add_argument("--prompt", "-p", type=str, default=DEFAULT_PROMPT,
                   help="Message to the model ('-' reads stdin)")
    p.add_argument("--system-prompt", type=str, default=None)
    p.add_argument("--image", action="append", metavar="PATH", default=None,
                   help="an image for the prompt (repeatable; a Qwen3.5/3.6 or qwen4_exp folder "
                        "with its vision tower, pip install 'mlx-mtp[vision]')")
    p.add_argument("--max-tokens", "-m", type=flag("max_tokens"), default=100,
                   help="tokens to generate (-1: no limit)")
    p.add_argument("--draft-tokens", "--num-draft-tokens", type=flag("draft_tokens"),
                   default=params.DecodeOptions.draft_tokens,
                   help="MTP draft depth k, or 'auto' (default): chosen per cycle from "
                        "measured acceptance and cost, 0 (plain decoding) included")
    p.add_argument("--draft-model", type=str, default=None, metavar="FOLDER",
                   help="A folder holding the model's MTP head, drafted with instead of the "
                        "checkpoint's own (mlx-vlm's split drafter, or mtp.* safetensors with "
                        "their config). A separate draft model is refused: the head drafts")
    p.add_argument("--ngram-tables", choices=list(MODES), default="auto",
                   help="where a qwen4_exp model's n-gram tables stay: memory, disk "
                        "(memory-mapped, rows read per lookup; decoding runs uncompiled) or "
                        "auto (default: memory while the checkpoint takes at most "
                        f"{MEMORY_SHARE * 100:.0f}%% of this machine's memory)")
    p.add_argument("--max-draft-tokens", type=flag("max_draft_tokens"),
                   default=params.DecodeOptions.max_draft_tokens,
                   help="largest depth 'auto' tries")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the layers over the ranks (pipeline "
                        "parallel) instead of sharding each layer (tensor parallel)")
    p.add_argument("--no-lookahead", action="store_true",
                   help="read every cycle before building the next (default: cycle n+1 is "
                        "queued before cycle n is read)")
    p.add_argument("--no-pipeline", action="store_true", help=argparse.SUPPRESS)  # deprecated
    p.add_argument("--context-drafts", action=argparse.BooleanOptionalAction,
                   default=params.DecodeOptions.context_drafts,
                   help="where the last tokens occurred before in the prompt or the answer, "
                        "draft what followed them there (a copied span at copy speed; the "
                        "output is unchanged)")
    p.add_argument("--draft-vocab", type=str, default=None,
                   help="draft over a trimmed vocabulary: N (the tokenizer's first N ids) or "
                        "a JSON file from `python -m mlx_mtp.evaluate --write-draft-vocab`")
    p.add_argument("--temp", type=flag("temp"), default=SAMPLER_DEFAULTS["temp"],
                   help="Sampling temperature")
    p.add_argument("--top-p", type=flag("top_p"), default=SAMPLER_DEFAULTS["top_p"])
    p.add_argument("--min-p", type=flag("min_p"), default=SAMPLER_DEFAULTS["min_p"])
    p.add_argument("--top-k", type=flag("top_k"), default=SAMPLER_DEFAULTS["top_k"])
    p.add_argument("--min-tokens-to-keep", type=flag("min_tokens_to_keep"),
                   default=SAMPLER_DEFAULTS["min_tokens_to_keep"])
    p.add_argument("--xtc-probability", type=flag("xtc_probability"),
                   default=SAMPLER_DEFAULTS["xtc_probability"])
    p.add_argument("--xtc-threshold", type=flag("xtc_threshold"),
                   default=SAMPLER_DEFAULTS["xtc_threshold"])
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
    p.add_argument("--prefill-step-size", type=flag("prefill_step_size"),
                   default=params.DecodeOptions.prefill_step_size)
    p.add_argument("--prompt-cache-file", type=str, default=None,
                   help="A prompt cache from mlx_lm.cache_prompt (or save_prompt_cache): "
                        "the prompt continues after the cached one")
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", dest="constraint", type=_constraint("json_schema"),
                            metavar="FILE_OR_JSON",
                            help="the output is JSON valid under this JSON schema (a file, or "
                                 "the schema itself)")
    structured.add_argument("--regex", dest="constraint", type=_constraint("regex"),
                            metavar="REGEX", help="the output matches this regex (whole)")
    structured.add_argument("--grammar", dest="constraint", type=_constraint("grammar"),
                            metavar="FILE", help="the output follows this Lark grammar "
                                                 "(llguidance's dialect)")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"),
                   nargs="?", const=True, default=False,
                   help="Also print timing, MTP statistics and the path each kernel took "
                        "(the text is printed as it is generated either way)")
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
        images = getattr(args, "image", None) or []
        messages.append({"role": "user", "content": prompt if not images else [
            *({"type": "image"} for _ in images), {"type": "text", "text": prompt}]})
        kwargs = dict(args.chat_template_config or {})
        if getattr(args, "constraint", None) is not None:
            from .constraint import thinking_args

            off = thinking_args(kwargs, {}, tokenizer.has_thinking)
            if off != kwargs:
                kwargs = off
                print("mlx_mtp: thinking is off under --json-schema/--regex/--grammar; "
                      "--chat-template-config '{\"enable_thinking\": true}' keeps it (the "
                      "grammar then applies after the reasoning)", file=sys.stderr)
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        if using_cache:  # as mlx_lm: the cached prompt is the prefix of this one
            messages[-1]["content"] = "<query>"
            test = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs)
            prompt = prompt[test.index("<query>"):]
    if getattr(args, "image", None) and not use_chat:  # a raw prompt: the images first
        prompt = "<|vision_start|><|image_pad|><|vision_end|>" * len(args.image) + prompt
    ids = tokenizer.encode(prompt, add_special_tokens=not use_chat)
    if not ids:
        raise ValueError("the prompt is empty (give --prompt some text)")
    return ids


class Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, systemd, a CI runner stopping the job), handled as
    Ctrl-C is: the text so far stays printed, exit 128 + 15."""

    signum = signal.SIGTERM


def _terminate(signum, frame):
    raise Terminated()


def _exit_code(e: KeyboardInterrupt) -> int:
    return 128 + int(getattr(e, "signum", signal.SIGINT))


def main(argv=None):
    """The CLI; SIGTERM is handled as SIGINT while it runs (in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv=None):
    from .distributed import sharded_load, world
    from .loader import CheckpointError, load
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
                if not os.path.isfile(args.prompt_cache_file):
                    raise FileNotFoundError("no such file")
                prompt_cache, metadata = load_prompt_cache(args.prompt_cache_file,
                                                           return_metadata=True)
                tokenizer_config = json.loads(metadata.get("tokenizer_config", "{}"))
            except (OSError, ValueError, KeyError, RuntimeError) as e:  # (MLX: RuntimeError)
                why = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(f"error: cannot read the prompt cache {args.prompt_cache_file}: {why}",
                      file=sys.stderr)
                return 1
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
                    tokenizer_config=tokenizer_config, ngram_tables=args.ngram_tables)
            else:
                model, tokenizer = load(model_path, tokenizer_config=tokenizer_config,
                                        draft=args.draft_model, ngram_tables=args.ngram_tables)
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
        last = None
        try:
            if args.verbose:
                print("=" * 10, file=out)
            for last in stream_generate(  # the text as it comes (as mlx_lm.generate)
                    model, tokenizer, prompt, max_tokens=args.max_tokens,
                    draft_tokens=args.draft_tokens, sampler=sampler,
                    logits_processors=processors, prefill_step_size=args.prefill_step_size,
                    draft_vocab=vocab, max_draft_tokens=args.max_draft_tokens,
                    lookahead=not args.no_lookahead, prompt_cache=prompt_cache,
                    constraint=args.constraint, images=args.image,
                    context_drafts=args.context_drafts):
                print(last.text, end="", flush=True, file=out)
        except ValueError as e:  # (the images: unreadable, too large, not this model's ...)
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:  # what was generated is printed already
            print(flush=True, file=out)
            n = last.generation_tokens if last is not None else 0
            print(f"interrupted after {n} generated tokens", file=sys.stderr)
            return _exit_code(e)
        print(file=out)
        if args.verbose:
            print("=" * 10, file=out)
            print_stats(last, model, file=out)
            from . import metal

            print(metal.describe(), file=out)
        return 0
    except KeyboardInterrupt as e:
        print("interrupted", file=sys.stderr)
        return _exit_code(e)
    except RuntimeError as e:  # under mlx.launch: another rank stopped (its line says why)
        group = mx.distributed.init()
        if group.size() == 1:
            raise
        print(f"error: rank {group.rank()}: {e}", file=sys.stderr)
        return 1

