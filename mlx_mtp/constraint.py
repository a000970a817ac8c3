"""Structured output: grammar constraints and the per-row matcher that masks
logits with them (docs/design.md, "Structured output").

`constrain(...)` compiles a JSON schema, any-JSON, a regex or a Lark grammar
with llguidance and refuses what it cannot enforce. `Matcher` follows one
row's tokens and gives what speculative decoding needs: the allowed-token
bitmasks of the k+1 verify positions after k drafts (computed by consuming
the drafts and rolling them back), the advance after the trunk accepted
tokens, the tokens the grammar forces, and whether the row must stop.

Masks are packed: bit t of word t // 32 of a row is set when token t is
allowed (llguidance's layout). `unpack_bitmask` expands them on the device.

llguidance is imported on first use, so a program that never constrains
never loads it; pydantic is only looked at when the caller already imported
it.
"""

from __future__ import annotations

import json
import re
import sys
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

__all__ = ["Constraint", "constrain", "json_term", "Matcher", "batch_masks", "unpack_bitmask",
           "apply_bitmask", "MaskingProcessor"]

# JSON is written with json.dumps' separators and no other whitespace: a free
# run of whitespace is a way for a model to never finish, and fixed separators
# make more structure tokens forced. A schema's "x-guidance" may override.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Applied after the schema's own options: an unimplemented keyword is always
# an error, never silently ignored (llguidance's "lenient" mode ignores them).
JSON_OVERRIDES = {"lenient": False}
KINDS = ("json_schema", "json_object", "regex", "grammar")
_LABEL = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regex",
          "grammar": "Lark grammar"}


def _llguidance():
    import llguidance  # lazy: only a program that constrains loads it

    return llguidance


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar, independent of any tokenizer (made by `constrain`).

    kind: "json_schema", "json_object", "regex" or "grammar";
    source: what was given (a schema as JSON text, the regex, the Lark text);
    grammar: llguidance's grammar definition.
    """

    kind: str
    source: str
    grammar: str

    def matcher(self, tokenizer, vocab_size: Optional[int] = None) -> "Matcher":
        """A fresh matcher for one row (see `Matcher`)."""
        return Matcher(self, tokenizer, vocab_size)


def check(constraint, tokenizer) -> None:
    """One line for a constraint that is not `constrain`'s, or one without
    the tokenizer it needs."""
    if not isinstance(constraint, Constraint):
        raise TypeError("constraint must be made by mlx_mtp.constrain(...), not "
                        f"{type(constraint).__name__}")
    if tokenizer is None:
        raise ValueError("a constraint needs the tokenizer: pass tokenizer=")


def row_matcher(constraint: Constraint, tokenizer, vocab_size: int,
                context: Sequence[int] = ()) -> "Matcher":
    """A row's grammar for the decoder (Batch.prepare): a matcher as wide as
    the model's logits. A prompt (`context`: its tokens, the cached ones
    first) that leaves the model inside its think block gets the grammar
    after the reasoning (`after_thinking`)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    check(constraint, tokenizer)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if in_thinking(tokenizer, context):
        constraint = after_thinking(constraint, tokenizer, vocab_size)
    return constraint.matcher(tokenizer, vocab_size)


# -- thinking under a grammar: one rule for the API, the CLI and the server ----------------
# between the end of the reasoning and the answer (Qwen's templates write "\n\n")
AFTER_THINKING = r"/\n{0,2}/"


def thinking_args(template_args: dict, defaults: dict, has_thinking: bool) -> dict:
    """The chat template's arguments for an output under a grammar, on a model
    that thinks: thinking is off (`enable_thinking: false`) unless the caller
    (or the server's --chat-template-args, `defaults`) sets `enable_thinking`.
    A reasoning still there (asked for, or a template that always thinks) is
    free, and the grammar applies after it (`row_matcher`)."""
    if not has_thinking or "enable_thinking" in {**defaults, **template_args}:
        return template_args
    return {**template_args, "enable_thinking": False}


