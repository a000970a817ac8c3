"""OpenAI's Responses API (`POST /v1/responses`) over the chat machinery:
what Codex CLI and the OpenAI Agents SDK speak.

`to_chat(body)` turns a request's `instructions` and `input` items
(messages, function calls and their outputs, reasoning) into the chat
messages and tools mlx_lm's chat path takes; `Output` turns the answer's
parts (answer.py: reasoning, text, tool calls) into output items (reasoning,
message, function_call), as the stream of events (response.created ...
response.completed) or as one Response object; `handle_responses` is the
endpoint. Nothing is stored: `previous_response_id` is refused (a client
sends the conversation in `input`, as Codex and the Agents SDK do).

Tools: `function` tools and those of a `namespace` (Codex's MCP tools,
shown to the model as `namespace.name`), `custom` (free-form) tools as a
function taking one string `input`. OpenAI's hosted tools (web_search,
file_search, ...) run on OpenAI's servers: they are left out here, with a
warning once, and the model answers without them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .. import params
from ..mlx_lm_compat import NEUTRAL, CompletionRequest, generation_arguments
from . import structured
from .answer import Answer, ToolCall
from .generation import generate_for
from .schemas import (ApiError, RequestError, extension_args, generation_failed, validate,
                      warn_once)

_OPENAI = params.schema("openai")
REQUEST_SCHEMA = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": {"type": "string"},
        "input": {"type": ["string", "array"]},
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": _OPENAI["max_tokens"],
        "temperature": _OPENAI["temperature"], "top_p": _OPENAI["top_p"],
        "stream": {"type": "boolean"},
        "tools": {"type": ["array", "null"], "items": {"type": "object", "required": ["type"]}},
        "tool_choice": {}, "parallel_tool_calls": {"type": ["boolean", "null"]},
        "text": {"type": ["object", "null"]}, "reasoning": {"type": ["object", "null"]},
        # accepted, changing nothing here (nothing is stored; no server-side cache key)
        "store": {}, "include": {}, "metadata": {}, "user": {}, "prompt_cache_key": {},
        "safety_identifier": {}, "service_tier": {}, "truncation": {}, "client_metadata": {},
        "stream_options": {},
        # the server's own fields (num_draft_tokens), as on every API
        **{field: _OPENAI[field] for field in params.EXTENSIONS},
    },
}
# what a request may ask for that this server cannot do without losing it
REFUSED = {
    "previous_response_id": "responses are not stored here: send the conversation in input",
    "conversation": "conversations are not stored here: send the conversation in input",
    "prompt": "stored prompt templates are not kept here: send the instructions and input",
    "background": "background responses are not supported: the answer comes in this request",
}
HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter",
          "image_generation", "computer_use_preview", "local_shell", "mcp", "tool_search")
CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}},
                     "required": ["input"]}


@dataclass
class Chat:
    """A Responses request as the chat path takes it."""

    messages: List[dict]
    tools: Optional[List[dict]]
    # the model's name of a tool -> (its kind: "function" or "custom", its
    # namespace or None, its own name)
    names: Dict[str, Tuple[str, Optional[str], str]] = field(default_factory=dict)
    template_args: Dict[str, Any] = field(default_factory=dict)


def _text(content, where: str) -> str:
    """A message's text: a string, or its text parts (input_text,
    output_text, refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise RequestError(f"{where}.{j}: only text parts (input_text, output_text) are "
                               f"supported, not {kind!r}", f"{where}.{j}")
    return "".join(out)


