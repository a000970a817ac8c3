"""Request schemas and validation: the fields mlx_lm.server reads, and the
OpenAI fields a client may send that do not change the output here; anything
else is refused. The numeric ones (ranges, 'auto', null) are made from the
table in params.py. `ApiError` is how every refusal travels to the handler."""

from __future__ import annotations

from typing import Optional

import jsonschema

from .. import params
from . import anthropic

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
    "n": {"const": 1},
    "user": {"type": "string"},
    "metadata": {}, "store": {}, "service_tier": {},
}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"type": ["string", "array", "null"]},
                   "name": {"type": "string"}, "tool_calls": {"type": "array"},
                   "tool_call_id": {"type": "string"}, "reasoning_content": {},
                   "reasoning": {}, "refusal": {}},
    "additionalProperties": False,
}
CHAT_SCHEMA = {
    "type": "object", "required": ["messages"],
    "properties": dict(_COMMON, messages={"type": "array", "minItems": 1, "items": _MESSAGE},
                       tools={"type": ["array", "null"], "items": {"type": "object"}},
                       tool_choice={}, parallel_tool_calls={}, response_format={},
                       reasoning_effort={}, chat_template_kwargs={"type": ["object", "null"]},
                       role_mapping={"type": ["object", "null"]}),
    "additionalProperties": False,
}
COMPLETION_SCHEMA = {
    "type": "object", "required": ["prompt"],
    "properties": dict(_COMMON, prompt={"type": "string", "minLength": 1}, echo={"const": False},
                       suffix={"type": "null"}, best_of={"const": 1}),
    "additionalProperties": False,
}


class ApiError(Exception):
    """A request answered with an error: HTTP status, OpenAI error type, message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def openai(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}

    def anthropic(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 503: "overloaded_error"}.get(self.status, "api_error")
        return anthropic.error_body(kind, str(self))


def _schema_error(e: jsonschema.ValidationError) -> ApiError:
    where = ".".join(str(p) for p in e.absolute_path) or None
    if e.validator == "additionalProperties":
        extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
        where = ".".join([*(str(p) for p in e.absolute_path), extra[0]]) if extra else where
        return ApiError(400, f"unknown field {where!r}", param=where)
    message = e.message if where is None else f"{where}: {e.message}"
    return ApiError(400, message, param=where)


def validate(body: dict, schema: dict, surface: str):
    """The request body against its JSON schema (jsonschema); a field of the
    parameter table (params.py) is refused in the table's words (name, value,
    what is allowed). surface: "openai" or "anthropic"."""
    error = jsonschema.exceptions.best_match(params.Validator(schema).iter_errors(body))
    if error is None:
        return params.coerce(surface, body)
    path = list(error.absolute_path)
    if path and isinstance(path[0], str):
        message = params.refusal(surface, path[0], body.get(path[0]))
        if message is not None:
            raise ApiError(400, message, param=path[0])
    raise _schema_error(error)