def in_thinking(tokenizer, tokens: Sequence[int]) -> bool:
    """Whether a prompt leaves the model inside its think block (mlx_lm's
    server's rule: a think-start after the last think-end)."""
    if not getattr(tokenizer, "has_thinking", False) or not len(tokens):
        return False
    tokens = list(tokens)
    state = getattr(tokenizer, "response_initial_state", None)
    if state is not None:
        return state == "reasoning"
    return tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens)


def special_term(tokenizer, vocab_size: int, text: str) -> Optional[str]:
    """`<[id]>`, the Lark term of `text` where the tokenizer has it as one
    added token (llguidance treats those as special: text cannot match one,
    a grammar must name the token), else None."""
    llg = llg_tokenizer(tokenizer, vocab_size)
    ids = llg.tokenize_str(text)
    return f"<[{ids[0]}]>" if len(ids) == 1 and llg.is_special_token(ids[0]) else None


def after_thinking(constraint: Constraint, tokenizer, vocab_size: int) -> Constraint:
    """`constraint` after a free reasoning: the think block runs on to the
    model's think-end, then the grammar applies."""
    if constraint.kind in ("json_schema", "json_object"):
        body = "body: " + json_term(json.loads(constraint.source))
    elif constraint.kind == "regex":
        body = "body: /" + constraint.source.replace("/", "\\/") + "/"
    else:  # a Lark grammar: its start rule becomes the body
        body = re.sub(r"^(\s*)start(\s*:)", r"\1body\2", constraint.source, count=1, flags=re.M)
    end = special_term(tokenizer, vocab_size, tokenizer.think_end)
    think = (f"think: /(?s:.*)/ {end}" if end else
             "think[lazy]: /(?s:.*)" + re.escape(tokenizer.think_end).replace("/", "\\/") + "/")
    return constrain(grammar=f"start: think {AFTER_THINKING} body\n{think}\n{body}\n")


def constrain(json_schema: Any = None, *, json_object: bool = False, regex: Optional[str] = None,
              grammar: Optional[str] = None) -> Constraint:
    """A constraint for structured output; give exactly one of:

    json_schema: a JSON schema as a dict, as JSON text, or a pydantic model
        class; json_object=True: any JSON object (OpenAI's `json_object`);
    regex: the whole output matches it (Rust regex syntax);
    grammar: a Lark grammar (llguidance's dialect; `start` is the root).

    Raises ValueError, one line naming the problem, for an invalid input or a
    JSON-schema feature llguidance cannot enforce (e.g. `uniqueItems`,
    `oneOf`, an unknown `format`, `minProperties` where keys beyond
    `properties` may appear): those are refused, not ignored.
    """
    given = [name for name, value in (("json_schema", json_schema is not None),
                                      ("json_object", bool(json_object)),
                                      ("regex", regex is not None),
                                      ("grammar", grammar is not None)) if value]
    if len(given) != 1:
        raise ValueError("constrain() takes exactly one of json_schema, json_object=True, regex, "
                         f"grammar; got {', '.join(given) or 'none'}")
    kind = given[0]
    LLMatcher = _llguidance().LLMatcher
    if kind in ("json_schema", "json_object"):
        schema = schema_dict(json_schema) if kind == "json_schema" else {"type": "object"}
        _refuse_repeatable_counts(schema)
        source = json.dumps(schema)
        definition = LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS,
                                                        overrides=JSON_OVERRIDES)
    elif kind == "regex":
        if not isinstance(regex, str):
            raise ValueError(f"regex must be a string, not {type(regex).__name__}")
        source, definition = regex, LLMatcher.grammar_from_regex(regex)
    else:
        if not isinstance(grammar, str):
            raise ValueError(f"grammar must be Lark text, not {type(grammar).__name__}")
        source, definition = grammar, LLMatcher.grammar_from_lark(grammar)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(definition)
    if is_error:
        raise ValueError(f"cannot use this {_LABEL[kind]}: {_one_line(messages[0], kind)}")
    return Constraint(kind, source, definition)