def _tools(tools, chat: Chat) -> Optional[List[dict]]:
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool["type"]
        inner = tool.get("tools") if kind == "namespace" else [tool]
        if kind in HOSTED:
            warn_once(("responses-tool", kind), f"responses requests: the hosted tool {kind!r} "
                      "runs on OpenAI's servers, not here; the model answers without it")
            continue
        if kind not in ("function", "custom", "namespace") or not isinstance(inner, list):
            raise RequestError(f"tools.{i}: unknown tool type {kind!r}", f"tools.{i}")
        namespace = tool.get("name") if kind == "namespace" else None
        for j, t in enumerate(inner):
            where = f"tools.{i}" + (f".tools.{j}" if namespace else "")
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or \
                    t.get("type") not in ("function", "custom"):
                raise RequestError(f"{where}: a tool must be {{'type': 'function', 'name': "
                                   "..., 'parameters': {...}}", where)
            name = f"{namespace}.{t['name']}" if namespace else t["name"]
            chat.names[name] = (t["type"], namespace, t["name"])
            description = t.get("description") or ""
            if t["type"] == "custom":
                fmt = t.get("format") or {}
                if not isinstance(fmt, dict):
                    raise RequestError(f"{where}.format must be an object", f"{where}.format")
                if fmt.get("type") == "grammar":  # (the model sees the grammar's text)
                    description += f"\nThe input follows this {fmt.get('syntax', '')} " \
                                   f"grammar:\n{fmt.get('definition', '')}"
            out.append({"type": "function", "function": {
                "name": name, "description": description,
                "parameters": CUSTOM_PARAMETERS if t["type"] == "custom" else
                t.get("parameters") or {"type": "object", "properties": {}}}})
    return out or None


def _arguments(text):
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


