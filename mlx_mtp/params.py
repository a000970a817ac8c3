"""The request and flag parameters: one table, and what is made from it.

Each `Param` row says a parameter's type and range and where it appears:

- `openai`: its request fields on /v1/chat/completions and /v1/completions,
- `anthropic`: its request fields on /v1/messages,
- `extension`: the server's own request fields, on every API (those two and
  /v1/responses), checked and applied alike,
- `generate` / `server`: the flags of `python -m mlx_mtp.generate` and of
  `python -m mlx_mtp.server`,
- `api`: the Python API's arguments.

Made from it, never written out by hand elsewhere:

- `check(name, value)`: the API's checks (checks.sampling, checks.depth,
  checks.max_tokens, ...);
- `schema(surface)`: the JSON schemas of those request fields (server/schemas.py's
  `_COMMON`, server/anthropic.py's `REQUEST_SCHEMA`), validated with `Validator`
  (jsonschema, integers being JSON integers: 5.0 is not one);
- `flag(name)`: the argparse `type=` of the flags of both CLIs (whose
  parsers are `ArgumentParser`: an error is one line).

A refused value gets one line naming the field, flag or argument, the value
and what is allowed, in the same words on every surface. Names and defaults
are mlx_lm's. Where mlx_lm has no bound and a value past ours can only be a
mistake, the row has one and `why` says why. Limits that depend on the model
or on the server's flags (`top_k` below the vocabulary size, `max_tokens` at
most `--max-tokens-limit`) are not in the table: checks.top_k and the server
check them where the model is known. `python -m mlx_mtp.params` prints the
table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import jsonschema

SURFACES = ("openai", "anthropic", "generate", "server", "api")

# The environment's on/off flags (README's guide lists them), read by `env_flag`:
# name -> (default, what it turns on)
ENV_FLAGS = {
    "MLX_MTP_DISABLE": (False, "plain decoding everywhere (no drafts)"),
    "MLX_MTP_QMV_ROWS": (True, "the verify's quantized products through qmv_rows on a GPU"),
    "MLX_MTP_FAST_KERNELS": (False, "the fused kernels that are not bitwise exact"),
    "MLX_MTP_CHECK_COUNTS": (False, "each read checks the host's counters against the device's"),
    "MLX_MTP_DEBUG": (False, "the converter raises its errors with their traceback"),
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """An on/off environment flag (ENV_FLAGS): 1, true, yes, on are on; 0,
    false, no, off are off (any case, spaces ignored); unset or empty is its
    default; anything else is one ValueError naming it."""
    default = ENV_FLAGS[name][0]
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"{name} must be one of {', '.join(_TRUE + _FALSE)} (or unset), not "
                     f"{os.environ[name]!r}")
MAX_DEPTH = 16  # draft_tokens above this only cost time: acceptance decays per position

# Logits of a language model span tens of nats. A temperature of 100 already
# flattens a span of 30 to within a factor e^0.3 = 1.35 of uniform (the model
# no longer chooses), and a penalty of 100 nats already removes or forces a token:
# larger values change nothing a user could want (1e9 is a unit mix-up), and
# past them only float overflow is left (a repetition penalty scales logits:
# by 100 they are flat or gone). OpenAI caps temperature at 2 and the
# penalties at ±2, Anthropic temperature at 1; mlx_lm has no caps, so ours are
# wide enough for any value in use.
_FLAT = "above 100 the distribution is as good as uniform: the model no longer chooses"
_NATS = "a logit moved by 100 nats is already gone or certain; more is a mistake"
_SCALE = "logits scaled by 100 are already flat or gone; more is a mistake"


@dataclass(frozen=True)
class Param:
    name: str  # the Python API's name; messages from the API and the CLIs use it
    kind: type  # int or float
    lo: Optional[float] = None
    hi: Optional[float] = None
    # values taken besides the range, with what they mean (said in messages)
    extra: Tuple[Tuple[Any, str], ...] = ()
    extra_served: bool = True  # the server takes them too (its fields and flags)
    nullable: bool = False  # a request field may be null: the server's default
    openai: Tuple[str, ...] = ()
    anthropic: Tuple[str, ...] = ()
    # the server's own request fields (no OpenAI or Anthropic API has them):
    # taken, checked and applied alike by every API (chat, completions,
    # messages, responses): `FIELDS`, `EXTENSIONS`
    extension: Tuple[str, ...] = ()
    generate: Tuple[str, ...] = ()
    server: Tuple[str, ...] = ()
    api: Tuple[str, ...] = ()
    why: str = ""  # why the range is not mlx_lm's
    note: str = ""  # what else limits it

    def extras(self, surface: str = "api") -> Tuple[Tuple[Any, str], ...]:
        if surface in ("openai", "anthropic", "server") and not self.extra_served:
            return ()
        return self.extra

    def allowed(self, surface: str = "api") -> str:
        """What is allowed, as the messages say it: "in 0..16 or 'auto'"."""
        return _span(self.lo, self.hi, self.kind is int) + _also(self.extras(surface))

    def check(self, value, name: Optional[str] = None, surface: str = "api"):
        """The value if allowed; else TypeError (wrong type) or ValueError
        (out of range), one line naming `name` (default: the API's name)."""
        name = name or self.name
        extras = self.extras(surface)
        if any(value == x and type(value) is type(x) for x, _ in extras):
            return value
        convert = integer if self.kind is int else number
        return convert(name, value, self.lo, self.hi, _also(extras))

    def schema(self, surface: str) -> dict:
        """The JSON schema of this parameter's request field(s)."""
        base: Dict[str, Any] = {"type": "integer" if self.kind is int else "number"}
        if self.lo is not None:
            base["minimum"] = self.lo
        if self.hi is not None:
            base["maximum"] = self.hi
        options = [base, *({"const": x} for x, _ in self.extras(surface))]
        if self.nullable:
            options.append({"type": "null"})
        return options[0] if len(options) == 1 else {"anyOf": options}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _span(lo, hi, whole: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {lo}..{hi}" if whole else f"in [{lo}, {hi}]"
    if lo is not None:
        return f"at least {lo}"
    if hi is not None:
        return f"at most {hi}"
    return "any integer" if whole else "any number"


def _also(extras) -> str:
    return "".join(f" or {x!r}" + (f" ({meaning})" if meaning else "") for x, meaning in extras)


def integer(name: str, v: Any, lo: Optional[int] = None, hi: Optional[int] = None,
            also: str = "") -> int:
    """v if an int in [lo, hi] (bounds optional); TypeError or ValueError otherwise."""
    if not _is_int(v):
        raise TypeError(f"{name} must be an integer{also}, not {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be {_span(lo, hi, True)}{also}, not {v}")
    return v


def number(name: str, v: Any, lo: Optional[float] = None, hi: Optional[float] = None,
           also: str = "") -> float:
    """float(v) if a number in [lo, hi] (not NaN); TypeError or ValueError otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise TypeError(f"{name} must be a number{also}, not {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be {_span(lo, hi, False)}{also}, not {v}")
    return float(v)


# -- the table ---------------------------------------------------------------------------------
_SAMPLER = "make_sampler({})"
TABLE: Tuple[Param, ...] = (
    Param("max_tokens", int, lo=1, extra=((-1, "no limit"),), extra_served=False,
          openai=("max_tokens", "max_completion_tokens"), anthropic=("max_tokens",),
          generate=("--max-tokens",), server=("--max-tokens",),
          api=("generate(max_tokens)", "stream_generate(max_tokens)",
               "generate_step(max_tokens)", "batch_generate(max_tokens)"),
          note="requests: at most --max-tokens-limit, and the prompt plus max_tokens within "
               "the model's context; generate_step also takes 0 (the prompt is only "
               "prefilled into prompt_cache)"),
    Param("max_tokens_limit", int, lo=1, server=("--max-tokens-limit",),
          note="at least --max-tokens"),
    Param("draft_tokens", int, lo=0, hi=MAX_DEPTH,
          extra=(("auto", ""),),
          nullable=True, extension=("num_draft_tokens",), generate=("--draft-tokens",),
          server=("--draft-tokens",), note="'auto': chosen per cycle from measured acceptance "
                                           "and cost, 0 included",
          api=("generate(draft_tokens)", "stream_generate(draft_tokens)",
               "generate_step(draft_tokens, num_draft_tokens)",
               "batch_generate(draft_tokens)"),
          why=f"above {MAX_DEPTH} drafts only cost time (acceptance decays per position)"),
    Param("max_draft_tokens", int, lo=1, hi=MAX_DEPTH, generate=("--max-draft-tokens",),
          server=("--max-draft-tokens",),
          api=("generate_step(max_draft_tokens)", "batch_generate(max_draft_tokens)"),
          why=f"the largest depth 'auto' tries, so at most {MAX_DEPTH} as draft_tokens"),
    Param("temp", float, lo=0, hi=100, openai=("temperature",), anthropic=("temperature",),
          generate=("--temp",), server=("--temp",), api=(_SAMPLER.format("temp"),), why=_FLAT),
    Param("draft_temp", float, lo=0, hi=100, generate=("--draft-temp",),
          api=(_SAMPLER.format("draft_temp"),), why=_FLAT),
    Param("top_p", float, lo=0, hi=1, openai=("top_p",), anthropic=("top_p",),
          generate=("--top-p",), server=("--top-p",), api=(_SAMPLER.format("top_p"),),
          note="0 and 1 are off"),
    Param("min_p", float, lo=0, hi=1, openai=("min_p",), generate=("--min-p",),
          server=("--min-p",), api=(_SAMPLER.format("min_p"),)),
    Param("top_k", int, lo=0, openai=("top_k",), anthropic=("top_k",), generate=("--top-k",),
          server=("--top-k",), api=(_SAMPLER.format("top_k"),),
          note="0 is off; below the model's vocabulary size (checks.top_k)"),
    Param("min_tokens_to_keep", int, lo=1, generate=("--min-tokens-to-keep",),
          api=(_SAMPLER.format("min_tokens_to_keep"),)),
    Param("xtc_probability", float, lo=0, hi=1, openai=("xtc_probability",),
          generate=("--xtc-probability",), api=(_SAMPLER.format("xtc_probability"),)),
    Param("xtc_threshold", float, lo=0, hi=0.5, openai=("xtc_threshold",),
          generate=("--xtc-threshold",), api=(_SAMPLER.format("xtc_threshold"),),
          why="mlx_lm's sampler refuses more than 0.5 (its server's check said 1)"),
    Param("repetition_penalty", float, lo=0, hi=100, openai=("repetition_penalty",),
          generate=("--repetition-penalty",), why=_SCALE),
    Param("repetition_context_size", int, lo=0, openai=("repetition_context_size",),
          generate=("--repetition-context-size",)),
    Param("presence_penalty", float, lo=-100, hi=100, openai=("presence_penalty",), why=_NATS),
    Param("presence_context_size", int, lo=0, openai=("presence_context_size",)),
    Param("frequency_penalty", float, lo=-100, hi=100, openai=("frequency_penalty",),
          why=_NATS),
    Param("frequency_context_size", int, lo=0, openai=("frequency_context_size",)),
    Param("top_logprobs", int, lo=0, hi=11, openai=("top_logprobs",)),
    Param("seed", int, lo=0, hi=2 ** 64 - 1, nullable=True, openai=("seed",),
          generate=("--seed",), api=("generate_step(seed)", "batch_generate(seeds)"),
          why="MLX's random keys are unsigned 64-bit"),
    Param("prefill_step_size", int, lo=1, generate=("--prefill-step-size",),
          server=("--prefill-step-size",),
          api=("generate_step(prefill_step_size)", "batch_generate(prefill_step_size)")),
    Param("completion_batch_size", int, lo=1, api=("batch_generate(completion_batch_size)",)),
    Param("port", int, lo=1, hi=65535, server=("--port",),
          why="a TCP port; 0 (any free port) would serve where no one knows"),
    Param("decode_concurrency", int, lo=1, server=("--decode-concurrency",)),
    Param("prompt_concurrency", int, lo=1, server=("--prompt-concurrency",)),
    Param("max_queued_requests", int, lo=0, server=("--max-queued-requests",)),
    Param("prompt_cache_size", int, lo=0, server=("--prompt-cache-size",)),
    Param("shutdown_grace", float, lo=0, hi=3600, server=("--shutdown-grace",),
          why="seconds; an hour is longer than any supervisor waits"),
    Param("read_timeout", float, lo=0.1, hi=3600, server=("--read-timeout",),
          why="seconds; 0 would time out every read at once"),
    Param("idle_chunk_ms", float, lo=1, hi=10000, server=("--idle-chunk-ms",),
          why="milliseconds a request may wait for idle-time work; past 10 s it is no "
              "longer a chunk"),
    Param("max_images", int, lo=0, server=("--max-images",)),
    Param("max_image_pixels", int, lo=1, server=("--max-image-pixels",)),
    Param("image_timeout", float, lo=0.1, hi=600, server=("--image-timeout",),
          why="seconds one image URL's fetch may take"),
)
PARAMS: Dict[str, Param] = {p.name: p for p in TABLE}
# the server's own request fields -> their rows (every API takes them)
EXTENSIONS: Dict[str, Param] = {f: p for p in TABLE for f in p.extension}
# request field -> its row, per HTTP surface (/v1/responses: OpenAI's)
FIELDS: Dict[str, Dict[str, Param]] = {
    s: {**{f: p for p in TABLE for f in getattr(p, s)}, **EXTENSIONS}
    for s in ("openai", "anthropic")}


def check(name: str, value, field: Optional[str] = None, surface: str = "api"):
    """The table's check of parameter `name` (messages say `field` if given)."""
    return PARAMS[name].check(value, field, surface)


def schema(surface: str) -> dict:
    """{request field: JSON schema} for the fields of `surface` ("openai",
    "anthropic") in the table."""
    return {f: p.schema(surface) for f, p in FIELDS[surface].items()}


def refusal(surface: str, field: str, value) -> Optional[str]:
    """The one-line message for a request field the table refuses (None if
    the table takes it, or the field is not in it)."""
    p = FIELDS[surface].get(field)
    if p is None:
        return None
    if value is None and p.nullable:
        return None
    try:
        p.check(value, field, surface)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def coerce(surface: str, body: dict) -> dict:
    """Number fields as floats (mlx_lm's server wants floats where JSON may
    carry 0 or 1); checked values only."""
    for field, p in FIELDS[surface].items():
        if p.kind is float and _is_int(body.get(field)):
            body[field] = float(body[field])
    return body


def _strict_integer(checker, instance) -> bool:
    return _is_int(instance)


# jsonschema's own validator, except that 5.0 is not an integer (mlx_lm's
# server refuses it) and NaN and the infinities are not numbers
Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many({
        "integer": _strict_integer,
        "number": lambda checker, v: (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v)),
    }))


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose error is one line, alone: `PROG: error:
    MESSAGE`, exit 2. argparse prints its usage block first, which for these
    CLIs is twenty lines burying the error (-h prints it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def flag(name: str, surface: str = "generate") -> Callable[[str], Any]:
    """The argparse `type=` of parameter `name`'s flag: a bad value exits 2
    with one `error:` line (argparse's) naming it, the value and the range."""
    p = PARAMS[name]
    words = {str(x): x for x, _ in p.extras(surface)}

    def convert(text: str):
        if text in words:
            value = words[text]
        else:
            try:
                value = p.kind(text)
            except ValueError:
                value = text  # the check says what was expected
        try:
            return p.check(value, surface=surface)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = name
    convert.param = p
    return convert


def markdown() -> str:
    """The table as Markdown (`python -m mlx_mtp.params`)."""
    rows = ["| name | type | allowed | OpenAI fields | Anthropic fields | generate flags | "
            "server flags | Python API | notes |", "|" + " --- |" * 9]
    for p in TABLE:
        served = p.allowed("server")
        allowed = p.allowed("api") + (f" (server: {served})" if served != p.allowed() else "")
        notes = "; ".join(x for x in (p.note, p.why) if x)
        cells = [p.name, p.kind.__name__, allowed,
                 *(", ".join(getattr(p, s) + (p.extension if s in ("openai", "anthropic")
                                              else ())) or "-" for s in SURFACES), notes]
        rows.append("| " + " | ".join(cells) + " |")
    rows += ["", "| environment flag | default | on: |", "| --- | --- | --- |"]
    rows += [f"| {name} | {'on' if default else 'off'} | {what} |"
             for name, (default, what) in ENV_FLAGS.items()]
    rows.append(f"\nOn: {', '.join(_TRUE)}; off: {', '.join(_FALSE)} (any case); unset: the default.")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())