def json_term(json_schema: Any = None, *, json_object: bool = False) -> str:
    """A JSON schema as a term of a Lark grammar (llguidance's `%json {...}`),
    for grammars that embed JSON (a tool call's arguments, an answer after a
    model's reasoning): checked and refused as `constrain(json_schema=...)`
    does (ValueError, one line), written with the same layout (json.dumps'
    separators) and the same refusal of unimplemented keywords (the options
    go in the schema's `x-guidance`: our defaults, the schema's own, then
    `lenient: false`). json_object=True: any JSON object."""
    schema = {"type": "object"} if json_object else schema_dict(json_schema)
    if not json_object:
        constrain(json_schema=schema)  # its refusals, in its words
    own = schema.get("x-guidance")
    options = {**JSON_OPTIONS, **(own if isinstance(own, dict) else {}), **JSON_OVERRIDES}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def schema_dict(json_schema) -> dict:
    """A JSON schema as a dict, from a dict, JSON text or a pydantic model class,
    checked against its metaschema (jsonschema) for a standard message."""
    pydantic = sys.modules.get("pydantic")  # a pydantic class means pydantic is imported
    if pydantic is not None and isinstance(json_schema, type) and issubclass(
            json_schema, pydantic.BaseModel):
        schema = json_schema.model_json_schema()
    elif isinstance(json_schema, (str, bytes)):
        try:
            schema = json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    else:
        schema = json_schema
    if not isinstance(schema, dict):
        raise ValueError("json_schema must be a JSON object (a dict, its JSON text or a pydantic "
                         f"model class), not {type(schema).__name__}")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"invalid JSON schema{' at ' + where if where else ''}: "
                         f"{e.message}") from None
    return schema


# Where a JSON schema holds subschemas: keyword -> how (one schema, a list,
# or a name -> schema map). Only these are walked, so a property *named*
# like a keyword is not taken for one.
_SUBSCHEMAS = {
    **dict.fromkeys(("additionalProperties", "items", "additionalItems", "contains", "not", "if",
                     "then", "else", "propertyNames", "unevaluatedProperties",
                     "unevaluatedItems"), "one"),
    **dict.fromkeys(("prefixItems", "allOf", "anyOf", "oneOf"), "list"),
    **dict.fromkeys(("properties", "patternProperties", "$defs", "definitions",
                     "dependentSchemas"), "map"),
}


def _refuse_repeatable_counts(schema, where: str = "") -> None:
    """ValueError for a `minProperties` that needs two or more keys beyond
    the required `properties` (from `patternProperties`, or
    `additionalProperties` other than false): llguidance's grammar counts the
    keys written and cannot keep those distinct, so `{"x_a": 0, "x_a": 1}`
    counts two and parses as one, under the minimum. (One such key cannot
    repeat; `maxProperties` holds, as repeats only lower the parsed count.)
    Every subschema is checked."""
    if not isinstance(schema, dict):
        return
    listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    open_keys = bool(schema.get("patternProperties")) or \
        schema.get("additionalProperties", True) is not False
    required = set(schema.get("required") or ()) & set(listed)
    if open_keys and schema.get("minProperties", 0) > len(required) + 1:
        raise ValueError(
            f"cannot use this JSON schema: minProperties at {where or '/'} needs several keys "
            "beyond the required 'properties' (from patternProperties or additionalProperties), "
            "which the grammar cannot keep distinct: a repeated key would parse as one")
    for key, how in _SUBSCHEMAS.items():
        value = schema.get(key)
        if how == "one":
            subs = [(key, value)]
        elif how == "list":
            subs = [(f"{key}/{i}", v) for i, v in enumerate(value)] \
                if isinstance(value, list) else []
        else:
            subs = [(f"{key}/{k}", v) for k, v in value.items()] if isinstance(value, dict) else []
        for at, sub in subs:
            _refuse_repeatable_counts(sub, f"{where}/{at}")


