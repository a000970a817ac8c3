"""Structured output in the server: OpenAI's `response_format` (json_object,
json_schema), Anthropic's `output_config.format`, and forced tool calls
(OpenAI's `tool_choice` "required" or a named function, Anthropic's
{"type": "any"} / {"type": "tool"}) become one grammar per request, which
its row holds (Batch.prepare's constraint: lane.py). docs/design.md,
"Structured output".

`openai(body, tokenizer)` / `anthropic(body, tools, tokenizer)` read and
check a request (ApiError 400 naming the field: a schema that is invalid or
uses a keyword llguidance cannot enforce, a tool_choice naming no tool) and
return what its output must be (`Wanted`), or None; `constraint(wanted,
tokenizer, initial_state)` compiles it once the prompt is rendered.

Tool calls are the text the model's chat template writes and mlx_lm's tool
parser reads, per the parser mlx_lm chose for the tokenizer:
`json_tools` (Qwen3, Qwen3-Next): `<tool_call>\\n{"name": N, "arguments":
{...}}\\n</tool_call>`, the arguments a `%json` of the tool's `parameters`;
`qwen3_coder` (Qwen3.5, Qwen3.6): `<tool_call>\\n<function=N>\\n<parameter=P>\\n
value\\n</parameter>\\n...</function>\\n</tool_call>`, each value as that
parser converts it back (a string raw, anything else JSON). Several calls
(OpenAI "required", Anthropic "any", unless parallel calls are off) are
separated by a newline. Thinking follows the one rule of
`constraint.thinking_args` (off unless asked for); where the rendered prompt
still leaves the model inside its thinking block, the reasoning is free up
to the model's think-end and the grammar applies after it (`row_matcher`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..constraint import (Constraint, constrain, json_term, schema_dict, special_term,
                          thinking_args)
from ..mlx_lm_compat import tool_call_format
from .lane import extras
from .schemas import ApiError

# mlx_lm's tool parsers whose calls can be constrained (`tool_call_format`)
TOOL_FORMATS = ("json_tools", "qwen3_coder")


class ReasoningBudget:
    """An mlx_lm logits processor that ends a reasoning once `budget` tokens
    were generated: from there only the think-end's tokens are allowed, in
    turn, until they are written (`thinking_for_grammar`; the grammar's think
    rule ends there). It reads the history alone, as the grammar's
    MaskingProcessor does, so speculative decoding under it stays exact
    (llguidance's own max_tokens= rules cannot roll back)."""

    def __init__(self, tokenizer, prompt_tokens: int, budget: int):
        self.tokenizer, self.prompt, self.budget = tokenizer, prompt_tokens, budget

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size - self.prompt < self.budget:
            return logits
        generated = tokens[self.prompt:].tolist()
        end = self.tokenizer.think_end_tokens
        written = len(generated) - self.budget  # of `end`, forced since the budget ran out
        if self.tokenizer.find_think_end(generated) >= 0 or written >= len(end):
            return logits
        allowed = mx.arange(logits.shape[-1]) == end[written]
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


@dataclass(frozen=True)
class Wanted:
    """What a request's output must be (after any reasoning): `answer`, the
    Lark rules of a JSON answer (response_format) or None; `calls`, those of
    its tool calls or None; `forced`: calls only (else either);
    `reasoning_budget`: the tokens a reasoning before them may take (None:
    unbounded; `thinking_for_grammar`)."""

    answer: Optional[str] = None
    calls: Optional[str] = None
    forced: bool = False
    reasoning_budget: Optional[int] = None


# -- OpenAI ----------------------------------------------------------------------------------
def openai(body: dict, tokenizer, vocab_size: int) -> Optional[Wanted]:
    """A chat request's `response_format` and `tool_choice`, checked; None
    when the output is free."""
    answer = _response_format(body.get("response_format"))
    choice = body.get("tool_choice")
    tools = body.get("tools") or []
    functions = _openai_functions(tools)  # (checked whatever tool_choice is)
    forced = choice not in (None, "auto", "none")
    if forced:
        named = (isinstance(choice, dict) and choice.get("type") == "function"
                 and isinstance(choice.get("function"), dict)
                 and isinstance(choice["function"].get("name"), str))
        if choice != "required" and not named:
            raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or {'type': "
                                f"'function', 'function': {{'name': ...}}}}, not {choice!r}",
                           param="tool_choice")
        what = "required" if choice == "required" else choice["function"]["name"]
        check_forced(what, bool(tools), tokenizer.has_tool_calling, "tool_choice")
    if not forced and (answer is None or not tools or choice == "none"
                       or not tokenizer.has_tool_calling):
        return None if answer is None else Wanted(answer=answer)
    if forced and choice != "required":
        functions = _only(functions, choice["function"]["name"], "tool_choice.function.name")
    several = choice in ("required", "auto", None) and body.get("parallel_tool_calls") is not False
    calls = _calls(tokenizer, vocab_size, functions, several, "tool_choice" if forced else "tools")
    return Wanted(answer=None if forced else answer, calls=calls, forced=forced)


def _response_format(fmt) -> Optional[str]:
    """OpenAI's response_format as the Lark rules of the answer (`answer:`),
    or None for text."""
    param = "response_format"
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return f"answer: {json_term(json_object=True)}\n"
    if kind != "json_schema":
        raise ApiError(400, "response_format must be {'type': 'text'}, {'type': 'json_object'} "
                            "or {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': "
                            f"{{...}}, 'strict': ...}}}}, not {_short(fmt)}", param=param)
    spec = fmt.get("json_schema")
    param = "response_format.json_schema"
    if set(fmt) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise ApiError(400, f"{param} must be an object with 'name' and 'schema' (and "
                            "'description', 'strict')", param=param)
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ApiError(400, f"unknown field '{param}.{unknown[0]}'", param=f"{param}.{unknown[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ApiError(400, f"{param}.name must be 1 to 64 letters, digits, '_' or '-', not "
                            f"{_short(name)}", param=f"{param}.name")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ApiError(400, f"{param}.strict must be a boolean", param=f"{param}.strict")
    if "schema" not in spec:
        raise ApiError(400, f"{param}.schema is required (the JSON schema of the answer)",
                       param=f"{param}.schema")
    return f"answer: {_json(spec['schema'], f'{param}.schema')}\n"


def _openai_functions(tools) -> List[Tuple[str, dict]]:
    """(name, parameters schema) of each function tool of a chat request."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise ApiError(400, f"tools.{i}: a tool must be {{'type': 'function', 'function': "
                                "{'name': ..., 'parameters': {...}}}", param=f"tools.{i}")
        where = f"tools.{i}.function.parameters"
        out.append((fn["name"], _parameters(fn.get("parameters"), where)))
    return out


# -- Anthropic --------------------------------------------------------------------------------
def anthropic(body: dict, tools: Optional[Sequence[dict]], tokenizer,
              vocab_size: int) -> Optional[Wanted]:
    """A Messages request's `output_config.format` and forcing `tool_choice`
    (its shape checked by anthropic.check_tool_choice); `tools` as the chat
    path has them (anthropic.to_chat)."""
    answer = None
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is not None:
        param = "output_config.format"
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and "schema" in fmt
                and set(fmt) <= {"type", "schema"}):
            raise ApiError(400, f"{param} must be {{'type': 'json_schema', 'schema': {{...}}}}, "
                                f"not {_short(fmt)}", param=param)
        answer = f"answer: {_json(fmt['schema'], param + '.schema')}\n"
    choice = body.get("tool_choice") or {}
    kind = choice.get("type")
    forced = kind in ("any", "tool")
    functions = [(t["function"]["name"], _parameters(t["function"].get("parameters"),
                                                      f"tools.{i}.input_schema"))
                 for i, t in enumerate(tools or ())]  # (checked whatever tool_choice is)
    if not forced and (answer is None or not tools or kind == "none"
                       or not tokenizer.has_tool_calling):
        return None if answer is None else Wanted(answer=answer)
    if kind == "tool":
        functions = _only(functions, choice["name"], "tool_choice.name")
    several = kind != "tool" and not choice.get("disable_parallel_tool_use", False)
    calls = _calls(tokenizer, vocab_size, functions, several, "tool_choice" if forced else "tools")
    return Wanted(answer=None if forced else answer, calls=calls, forced=forced)


def thinking_for_grammar(wanted: Optional[Wanted], template_args: dict, defaults: dict,
                         has_thinking: bool, max_tokens: int,
                         budget: Optional[int] = None) -> Tuple[dict, Optional[Wanted]]:
    """(chat template arguments, what the output must be) of a request with a
    grammar, on a model that thinks: thinking is off unless asked for, the
    rule the API and the CLI follow too (`constraint.thinking_args`); a
    reasoning still left runs free before the grammar. A forced call's
    reasoning gets `budget` tokens (Anthropic's `thinking.budget_tokens`;
    else half of max_tokens), then it is ended (`ReasoningBudget`) and the
    call follows: a reasoning could otherwise take all of max_tokens."""
    if wanted is None or not has_thinking:
        return template_args, wanted
    template_args = thinking_args(template_args, defaults, has_thinking)
    if not wanted.forced:
        return template_args, wanted
    return template_args, replace(wanted, reasoning_budget=budget or max(1, max_tokens // 2))


def check_forced(what: str, has_tools: bool, tool_calling: bool, param: str):
    """A tool_choice that forces a call (OpenAI's 'required' or a named
    function, Anthropic's 'any' or 'tool') needs tools in the request and a
    chat template that can call them."""
    if not has_tools:
        raise ApiError(400, f"{param} forces a tool call ({what!r}) but the request has no tools",
                       param=param)
    if not tool_calling:
        raise ApiError(400, f"{param} forces a tool call ({what!r}), but this model's chat "
                            "template has no tool calling", param=param)


# -- the grammar ------------------------------------------------------------------------------
def constraint(wanted: Wanted) -> Constraint:
    """The request's grammar (where its prompt leaves the model thinking, the
    row's matcher starts it after the reasoning: `constraint.row_matcher`)."""
    if wanted.forced:
        body = "calls"
    else:
        body = " | ".join(name for name, rules in (("answer", wanted.answer),
                                                   ("calls", wanted.calls)) if rules)
    grammar = f"start: {body}\n" + (wanted.answer or "") + (wanted.calls or "")
    try:
        return constrain(grammar=grammar)
    except ValueError as e:  # (each part compiled on its own already: not the request's fault)
        raise ApiError(500, f"cannot compile the request's grammar: {e}",
                       kind="server_error") from None


def _calls(tokenizer, vocab_size: int, functions: List[Tuple[str, dict]], several: bool,
           param: str) -> str:
    """The Lark rules `calls:` (one call, or calls separated by newlines) of
    `functions` in the format of the model's tool parser."""
    fmt = tool_call_format(tokenizer)
    if fmt not in TOOL_FORMATS:
        hint = "" if param == "tool_choice" else (
            " (with response_format and tools, the answer may be either; tool_choice 'none' "
            "asks for the format alone)")
        raise ApiError(400, f"{param}: this server constrains tool calls in the formats of "
                            f"mlx_lm's {' and '.join(TOOL_FORMATS)} parsers; this model's is "
                            f"{fmt or 'unknown'}{hint}", param=param)
    markers = _Markers(tokenizer, vocab_size)
    start = markers.literal(tokenizer.tool_call_start)
    end = markers.literal(tokenizer.tool_call_end)
    more = ' ("\\n" call)*' if several else ""
    rules = [f"calls: call{more}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, (name, schema) in enumerate(functions):
        where = f"tools.{i}"
        if fmt == "json_tools":
            call = {"type": "object", "properties": {"name": {"const": name},
                                                     "arguments": schema},
                    "required": ["name", "arguments"], "additionalProperties": False}
            rules.append(f"call_{i}: {start} \"\\n\" call_{i}_json \"\\n\" {end}")
            rules.append(f"call_{i}_json: {_json(call, where + '.function.parameters')}")
        else:
            rules += _xml_call(i, name, schema, start, end, where, markers.literal)
    return "\n".join(rules) + "\n"


# The parser reads a value up to the first "</parameter>"; the text state
# machine leaves the call at "</tool_call>", and the parser wants the call to
# end with "</function>": a string value holds none of them. A value "null"
# (any case) reads as None.
_XML_STRING_EXCLUDED = r"~/(?s:.*)(<\/parameter>|<\/function>|<\/tool_call>)(?s:.*)/ & ~/(?i:null)/"
_XML_NAME = re.compile(r"[^\s<>]+")  # what the parser reads as a name
_XML_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description",
                    "title", "$schema", "$comment", "examples", "default"}
_XML_STRING_KEYS = {"type", "description", "title", "default", "examples", "$comment", "enum",
                    "const", "minLength", "maxLength"}
_XML_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")


def _xml_call(i: int, name: str, schema: dict, start: str, end: str, where: str,
              _literal) -> List[str]:
    """The rules of one `qwen3_coder` call: `<function=NAME>`, then each
    parameter in the schema's order (the required ones always, the others
    optionally), each value as mlx_lm's parser converts it back by the
    property's `type`: a string's text raw, any other type as JSON."""
    param = f"{where}.function.parameters"
    if not _XML_NAME.fullmatch(name):
        at = f"{where}.function.name"
        raise ApiError(400, f"{at}: this model's tool-call format cannot carry the name "
                            f"{name!r} (no spaces, '<' or '>')", param=at)
    extra = sorted(set(schema) - _XML_OBJECT_KEYS)
    if schema.get("type", "object") != "object" or extra:
        raise ApiError(400, f"{param}: this model's tool-call format (XML parameters) takes an "
                            "object of named properties; cannot force a call with "
                            f"{repr(extra[0]) if extra else 'type ' + repr(schema.get('type'))}",
                       param=param)
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    missing = sorted(set(required) - set(props))
    if missing:
        raise ApiError(400, f"{param}: required property {missing[0]!r} is not in 'properties'",
                       param=param)
    rules, parts = [], []
    for j, (pname, prop) in enumerate(props.items()):
        at = f"{param}.properties.{pname}"
        if not _XML_NAME.fullmatch(pname):
            raise ApiError(400, f"{at}: this model's tool-call format cannot carry the parameter "
                                f"name {pname!r} (no spaces, '<' or '>')", param=at)
        rule = f"call_{i}_p{j}"
        rules.append(f"{rule}: {_literal(f'<parameter={pname}>')} \"\\n\" {rule}_v "
                     f"\"\\n\" {_literal('</parameter>')} \"\\n\"")
        rules.append(_xml_value(f"{rule}_v", prop, at))
        parts.append(rule if pname in required else f"{rule}?")
    head = f"{start} \"\\n\" {_literal(f'<function={name}>')} \"\\n\""
    tail = f"{_literal('</function>')} \"\\n\" {end}"
    return [f"call_{i}: {head} {' '.join(parts)} {tail}", *rules]


def _xml_value(rule: str, prop, at: str) -> str:
    kind = prop.get("type") if isinstance(prop, dict) else None
    if kind not in _XML_TYPES:
        raise ApiError(400, f"{at}: this model's tool-call format converts a parameter by its "
                            "'type', which must be one of " + ", ".join(_XML_TYPES) +
                            f"; not {_short(kind)}", param=at)
    if kind != "string":
        return f"{rule}: {_json(prop, at)}"
    extra = sorted(set(prop) - _XML_STRING_KEYS)
    if extra:
        raise ApiError(400, f"{at}: this model's tool-call format writes strings raw; cannot "
                            f"enforce {extra[0]!r} on them", param=at)
    _json(prop, at)  # (a valid schema: enum of strings, lengths non-negative...)
    if "const" in prop or "enum" in prop:
        values = [prop["const"]] if "const" in prop else list(prop["enum"])
        if not all(isinstance(v, str) for v in values):
            raise ApiError(400, f"{at}: a string parameter's enum must hold strings", param=at)
        bad = [v for v in values if v.lower() == "null" or re.search(
            r"</(parameter|function|tool_call)>", v)]
        if bad:
            raise ApiError(400, f"{at}: this model's tool-call format cannot carry the value "
                                f"{bad[0]!r}", param=at)
        return f"{rule}: " + " | ".join(_literal(v) for v in values)
    low, high = prop.get("minLength", 0), prop.get("maxLength")
    length = f"{{{low},{'' if high is None else high}}}"
    return f"{rule}: {rule.upper()}\n{rule.upper()}: /(?s:.{length})/ & {_XML_STRING_EXCLUDED}"


# -- pieces -----------------------------------------------------------------------------------
def _json(schema, param: str) -> str:
    """A JSON schema as a Lark term (`%json`), or the 400 naming `param`."""
    try:
        return json_term(schema)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None


def _parameters(schema, param: str) -> dict:
    """A tool's parameters schema (none: no arguments, an empty object),
    checked against JSON Schema's metaschema: an object schema (its `type`,
    if given, "object"), as OpenAI and Anthropic require."""
    if schema is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema (an object), not {_short(schema)}",
                       param=param)
    try:
        schema_dict(schema)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    if schema.get("type", "object") != "object":
        raise ApiError(400, f"{param} must be an object schema ('type': 'object'), not 'type': "
                            f"{_short(schema['type'])}", param=param)
    return schema


def _only(functions, name: str, param: str):
    chosen = [(n, s) for n, s in functions if n == name]
    if not chosen:
        raise ApiError(400, f"{param}: {name!r} is not one of the request's tools ("
                            f"{', '.join(repr(n) for n, _ in functions)})", param=param)
    return chosen[:1]


def _literal(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text)


class _Markers:
    """A chat format's markers (`<tool_call>`, `</think>`, ...) as grammar
    terms. Where the tokenizer has the marker as one added token, llguidance
    treats it as a special token: a grammar must name that token (`<[id]>`;
    the model writes it so), since text cannot match it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def token(self, text: str) -> Optional[str]:
        """`<[id]>` when `text` is one special token, else None."""
        return special_term(self.tokenizer, self.vocab_size, text)

    def literal(self, text: str) -> str:
        return self.token(text) or _literal(text)


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def attach_grammar(request, wanted: Optional[Wanted], mp):
    """Give a request the grammar its output must follow (lane.py masks its
    row with it), once its prompt is rendered (`preflight`): where the
    prompt leaves the model thinking, the grammar starts after the thinking,
    and a reasoning budget (a forced call's) ends it in time."""
    if wanted is not None:
        given = extras(request)
        prompt, _, _, initial_state, _ = given.tokenized
        given.constraint = constraint(wanted)
        if initial_state == "reasoning" and wanted.reasoning_budget is not None:
            given.reasoning_budget = ReasoningBudget(
                mp.tokenizer, len(prompt), wanted.reasoning_budget)
