"""Request schemas and validation: the fields mlx_lm.server reads, the
OpenAI fields a client may send that do not change the output here, and
those refused because ignoring them would (`REFUSED`). Any other field is
ignored with a warning, once per field name (`ignore_unknown`): SDKs and
agents newer than this server send fields it does not know, and mlx_lm.server
ignores them too. The numeric ones (ranges, 'auto', null) are made from the
table in params.py. `ApiError` is how every refusal travels to the handler.

Also here, the checks that need no model: the body as JSON (`parse_json`:
nesting, NaN, lone surrogates) and the characters a prompt holds verbatim
(`prompt_chars`), which bound its tokens from below before anything is
tokenized. `response_format` and `tool_choice` are read in structured.py."""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Iterable, Optional, Tuple

import jsonschema

from .. import params

_NUMBER = {"type": "number"}
_COMMON = {
    **params.schema("openai"),
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": ["object", "null"],
                       "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {"type": ["string", "array", "null"], "items": {"type": "string"}},
    "logit_bias": {"type": ["object", "null"], "additionalProperties": _NUMBER},
    "logprobs": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 1},  # (at most --decode-concurrency: handler.py)
    "user": {"type": "string"},
    "metadata": {}, "store": {}, "service_tier": {},
    # what does not change an answer here: predicted outputs only speed up an
    # answer they match; the others name what OpenAI's own models do around one
    "prediction": {}, "modalities": {"type": ["array", "null"], "items": {"const": "text"}},
    "prompt_cache_key": {}, "safety_identifier": {}, "verbosity": {}, "web_search_options": {},
}
# Fields whose value would change the answer if ignored: refused (400 naming
# the field) unless they ask for nothing (null, or the value in the schema).
REFUSED = {
    "adapters": "adapters are not supported (MTP decoding runs the model as loaded)",
    "audio": "audio output is not supported (the model writes text)",
    "functions": "the legacy 'functions' field is not supported: send 'tools'",
    "function_call": "the legacy 'function_call' field is not supported: send 'tool_choice'",
}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"type": ["string", "array", "null"]},
                   "name": {"type": "string"}, "tool_calls": {"type": "array"},
                   "tool_call_id": {"type": "string"}, "reasoning_content": {},
                   "reasoning": {}, "refusal": {}},
}
CHAT_SCHEMA = {
    "type": "object", "required": ["messages"],
    "properties": dict(_COMMON, messages={"type": "array", "minItems": 1, "items": _MESSAGE},
                       tools={"type": ["array", "null"], "items": {"type": "object"}},
                       tool_choice={}, parallel_tool_calls={}, response_format={},
                       reasoning_effort={}, chat_template_kwargs={"type": ["object", "null"]},
                       role_mapping={"type": ["object", "null"]}),
}
COMPLETION_SCHEMA = {
    "type": "object", "required": ["prompt"],
    "properties": dict(_COMMON, prompt={"type": "string", "minLength": 1}, echo={"const": False},
                       suffix={"type": "null"}, best_of={"const": 1}),
}