def _one_line(message: str, kind: str) -> str:
    """llguidance's message on one line: source excerpts and caret lines dropped
    (regex errors echo the pattern under a caret; Lark errors quote the line)."""
    kept, skipping_echo = [], False
    for line in message.splitlines():
        text = line.strip()
        if skipping_echo and not text.startswith("error:"):
            continue
        skipping_echo = False
        if not text or set(text) <= {"^", " "} or re.match(r"\d+ \|", text):
            continue
        if text.startswith("error:") and kept and kept[-1].endswith("parse error:"):
            text = text[len("error:"):].strip()
        kept.append(text)
        skipping_echo = text.endswith("regex parse error:")
    line = " ".join(kept)
    if kind == "regex":  # the regex was wrapped in `start: /.../`: its positions mean nothing
        line = re.sub(r"^at \d+\(\d+\): ", "", line).replace(" (in regex)", "")
    return line


# One llguidance tokenizer per (tokenizer, logits width): building one walks
# the whole vocabulary (~0.1 s at 4K tokens, seconds at 248K).
_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer under mlx_lm's TokenizerWrapper (or itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def tokenizer_vocab_size(tokenizer) -> int:
    """Tokens the tokenizer knows, its added tokens included."""
    return len(_hf_tokenizer(tokenizer))


def stop_token_ids(tokenizer) -> List[int]:
    """What ends a row: mlx_lm's `eos_token_ids` (a set), else the HF eos id."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = [_hf_tokenizer(tokenizer).eos_token_id]
    return sorted(int(i) for i in ids if i is not None)


def llg_tokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer for `tokenizer` with masks `vocab_size` wide,
    its stop tokens mlx_lm's (cached per tokenizer object)."""
    per_width = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab_size not in per_width:
        from llguidance.hf import from_tokenizer

        hf = _hf_tokenizer(tokenizer)
        known = tokenizer_vocab_size(tokenizer)
        if vocab_size < known:
            raise ValueError(f"the model's vocabulary ({vocab_size}) is smaller than its "
                             f"tokenizer's ({known} tokens)")
        try:
            per_width[vocab_size] = from_tokenizer(hf, n_vocab=vocab_size,
                                                   eos_token=stop_token_ids(tokenizer))
        except ValueError as e:
            raise ValueError(f"structured output needs a fast (tokenizers) tokenizer: {e}") from None
    return per_width[vocab_size]


_SPECIALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _special_tokens(tokenizer, vocab_size: int) -> np.ndarray:
    """The ids llguidance treats as special tokens (every added token of the
    HF tokenizer, `<think>` and `<tool_call>` included, whether or not the
    tokenizer calls it special), stop tokens left out; cached like
    `llg_tokenizer`."""
    per_width = _SPECIALS.setdefault(tokenizer, {})
    if vocab_size not in per_width:
        tok = llg_tokenizer(tokenizer, vocab_size)
        added = getattr(_hf_tokenizer(tokenizer), "added_tokens_decoder", None) or {}
        stops = set(tok.eos_tokens)
        per_width[vocab_size] = np.array(sorted(
            i for i in added if i < vocab_size and i not in stops and tok.is_special_token(i)),
            dtype=np.int64)
    return per_width[vocab_size]


def warm_up(tokenizer, vocab_size: int):
    """Build and cache what matchers for `tokenizer` at this logits width
    need (llguidance's tokenizer walks the vocabulary: 0.07 s at 4K tokens,
    8-10 s at 248K): a server calls it once at start, in the background."""
    _special_tokens(tokenizer, vocab_size)


_EXECUTOR = None