def depth(v: Any, name: str = "draft_tokens"):
    """The draft depth: an int in 0..MAX_DEPTH, or 'auto' (a string of digits
    is read as its int)."""
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    return check("draft_tokens", v, name)


# On MLX's CPU backend a compiled graph's first run compiles its fused kernels
# with the system's C++ compiler (about 0.7 s each on a 2-core machine, cached
# under $TMPDIR/mlx/ afterwards): a model's first this many graph runs in a
# process are eager, so a short first generation compiles nothing of ours;
# every graph after them compiles at its first use, as on a GPU (a per-graph
# count would keep mixed traffic, whose specs change, eager for long)
# (docs/design.md, "Compiled graphs").
CPU_EAGER_RUNS = 48


@dataclass(frozen=True)
class DecodeOptions:
    """How a generation decodes, besides what each request brings (its
    prompt, cache, sampler, max_tokens, seed). Declared once here and passed
    down as one value: the API builds it (`generate_step`'s named arguments,
    `stream_generate`'s keywords), the loop and `make_batch` take it, the
    batch keeps it. Each value is checked against the table when made."""

    draft_tokens: Any = "auto"  # k, or "auto": chosen per cycle, 0 included
    max_draft_tokens: int = 4  # the deepest "auto" tries
    prefill_step_size: int = 2048  # prompt tokens per forward, as mlx_lm's
    lookahead: bool = True  # queue cycle n+1 before reading cycle n
    compiled: bool = True  # one compiled graph per depth, kept on the model
    draft_vocab: Any = None  # [N] int32: draft among these token ids only
    # rows draft the run that followed their suffix's latest earlier occurrence
    # in their own tokens where it occurred (context_draft.py)
    context_drafts: bool = False
    # tests and benchmarks: a drafter in place of the head's proposals (or
    # context_draft.ContextDrafter: copied runs, opt-in), an `auto`
    # controller, a list that gets each read cycle's host timestamps
    drafter: Any = None
    controller: Any = None
    timeline: Optional[list] = None

    def __post_init__(self):
        object.__setattr__(self, "draft_tokens", depth(self.draft_tokens))
        check("max_draft_tokens", self.max_draft_tokens)
        check("prefill_step_size", self.prefill_step_size)

    @classmethod
    def of(cls, options: Optional["DecodeOptions"] = None, **fields) -> "DecodeOptions":
        """`options` (or the defaults) with these fields replaced; a name that
        is not a field is a TypeError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise TypeError(f"unknown decoding option(s): {', '.join(unknown)}")
        return dataclasses.replace(options or cls(), **fields)

    @classmethod
    def split(cls, kwargs: dict) -> tuple:
        """(DecodeOptions of kwargs' option fields, the other kwargs)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return (cls(**{k: v for k, v in kwargs.items() if k in names}),
                {k: v for k, v in kwargs.items() if k not in names})


# mlx_lm's sampler defaults (its make_sampler's): mlx_mtp.make_sampler, the
# MTPSampler it makes and the generate CLI's flags take them from here
SAMPLER_DEFAULTS = dict(temp=0.0, top_p=0.0, min_p=0.0, min_tokens_to_keep=1, top_k=0,
                        xtc_probability=0.0, xtc_threshold=0.1)


# mlx_lm options that would change what is computed: refused with one line,
# by the API (as arguments) and the server (as flags)
UNSUPPORTED = {
    "max_kv_size": "a rotating KV cache",
    "kv_bits": "a quantized KV cache",
    "draft_model": "a separate draft model: the MTP head drafts; to draft with a head stored "
                   "in its own folder, load it with mlx_mtp.load(path, draft=FOLDER)",
    "input_embeddings": "input embeddings",
    "adapter_path": "adapters",
}