def to_chat(body: dict) -> Chat:
    """The chat messages, tools and template arguments of a validated
    request; RequestError for an input item it would otherwise lose."""
    chat = Chat([], None)
    chat.tools = _tools(body.get("tools"), chat)
    messages = chat.messages
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    reasoning: List[str] = []  # a reasoning item's text, for the assistant turn it opens
    calls: Dict[str, str] = {}  # call_id -> the model's name of its tool

    def assistant() -> dict:
        if not (messages and messages[-1]["role"] == "assistant"
                and not messages[-1].get("_closed")):
            messages.append({"role": "assistant", "content": ""})
        if reasoning:
            messages[-1]["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return messages[-1]

    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise RequestError(f"{where}: an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be 'user', 'assistant', 'system' or "
                                   f"'developer', not {role!r}", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                reasoning.clear()  # (a reasoning the assistant's turn never followed)
                messages.append({"role": "system" if role == "developer" else role,
                                 "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            if item.get("namespace"):
                name = f"{item['namespace']}.{name}"
            arguments = _arguments(item.get("arguments")) if kind == "function_call" else \
                {"input": item.get("input", "")}
            call_id = str(item.get("call_id") or item.get("id") or len(calls))
            calls[call_id] = name
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            reasoning.clear()
            call_id = str(item.get("call_id"))
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "name": calls.get(call_id, ""),
                             "content": output if isinstance(output, str) else
                             _text(output or "", f"{where}.output")})
        elif kind == "reasoning":
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True  # (a new turn of the assistant begins)
            content = item.get("content") or []
            if not isinstance(content, list):
                raise RequestError(f"{where}.content must be a list", f"{where}.content")
            reasoning += [c["text"] for c in content
                          if isinstance(c, dict) and isinstance(c.get("text"), str)]
        else:
            raise RequestError(f"{where}: input items of type {kind!r} are not supported "
                               "(messages, function calls and their outputs, reasoning)",
                               f"{where}.type")
    for m in messages:
        m.pop("_closed", None)
    effort = (body.get("reasoning") or {}).get("effort")
    if effort == "none":  # (other efforts: the template's default thinking)
        chat.template_args["enable_thinking"] = False
    return chat


def _wanted(body: dict, chat: Chat, mp) -> Optional[structured.Wanted]:
    """What the output must be (structured.openai on the chat-shaped
    fields): `text.format` (a JSON schema or object) and a forcing
    `tool_choice`."""
    shaped: Dict[str, Any] = {"tools": chat.tools,
                              "parallel_tool_calls": body.get("parallel_tool_calls")}
    fmt = (body.get("text") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        shaped["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt is not None:
        shaped["response_format"] = fmt
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        shaped["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        shaped["tool_choice"] = choice
    try:
        return structured.openai(shaped, mp.tokenizer, mp.model.vocab_size)
    except ApiError as e:  # (named as the Responses fields are)
        raise _renamed(e) from None


def _renamed(e: ApiError) -> ApiError:
    """An error from the chat path, its fields named as the Responses API's."""
    def rename(text: str) -> str:
        return text.replace("response_format.json_schema", "text.format").replace(
            "response_format", "text.format").replace(".function.name", ".name").replace(
            "in the messages", "in the input")
    return ApiError(e.status, rename(str(e)), e.kind,
                    "input" if e.param == "messages" else e.param and rename(e.param), e.code)


def _ids(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class Output:
    """Builds a Response from the answer's parts: its output items and the
    stream of events that adds them (`events()` returns those so far)."""

    def __init__(self, model: str, body: dict, chat: Chat):
        self.names = chat.names
        self.response = {
            "id": _ids("resp"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": body.get("reasoning"), "store": False, "metadata": body.get("metadata"),
            "previous_response_id": None, "usage": None}
        self._events: List[dict] = []
        self._sequence = 0
        self._open: Optional[str] = None  # kind of the open item ("text", "reasoning")
        self.reasoning_tokens = 0

    def _event(self, kind: str, **fields):
        self._events.append({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1

    def events(self) -> List[dict]:
        out, self._events = self._events, []
        return out

    def start(self):
        self._event("response.created", response=dict(self.response, output=[]))
        self._event("response.in_progress", response=dict(self.response, output=[]))

    @property
    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _add(self, item: dict):
        self.response["output"].append(item)
        self._event("response.output_item.added", output_index=self._index,
                    item=dict(item, **({"content": []} if "content" in item else {})))

    def _close(self):
        if self._open is None:
            return
        item, index = self.response["output"][-1], self._index
        part = item["content"][0]
        if self._open == "text":
            self._event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[])
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=part)
        else:
            self._event("response.reasoning_text.done", item_id=item["id"],
                        output_index=index, content_index=0, text=part["text"])
        item["status"] = "completed"
        self._event("response.output_item.done", output_index=index, item=item)
        self._open = None

    def _begin(self, kind: str):
        self._close()
        if kind == "text":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._add({"id": _ids("msg"), "type": "message", "role": "assistant",
                       "status": "in_progress", "content": [part]})
            self._event("response.content_part.added", item_id=self.response["output"][-1]["id"],
                        output_index=self._index, content_index=0, part=dict(part))
        else:
            self._add({"id": _ids("rs"), "type": "reasoning", "summary": [],
                       "content": [{"type": "reasoning_text", "text": ""}],
                       "encrypted_content": None, "status": "in_progress"})
        self._open = kind

    def _call(self, call: ToolCall):
        kind, namespace, name = self.names.get(call.name, ("function", None, call.name))
        item = {"id": _ids("fc" if kind == "function" else "ctc"), "call_id": _ids("call"),
                "name": name, "status": "completed"}
        if kind == "custom":
            args = call.arguments
            item.update(type="custom_tool_call",
                        input=args.get("input", "") if isinstance(args, dict) else str(args))
            self._add(item)
        else:
            arguments = call.arguments if isinstance(call.arguments, str) else \
                json.dumps(call.arguments, ensure_ascii=False)
            item.update(type="function_call", arguments=arguments)
            if namespace is not None:
                item["namespace"] = namespace
            self.response["output"].append(item)
            index = self._index
            self._event("response.output_item.added", output_index=index,
                        item=dict(item, arguments="", status="in_progress"))
            self._event("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=index, delta=arguments)
            self._event("response.function_call_arguments.done", item_id=item["id"],
                        output_index=index, name=name, arguments=arguments)
        self._event("response.output_item.done", output_index=self._index, item=item)

    def feed(self, part):
        if part.kind == "calls":
            self._close()
            for call in part.calls:
                self._call(call)
            return
        if not part.text:
            return
        if self._open != part.kind:
            self._begin(part.kind)
        item = self.response["output"][-1]
        item["content"][0]["text"] += part.text
        kind = "response.output_text.delta" if part.kind == "text" else \
            "response.reasoning_text.delta"
        extra = {"logprobs": []} if part.kind == "text" else {}
        self._event(kind, item_id=item["id"], output_index=self._index, content_index=0,
                    delta=part.text, **extra)

    def finish(self, ended: str, input_tokens: int, cached: int, output_tokens: int):
        """The answer ended (`ended`: "stop" or "length"): the last item
        closes; response.completed, or response.incomplete at max tokens."""
        self._close()
        self.response["usage"] = {
            "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}
        if ended == "length":
            self.response.update(status="incomplete",
                                 incomplete_details={"reason": "max_output_tokens"})
            self._event("response.incomplete", response=self.response)
        else:
            self.response["status"] = "completed"
            self._event("response.completed", response=self.response)

    def failed(self, error: ApiError):
        self.response.update(status="failed", error={"code": error.code or "server_error",
                                                     "message": str(error)})
        self._event("response.failed", response=self.response)


def handle_responses(handler, body: dict, slot):
    """`POST /v1/responses` for the HTTP handler (handler.py): check the
    body, render the chat (`to_chat`), generate through the server's lane,
    answer as a Response, streamed as events or not."""
    rg = handler.response_generator
    mp, cli = rg.model_provider, rg.cli_args
    validate(body, REQUEST_SCHEMA, "responses", REFUSED)
    handler._check_model(body.get("model"))
    handler._check_limits(body, ("max_output_tokens",))
    try:
        chat = to_chat(body)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param) from None
    asked = _wanted(body, chat, mp)
    max_tokens = body.get("max_output_tokens")
    request = CompletionRequest("chat", "", chat.messages, chat.tools, None)
    template_args, wanted = structured.thinking_for_grammar(
        asked, chat.template_args, cli.chat_template_args, mp.tokenizer.has_thinking,
        max_tokens or cli.max_tokens_limit)
    try:
        prompt = rg.preflight(request, template_args, max_tokens or 1)
    except ApiError as e:
        raise _renamed(e) from None
    if max_tokens is None:  # (as OpenAI's: no cap but the context, and --max-tokens-limit)
        max_tokens = max(1, min(mp.context_length - len(prompt), cli.max_tokens_limit))
        _, wanted = structured.thinking_for_grammar(  # (a forced call's reasoning budget)
            asked, chat.template_args, cli.chat_template_args, mp.tokenizer.has_thinking,
            max_tokens)
    structured.attach_grammar(request, wanted, mp)
    args = generation_arguments(
        **dict(NEUTRAL, **extension_args(body)), model="default_model", draft="default_model",
        temperature=body.get("temperature", cli.temp), top_p=body.get("top_p", cli.top_p),
        top_k=cli.top_k, min_p=cli.min_p, stop_words=[], max_tokens=max_tokens,
        chat_template_kwargs=template_args)
    stream = body.get("stream", False)
    out = Output(mp.served_id, body, chat)

    def send(events):
        for event in events:
            handler._write_event(event["type"], event)

    def keepalive(done, total):
        if stream:
            handler.wfile.write(f": keepalive {done}/{total}\n\n".encode())
            handler.wfile.flush()

    with generate_for(handler, request, args, stream, keepalive) as (ctx, responses):
        if stream:
            handler._set_stream_headers(200)
            handler.end_headers()
            out.start()
            send(out.events())
        said = Answer(ctx, chat.tools, mp.tokenizer)
        try:
            for gen in responses:
                parts = said.feed(gen)
                out.reasoning_tokens += any(p.kind == "reasoning" for p in parts)
                for part in parts:
                    out.feed(part)
                if stream:
                    send(out.events())
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            raise
        except Exception as e:  # (a shutdown past --shutdown-grace, the generation failing)
            error = e if isinstance(e, ApiError) else generation_failed(e)
            if not stream:
                raise error from None
            logging.info("POST /v1/responses: ended with %d %s", error.status, error)
            out.failed(error)
            return send(out.events())
    slot.release()  # (the generation ended: what is left is writing)
    out.finish(said.ended or "stop", len(ctx.prompt), max(ctx.prompt_cache_count, 0),
               said.tokens)
    if stream:
        send(out.events())
    else:
        handler._send_json(200, out.response)