def _executor():
    """llguidance's thread pool: computes the rows of a batch in parallel."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = _llguidance().LLExecutor()
    return _EXECUTOR


class Matcher:
    """One row's place in its grammar.

    vocab_size is the logits' width (the model's vocabulary, which may be
    padded beyond the tokenizer's: padded ids are never allowed); by default
    the tokenizer's size. Stop tokens are the tokenizer's `eos_token_ids`:
    they are allowed exactly where the grammar is complete (`accepting`),
    and are the only ones allowed once nothing can extend it (`must_stop`).
    The state only moves in `advance`; every query consumes and rolls back.
    """

    def __init__(self, constraint: Constraint, tokenizer, vocab_size: Optional[int] = None):
        llguidance = _llguidance()
        self.constraint = constraint
        self.vocab_size = int(vocab_size or tokenizer_vocab_size(tokenizer))
        self.words = (self.vocab_size + 31) // 32  # uint32 words per mask row
        tok = llg_tokenizer(tokenizer, self.vocab_size)
        self.stop_tokens = frozenset(tok.eos_tokens)
        self._llg_tokenizer = tok
        self._specials = _special_tokens(tokenizer, self.vocab_size)
        self._matcher = llguidance.LLMatcher(tok, constraint.grammar, log_level=0)
        self.finished = False  # a stop token was accepted: the row has ended
        self._raise_on_error()

    def _raise_on_error(self):
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._matcher.get_error()}")

    # -- state ---------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """The output so far is complete under the grammar: a stop token is allowed."""
        return self._matcher.is_accepting()

    @property
    def must_stop(self) -> bool:
        """Nothing can extend the output: only stop tokens are allowed next."""
        return not self.finished and self._matcher.is_stopped()

    def advance(self, tokens: Sequence[int]) -> "Matcher":
        """Consume tokens the decoder emitted (accepted drafts, then the trunk's
        token). A stop token ends the row (`finished`). A token the grammar does
        not allow is a bug in the caller (masked sampling never draws one):
        ValueError, and the matcher is left in an error state."""
        tokens = [int(t) for t in tokens]
        if tokens and self.finished:
            raise ValueError("the row already ended with a stop token")
        if any(t in self.stop_tokens for t in tokens[:-1]):
            raise ValueError("tokens follow a stop token")
        stop = tokens[-1:] if tokens and tokens[-1] in self.stop_tokens else []
        body = tokens[:len(tokens) - len(stop)]
        # A stop token goes in alone: llguidance 1.9's consume_tokens refuses
        # one once the grammar is complete, where consume_token takes it.
        if (body and not self._matcher.consume_tokens(body)) or (
                stop and not self._matcher.consume_token(stop[0])):
            raise ValueError(f"token not allowed by the grammar: {self._matcher.get_error()}")
        if stop:
            self.finished = True
        return self

    def rollback(self, n: int) -> "Matcher":
        """Undo the last n consumed tokens (a stop token cannot be undone)."""
        if n and self.finished:
            raise ValueError("cannot roll back past a stop token")
        if n and not self._matcher.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {self._matcher.get_error()}")
        return self

    # -- masks ---------------------------------------------------------------

    def before_stop(self, tokens: Sequence[int]) -> list:
        """The tokens before the first stop token."""
        for i, t in enumerate(tokens):
            if t in self.stop_tokens:
                return list(tokens[:i])
        return list(tokens)

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows here, up to and excluding
        the first stop token (what follows a stop token is never decoded)."""
        drafts = [int(t) for t in self.before_stop(drafts)]
        return self._matcher.validate_tokens(drafts) if drafts else 0

    def masks(self, drafts: Sequence[int] = ()) -> Tuple[np.ndarray, int]:
        """Bitmasks of the k+1 verify positions after k drafts: row i is what
        the grammar allows after drafts[:i]. Returns (words [k+1, W] uint32,
        valid): rows past `valid` follow a draft the grammar refuses (or a stop
        token) and repeat the last valid row; decoding never reaches them."""
        words, valid = batch_masks([(self, drafts)], len(drafts) + 1)
        return words[0], valid[0]

    def mask(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """The bitmask [W] after `drafts` (a masked head's next draft position).
        ValueError if the grammar does not allow the drafts."""
        words, valid = self.masks(drafts)
        if valid != len(drafts) + 1:
            raise ValueError(f"draft {valid - 1} is not allowed by the grammar")
        return words[-1]

    def forced(self, limit: int = 64) -> List[int]:
        """The tokens decoding must take from here: each the only token its
        mask allows, up to `limit`. Plain masked decoding draws exactly these
        (a one-token mask leaves no choice), so a decoder may emit them
        without a forward. A lone stop token ends the run (and the row).

        Not llguidance's fast-forward tokens: those tokenize the forced text
        one way, where the mask still allows others (see fast_forward_tokens).
        """
        run = []
        try:
            while len(run) < limit:
                words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32).copy()
                _drop_refused_specials(words, self, ())
                if int(np.bitwise_count(words).sum()) != 1:
                    break
                word = int(np.flatnonzero(words)[0])
                token = word * 32 + int(words[word]).bit_length() - 1
                run.append(token)
                if token in self.stop_tokens:
                    break  # not consumed: llguidance's rollback past a stop token is unreliable
                if not self._matcher.consume_token(token):
                    self._raise_on_error()
        finally:
            consumed = len(run) - (1 if run and run[-1] in self.stop_tokens else 0)
            if consumed:
                self._matcher.rollback(consumed)
        return run

    def fast_forward_tokens(self) -> List[int]:
        """llguidance's tokenization of the text the grammar forces from here.
        Good drafts (the verify decides); not exact to emit unverified, since
        the mask may also allow other tokenizations of that text."""
        return self._matcher.compute_ff_tokens()