class ApiError(Exception):
    """A request answered with an error: HTTP status, OpenAI error type,
    message (`anthropic_message`: another wording on /v1/messages, where
    clients parse Anthropic's own)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 anthropic_message: Optional[str] = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.anthropic_message = anthropic_message

    def openai(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}

    def anthropic(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                503: "overloaded_error"}.get(self.status)
        if kind is None:
            kind = "invalid_request_error" if self.status < 500 else "api_error"
        return {"type": "error", "error": {"type": kind,
                                           "message": self.anthropic_message or str(self)}}


def context_exceeded(prompt_tokens: int, max_tokens: int, context: int, param: str,
                     chars: Optional[int] = None) -> ApiError:
    """A prompt and max_tokens past the model's context, in the words each
    API's clients parse: OpenAI's `context_length_exceeded`; Anthropic's
    "prompt is too long: N tokens > C maximum" (Claude Code compacts) or, if
    the prompt alone fits, "input length and `max_tokens` exceed context
    limit: N + M > C" (Claude Code asks again with a smaller max_tokens).
    `chars`: the prompt was not tokenized; `prompt_tokens` is the fewest
    tokens its characters can make."""
    counted = "" if chars is None else \
        f" (at least: counted from its {chars} characters before tokenizing)"
    if prompt_tokens >= context:
        anthropic = f"prompt is too long: {prompt_tokens} tokens > {context} maximum"
    else:
        anthropic = (f"input length and `max_tokens` exceed context limit: {prompt_tokens} + "
                     f"{max_tokens} > {context}, decrease input length or `max_tokens` and try "
                     "again")
    openai = (f"This model's maximum context length is {context} tokens. However, you requested "
              f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
              f"{max_tokens} in the completion). Please reduce the length of the messages or "
              "completion.")
    return ApiError(400, openai + counted, param=param, code="context_length_exceeded",
                    anthropic_message=anthropic + counted)


def max_tokens_exceeded(field: str, value: int, limit: int, model: str) -> ApiError:
    """max_tokens over --max-tokens-limit, in the words each API's clients
    parse (Claude Code lowers its max_tokens to the limit Anthropic's names)."""
    return ApiError(400, f"{field} is too large: {value}. This model supports at most {limit} "
                         f"completion tokens (--max-tokens-limit), whereas you provided {value}.",
                    param=field, code="invalid_value",
                    anthropic_message=f"{field}: {value} > {limit}, which is the maximum allowed "
                                      f"number of output tokens for {model}")


def _schema_error(e: jsonschema.ValidationError) -> ApiError:
    where = ".".join(str(p) for p in e.absolute_path) or None
    if e.validator == "additionalProperties":
        extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
        where = ".".join([*(str(p) for p in e.absolute_path), extra[0]]) if extra else where
        return ApiError(400, f"unknown field {where!r}", param=where)
    message = e.message if where is None else f"{where}: {e.message}"
    return ApiError(400, message, param=where)


_warned: set = set()
_warned_lock = threading.Lock()
WARNED_KEYS = 1024  # distinct warnings kept (their keys are names clients choose)


def warn_once(key, message: str, level: int = logging.WARNING):
    """Log `message` the first time `key` is seen (a client sends the same
    unknown field with every request); past WARNED_KEYS distinct keys, no
    new ones are logged."""
    with _warned_lock:
        if key in _warned or len(_warned) > WARNED_KEYS:
            return
        _warned.add(key)
        if len(_warned) > WARNED_KEYS:
            message = f"{WARNED_KEYS} distinct warnings about what clients send: no more are logged"
    logging.log(level, message)


class RequestError(ValueError):
    """A request a converter (anthropic.py, responses.py) cannot take
    without losing part of it: a 400 naming `param`."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def ignore_unknown(body: dict, schema: dict, surface: str, refused: Optional[dict] = None):
    """Drop the fields `schema` does not name (at the top, and in each
    message where the schema names a message's fields), with a warning once
    per name; refuse those of `refused` ({field: why}; OpenAI's: REFUSED)
    that ask for something."""
    refused = (REFUSED if surface == "openai" else {}) if refused is None else refused
    for field, why in refused.items():
        if body.get(field) not in (None, [], {}):
            raise ApiError(400, f"{field}: {why}", param=field)
    known = schema.get("properties", {})
    for field in [f for f in body if f not in known]:
        if body.pop(field) is not None:
            warn_once((surface, field), f"{surface} requests: the field {field!r} is not "
                                        "known here and is ignored")
    items = known.get("messages", {}).get("items", {})
    fields = items.get("properties")
    if fields is None or not isinstance(body.get("messages"), list):
        return
    for m in body["messages"]:
        for field in [f for f in m if f not in fields] if isinstance(m, dict) else ():
            if m.pop(field) is not None:
                warn_once((surface, "messages", field), f"{surface} requests: the message "
                          f"field {field!r} is not known here and is ignored")


def validate(body: dict, schema: dict, surface: str, refused: Optional[dict] = None):
    """The request body against its JSON schema (jsonschema), its unknown
    fields ignored (`ignore_unknown`); a field of the parameter table
    (params.py) is refused in the table's words (name, value, what is
    allowed). surface: "openai", "anthropic" or "responses"."""
    ignore_unknown(body, schema, surface, refused)
    table = "openai" if surface == "responses" else surface  # (OpenAI's numeric fields)
    error = jsonschema.exceptions.best_match(params.Validator(schema).iter_errors(body))
    if error is None:
        return params.coerce(table, body)
    path = list(error.absolute_path)
    if path and isinstance(path[0], str):
        message = params.refusal(table, path[0], body.get(path[0]))
        if message is not None:
            raise ApiError(400, message, param=path[0])
    raise _schema_error(error)




def extension_args(body: dict) -> dict:
    """The server's own request fields (params.EXTENSIONS: num_draft_tokens)
    as mlx_lm.server's GenerationArguments names them (alike), from a
    checked body: what /v1/messages and /v1/responses pass on, as mlx_lm's
    handler does on chat and completions."""
    return {field: body.get(field) for field in params.EXTENSIONS}


def generation_failed(e: BaseException, status: int = 500) -> ApiError:
    """The error of a generation that failed with `e` (one wording for every
    endpoint and stream)."""
    return ApiError(status, f"the generation failed: {type(e).__name__}: {e}", kind="server_error")


def shutdown_error(grace: float) -> ApiError:
    """What a request still running when the server stops is answered with."""
    return ApiError(503, f"the server shut down before this request finished (it waited "
                         f"{grace:g} s for it: --shutdown-grace)", kind="server_error",
                    code="server_shutdown")


# -- the body --------------------------------------------------------------------------------
def _not_json(name: str):
    """json.loads' parse_constant: NaN and Infinity are not JSON (RFC 8259)."""
    raise ValueError(f"{name} is not a JSON number")


def utf8(raw: bytes) -> str:
    """A request body's text: JSON is UTF-8 (RFC 8259)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start})") from None


def parse_json(text: str) -> dict:
    """A request body as a JSON object: no NaN or Infinity, nested no deeper
    than json's recursion limit, every string valid Unicode (no lone
    surrogate, which JSON's \\u escapes can spell and no tokenizer takes).
    Anything else is a 400 saying which."""
    try:
        body = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ApiError(400, "the request body nests JSON arrays or objects too deeply") from None
    except ValueError as e:  # (JSONDecodeError is a ValueError)
        raise ApiError(400, f"invalid JSON in the request body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    bad = lone_surrogate(body)
    if bad is not None:
        where, at, char = bad
        raise ApiError(400, f"{where or 'a key'}: a lone surrogate ({char!a}) at character {at}: "
                            "not Unicode text", param=where)
    return body


def lone_surrogate(value) -> Optional[Tuple[str, int, str]]:
    """The first string (key or value) in a parsed JSON value that is not
    valid Unicode: (its path, e.g. "messages.0.content", the index, the
    character); None if there is none."""
    stack = [(value, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                path = f"{where}.{k}" if where else str(k)
                bad = _bad_char(k)
                if bad is not None:
                    return (where, *bad)
                stack.append((item, path))
        elif isinstance(v, list):
            stack.extend((item, f"{where}.{i}" if where else str(i)) for i, item in enumerate(v))
        elif isinstance(v, str):
            bad = _bad_char(v)
            if bad is not None:
                return (where, *bad)
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")  # (only a lone one survives json.loads)


def _bad_char(s: str) -> Optional[Tuple[int, str]]:
    found = _SURROGATE.search(s)  # (no copy of the string, unlike encoding it)
    return None if found is None else (found.start(), found.group())


# -- the prompt's size, before tokenizing --------------------------------------------------------
# Roles whose text chat templates render verbatim (an assistant turn's text
# may be rewritten: Qwen's templates drop the reasoning of earlier turns).
VERBATIM_ROLES = ("system", "developer", "user", "tool")
# Unicode normalization (NFC) can fold up to 4 code points into one (a Greek
# letter with three combining marks): a token's text covers at most this many
# times its own length of the input.
NORMALIZATION_FOLD = 4


def prompt_chars(prompt: Optional[str], messages: Iterable[dict]) -> int:
    """Characters of text the rendered prompt holds verbatim: a completion's
    prompt, or the chat messages of the roles above (their text parts), each
    stripped of surrounding whitespace (templates may trim it)."""
    if prompt:
        return _stripped_len(prompt)
    n = 0
    for m in messages:
        if m.get("role") not in VERBATIM_ROLES:
            continue
        content = m.get("content")
        if isinstance(content, str):
            n += _stripped_len(content)
        elif isinstance(content, list):
            n += sum(_stripped_len(p["text"]) for p in content
                     if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def _stripped_len(s: str) -> int:
    """len(s.strip()), copying the string only when it has whitespace to strip."""
    return len(s.strip()) if s[:1].isspace() or s[-1:].isspace() else len(s)


def most_chars(tokens: int, max_token_chars: int) -> int:
    """The most characters of input `tokens` tokens can hold."""
    return tokens * max_token_chars * NORMALIZATION_FOLD