def batch_masks(rows: Sequence[Tuple[Matcher, Sequence[int]]],
                positions: int) -> Tuple[np.ndarray, List[int]]:
    """Verify masks for a batch, computed in parallel (llguidance's executor):
    for each (matcher, drafts), the bitmasks after drafts[:i] for i < positions.
    Returns (words [len(rows), positions, W] uint32, valid per row); see
    `Matcher.masks`. Every matcher ends where it started."""
    words_per_row = {m.words for m, _ in rows}
    if len(words_per_row) > 1:
        raise ValueError("rows of one batch must share the vocabulary width")
    width = words_per_row.pop() if rows else 0
    out = np.zeros((len(rows), positions, width), dtype=np.int32)  # llguidance fills int32
    with_drafts, without, valid = [], [], []
    for r, (matcher, drafts) in enumerate(rows):
        n = min(matcher.allowed_drafts(drafts), positions - 1)
        valid.append(n + 1)
        # Only allowed, non-stop drafts go in: the executor consumes and rolls
        # back each row's drafts, and its rows after a refused one are unwritten.
        if n:
            with_drafts.append((matcher._matcher, r * positions, [int(t) for t in drafts[:n]]))
        else:  # the draft variant refuses an empty draft list
            without.append((matcher._matcher, r * positions))
    total = len(rows) * positions
    if with_drafts:
        _executor().unsafe_compute_mask_ptr_with_draft_token(
            with_drafts, out.ctypes.data, width * 4, total)
    if without:
        _executor().unsafe_compute_mask_ptr(without, out.ctypes.data, width * 4, total)
    words = out.view(np.uint32)
    # special tokens llguidance allowed (rarely any), per tokenizer, looked up at once
    for specials in {id(m._specials): m._specials for m, _ in rows if m._specials.size}.values():
        set_bits = (words[..., specials >> 5] >> (specials & 31).astype(np.uint32)) & 1
        for r, i in {(int(r), int(i)) for r, i, _ in np.argwhere(set_bits)}:
            matcher, drafts = rows[r]
            if matcher._specials is specials and i < valid[r]:
                _drop_refused_specials(words[r, i], matcher, drafts[:i])
    for r, n in enumerate(valid):
        out[r, n:] = out[r, n - 1]
    for matcher, _ in rows:
        matcher._raise_on_error()
    return words, valid


def _drop_refused_specials(words: np.ndarray, matcher: Matcher, prefix: Sequence[int]):
    """Make one mask row (after `prefix` from the matcher's state) allow
    exactly what the parser accepts where llguidance 1.9.1's does not: where
    the grammar forces text that an added token spells (a regex `<tool_call>x`
    on a tokenizer with a `<tool_call>` token, which llguidance treats as
    special), its mask allows that token alone and consuming it fails
    (llguidance issue #366's family; outlines #1771). A decoder would emit it
    forever. Here such special tokens are cleared; a row left empty is
    rebuilt token by token from the parser (`validate_tokens` over the
    vocabulary: ~1 µs a token, only at such a position). Only the few
    special ids are looked at otherwise; a set one costs one validate."""
    specials = matcher._specials
    if not specials.size:
        return
    set_bits = ((words[specials >> 5] >> (specials & 31).astype(np.uint32)) & 1).astype(bool)
    if not set_bits.any():
        return
    prefix = [int(t) for t in prefix]
    validate, n = matcher._matcher.validate_tokens, len(prefix) + 1
    cleared = False
    for t in specials[set_bits]:
        if validate(prefix + [int(t)]) != n:
            words[t >> 5] &= np.uint32(~(1 << int(t & 31)) & 0xFFFFFFFF)
            cleared = True
    if cleared and not words.any():
        skip = set(specials.tolist()) | matcher.stop_tokens
        for t in range(matcher.vocab_size):
            if t not in skip and validate(prefix + [t]) == n:
                words[t >> 5] |= np.uint32(1 << (t & 31))


# -- device side ---------------------------------------------------------------

_BIT = None


def unpack_bitmask(words: mx.array, vocab_size: int) -> mx.array:
    """Packed masks [..., W] (uint32 or int32) -> bool [..., vocab_size], on
    the device: a 32x smaller upload than a bool mask (31 KB a row at 248K)."""
    global _BIT
    if _BIT is None:
        _BIT = mx.arange(32, dtype=mx.uint32)
    bits = mx.right_shift(words.astype(mx.uint32)[..., None], _BIT) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(mx.bool_)


def apply_bitmask(logits: mx.array, words: mx.array) -> mx.array:
    """Logits with -inf wherever the packed mask disallows the token."""
    allowed = unpack_bitmask(words, logits.shape[-1])
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


class MaskingProcessor:
    """An mlx_lm logits processor, `(tokens, logits) -> logits`, that applies
    the constraint to one row: -inf wherever the grammar refuses the token.

    It follows the history it is given rather than assuming it only grows: the
    first call's history is the prompt, and each call rolls the matcher back
    to the longest prefix it shares with the generated part, then consumes the
    rest. So it is plain constrained decoding under mlx_lm's generate_step,
    and stays exact where a speculative decoder calls it at each draft and
    verify position with a history that includes drafts later rejected.
    Generated tokens past one the grammar refuses, or past a stop token, are
    never emitted: their logits get the mask of the last state reached.
    The matcher (`.matcher`) is made on the first call, as wide as the logits.
    """

    def __init__(self, constraint: Constraint, tokenizer):
        self.constraint = constraint
        self.tokenizer = tokenizer
        self.matcher: Optional[Matcher] = None
        self._prompt = 0
        self._consumed: List[int] = []  # generated tokens the matcher holds

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.matcher is None:
            self.matcher = Matcher(self.constraint, self.tokenizer, logits.shape[-1])
            self._prompt = tokens.size
        self._follow(tokens[self._prompt:].tolist())
        return apply_bitmask(logits, mx.array(self.matcher.mask()[None]))

    def _follow(self, generated: List[int]):
        shared = 0
        for a, b in zip(self._consumed, generated):
            if a != b:
                break
            shared += 1
        self.matcher.rollback(len(self._consumed) - shared)
        del self._consumed[shared:]
        new = generated[shared:]
        # stop tokens stay out (rolling one back is unreliable in llguidance 1.9)
        n = self.matcher.allowed_drafts(new)
        self.matcher.advance(new[:n])
        self._consumed += new[:n]
