"""The Anthropic Messages API (`POST /v1/messages`) over the chat machinery.

`to_chat(body)` turns a Messages request into the chat messages, tools and
settings mlx_lm's chat path takes; `Message` turns the answer's parts
(answer.py: reasoning, text, tool calls) into Anthropic content blocks, as
one response or as the stream of events (message_start,
content_block_start/delta/stop, message_delta, message_stop), and
`handle_messages` is the endpoint that does both for the HTTP handler.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import params
from ..mlx_lm_compat import NEUTRAL, CompletionRequest, generation_arguments
from . import structured
from .answer import Answer
from .generation import generate_for
from .lane import extras
from .schemas import (ApiError, RequestError, extension_args, generation_failed, validate,
                      warn_once)

# Request fields we act on, and those a client may send that do not change
# the output (accepted, ignored); any other field is ignored with a warning
# once (schemas.ignore_unknown): a client newer than this server sends fields
# it does not know. The numeric ones (max_tokens, temperature, top_p, top_k)
# are made from the table in params.py.
FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p",
          "top_k", "stream", "tools", "tool_choice", "thinking", "metadata", "service_tier",
          "cache_control", "container", "diagnostics", "inference_geo", "output_config", "speed",
          "user_profile_id", "workspace_id", "context_management", "mcp_servers"}

REQUEST_SCHEMA = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        **params.schema("anthropic"),
        "model": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["user", "assistant", "system"]},
                           "content": {"type": ["string", "array"]}}}},
        "system": {"type": ["string", "array"]},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "stream": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string"}}}},
        "thinking": {"type": "object", "properties": {
            "budget_tokens": {"type": "integer", "minimum": 1}}},
    },
}
REQUEST_SCHEMA["properties"].update({k: {} for k in FIELDS - set(REQUEST_SCHEMA["properties"])})
# Claude Code's first system block: a billing line whose last digits change
# with every session (`cc_version=2.1.332.0b8`). Anthropic's API reads it as
# request metadata; here it is left out of the prompt, so a new session's
# system prompt and tools are the last session's, token for token, and its
# stored prefix is read back (a prompt without it is rendered, cached and
# answered alike: nothing the model sees differs between the two).
ATTRIBUTION = "x-anthropic-billing-header:"


# Content blocks by where they may appear. Read: text (its text), tool_use
# (an assistant's call), tool_result (a user's answer to one), thinking (an
# assistant's reasoning), tool_reference (a tool search's result: the named
# deferred tool's definition, as text in its place). Dropped, as they carry nothing a local model reads:
# redacted_thinking (encrypted by Anthropic). Images: a user's, read by
# `to_chat`'s `read_image` (images.py) where the model takes them. Refused:
# document (the models read text), and any other type (the request would lose it).
BLOCKS = {"user": ("text", "tool_result", "image"),
          "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
          "system": ("text",), "tool_result": ("text", "tool_reference", "image")}
UNSUPPORTED = ("document",)


def _check_blocks(content, where: str, allowed) -> None:
    """Every block of a content list is an object of a type allowed here."""
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise RequestError(f"{at}: a content block must be an object with a 'type'", at)
        if kind in UNSUPPORTED:
            raise RequestError(f"{at}: {kind} content is not supported (the model reads text)",
                               at)
        if kind not in allowed:
            raise RequestError(f"{at}: unknown or misplaced content block type {kind!r} "
                               f"(here: {', '.join(allowed)})", at)
        if kind == "text" and not isinstance(block.get("text"), str):
            raise RequestError(f"{at}: a text block needs 'text', a string", at)


def _text(content, where: str = "", allowed=("text",)) -> str:
    """The text of a string or of a list of blocks (text blocks only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of blocks", where)
    _check_blocks(content, where, allowed)
    return "".join(block["text"] for block in content if block["type"] == "text")


def check_tool_choice(body: dict, tool_calling: bool):
    """tool_choice's shape: 'auto' and 'none' are served (not enforced); 'any'
    or a named 'tool' force a call (structured.py constrains it): refused
    without tools or tool calling."""
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "none", "any", "tool") or (
            kind == "tool" and not isinstance(choice.get("name"), str)):
        raise RequestError("tool_choice must be {'type': 'auto'}, {'type': 'any'}, {'type': "
                           f"'tool', 'name': ...}} or {{'type': 'none'}}, not {choice!r}",
                           "tool_choice")
    if kind in ("any", "tool"):
        what = kind if kind == "any" else f"tool {choice['name']!r}"
        if not body.get("tools"):
            raise RequestError(f"tool_choice forces a tool call ({what}) but the request has "
                               "no tools", "tool_choice")
        if not tool_calling:
            raise RequestError(f"tool_choice forces a tool call ({what}), but this model's chat "
                               "template has no tool calling", "tool_choice")


def _system(system, where: str = "system") -> str:
    """A system prompt's text, Claude Code's per-session billing line left
    out (ATTRIBUTION)."""
    if isinstance(system, str):
        return "" if system.startswith(ATTRIBUTION) and "\n" not in system.strip() else system
    if isinstance(system, list):
        _check_blocks(system, where, BLOCKS["system"])
        system = [b for b in system if not b["text"].startswith(ATTRIBUTION)]
    return _text(system, where, BLOCKS["system"])


def _tool(t: dict) -> dict:
    return {"type": "function", "function": {
        "name": t["name"], "description": t.get("description", ""),
        "parameters": t.get("input_schema", {"type": "object", "properties": {}})}}


def _tool_result(content, where: str, deferred: Dict[str, dict], read_image=None) -> str:
    """A tool result's text; a tool_reference block (a tool search found a
    deferred tool) is that tool's definition, as JSON; an image (a screenshot,
    an image file read) its placeholder, from `read_image` (to_chat's)."""
    if not isinstance(content, list):
        return _text(content or "", where, BLOCKS["tool_result"])
    _check_blocks(content, where, BLOCKS["tool_result"])
    parts = []
    for j, block in enumerate(content):
        if block["type"] == "image":
            parts.append(_image(block, f"{where}.{j}", read_image)["text"])
            continue
        if block["type"] == "text":
            parts.append(block["text"])
            continue
        name = block.get("tool_name")
        tool = deferred.get(name) if isinstance(name, str) else None
        parts.append(json.dumps(_tool(tool)["function"]) if tool is not None
                     else f"(tool {name!r})")
    return "\n".join(parts) if len(parts) > 1 else "".join(parts)


def _image(block: dict, at: str, read_image) -> dict:
    """An image block's text block in its place, from `read_image` (to_chat's;
    None: images are refused)."""
    if read_image is None:
        raise RequestError(f"{at}: image content is not supported here", at)
    return read_image(block, at)


def to_chat(body: dict, read_image: Optional[Callable[[dict, str], dict]] = None
            ) -> Tuple[List[dict], Optional[List[dict]], List[str], Dict[str, Any]]:
    """(chat messages, tools, stop words, chat template arguments) of a
    validated Messages request; RequestError for a content block it would
    otherwise lose. System messages inside `messages` (Claude Code's) stay
    where they are: the server places them as the chat template allows
    (roles.py). Tools with `defer_loading` are not shown to the model until
    a tool search's result names them (Anthropic's rule). A user's image
    block goes to `read_image(block, where)`, which gives the text block in
    its place (None: images are refused). A user's several text blocks stay
    apart, as OpenAI's text parts (the prefix cache keeps where they end)."""
    messages: List[dict] = []
    system = _system(body["system"]) if body.get("system") else ""
    if system:
        messages.append({"role": "system", "content": system})
    deferred = {t["name"]: t for t in body.get("tools") or () if t.get("defer_loading")}
    for i, m in enumerate(body["messages"]):
        content = m["content"]
        where = f"messages.{i}.content"
        if m["role"] == "system":  # (one with no text, `content: []`, says nothing)
            text = _system(content, where)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        _check_blocks(content, where, BLOCKS[m["role"]])
        if m["role"] == "user":
            for j, block in enumerate(content):  # tool results answer the assistant's calls first
                if block["type"] == "tool_result":
                    messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                     "content": _tool_result(block.get("content"),
                                                             f"{where}.{j}.content", deferred,
                                                             read_image)})
            rest = [_image(b, f"{where}.{j}", read_image) if b["type"] == "image" else b
                    for j, b in enumerate(content) if b["type"] != "tool_result"]
            if len(rest) == 1:
                messages.append({"role": "user", "content": _text(rest)})
            elif rest:  # text parts, as OpenAI's: where each block ends is a point the
                # prefix cache may keep (server/prompt_points.py); the template reads their join
                messages.append({"role": "user", "content": [
                    {"type": "text", "text": b["text"]} for b in rest]})
            continue
        calls = [{"id": b.get("id"), "type": "function",
                  "function": {"name": b.get("name"), "arguments": b.get("input") or {}}}
                 for b in content if b.get("type") == "tool_use"]
        msg = {"role": "assistant", "content": _text(
            [b for b in content if b.get("type") == "text"])}
        thinking = "".join(b.get("thinking", "") for b in content if b.get("type") == "thinking")
        if thinking:
            msg["reasoning_content"] = thinking
        if calls:
            msg["tool_calls"] = calls
        messages.append(msg)
    tools = [_tool(t) for t in body.get("tools") or () if not t.get("defer_loading")] or None
    template_args = {}
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        template_args["enable_thinking"] = thinking["type"] == "enabled"
    return messages, tools, list(body.get("stop_sequences") or []), template_args


class Message:
    """Builds an assistant message from the answer's parts (answer.Part:
    reasoning, text, tool calls), as one response or as its stream of
    events: events() returns those so far, response() the whole message."""

    def __init__(self, model: str, input_tokens: int, cached_tokens: int, created_tokens: int):
        """input_tokens: the prompt's; of them `cached_tokens` were read from
        the prefix cache and `created_tokens` stored in it (Anthropic counts
        the three apart: input_tokens is the rest)."""
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.usage = {"input_tokens": input_tokens - cached_tokens - created_tokens,
                      "output_tokens": 0, "cache_read_input_tokens": cached_tokens,
                      "cache_creation_input_tokens": created_tokens}
        self.blocks: List[dict] = []
        self._open: Optional[str] = None  # kind of the block being streamed
        self._events: List[Tuple[str, dict]] = []

    def _start(self, kind: str):
        self._stop()
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" \
            else {"type": "text", "text": ""}
        self.blocks.append(block)
        self._open = kind
        self._events.append(("content_block_start", {
            "type": "content_block_start", "index": len(self.blocks) - 1,
            "content_block": dict(block)}))

    def _stop(self):
        if self._open is None:
            return
        index = len(self.blocks) - 1
        if self._open == "reasoning":  # (a local model's thinking is not signed: empty, as
            # other local servers send it; clients that keep blocks wait for the delta)
            self._events.append(("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": ""}}))
        self._events.append(("content_block_stop", {"type": "content_block_stop",
                                                    "index": index}))
        self._open = None

    def _tool_uses(self, calls):
        self._stop()
        for call in calls:
            block = {"type": "tool_use", "id": call.id or f"toolu_{uuid.uuid4().hex}",
                     "name": call.name, "input": call.arguments}
            self.blocks.append(block)
            i = len(self.blocks) - 1
            self._events += [
                ("content_block_start", {"type": "content_block_start", "index": i,
                                         "content_block": dict(block, input={})}),
                ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}),
                ("content_block_stop", {"type": "content_block_stop", "index": i})]

    def feed(self, part):
        if part.kind == "calls":
            return self._tool_uses(part.calls)
        if not part.text:
            return
        if self._open != part.kind:
            self._start(part.kind)
        block = self.blocks[-1]
        key, delta = ("thinking", "thinking_delta") if part.kind == "reasoning" \
            else ("text", "text_delta")
        block[key] += part.text
        self._events.append(("content_block_delta", {
            "type": "content_block_delta", "index": len(self.blocks) - 1,
            "delta": {"type": delta, key: part.text}}))

    def start_event(self) -> Tuple[str, dict]:
        msg = self._message(None, None)
        msg["content"] = []
        return "message_start", {"type": "message_start", "message": msg}

    def events(self) -> List[Tuple[str, dict]]:
        out, self._events = self._events, []
        return out

    def finish(self, ending, output_tokens: int):
        """ending: the answer's (answer.Ending: its stop_reason and stop string)."""
        self._stop()
        self.usage["output_tokens"] = output_tokens
        self.stop_reason, self.stop_sequence = ending.anthropic, ending.stop_sequence
        self._events += [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": self.stop_reason,
                                         "stop_sequence": self.stop_sequence},
                               "usage": dict(self.usage)}),
            ("message_stop", {"type": "message_stop"})]

    def _message(self, stop_reason, stop_sequence) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": dict(self.usage)}

    def response(self) -> dict:
        return self._message(self.stop_reason, self.stop_sequence)


def handle_messages(handler, body: dict, slot, count_only: bool = False):
    """`POST /v1/messages` (and `/count_tokens`, `count_only`) for the HTTP
    handler (handler.py): read and check the body, render the chat
    (`to_chat`), generate through the server's lane, and answer as a
    `Message`, streamed as events or not."""
    rg = handler.response_generator
    mp = rg.model_provider
    cli = rg.cli_args
    schema = REQUEST_SCHEMA
    if count_only:  # count_tokens: no max_tokens
        schema = dict(schema, required=["model", "messages"])
    validate(body, schema, "anthropic")
    for beta in handler.headers.get("anthropic-beta", "").split(","):
        if beta.strip():  # (betas name Anthropic's features: none changes what is decoded here)
            warn_once(("anthropic-beta", beta.strip()), f"anthropic-beta {beta.strip()!r}: "
                      "accepted (nothing this server does depends on it)", logging.INFO)
    handler._check_model(body["model"])
    if not count_only:  # (count_tokens takes the Messages body whole: max_tokens is not read)
        handler._check_limits(body, ("max_tokens",))
    try:
        images: list = []
        messages, tools, stop_words, template_args = to_chat(
            body, lambda block, at: mp.images.anthropic(block, at, images))
        check_tool_choice(body, mp.tokenizer.has_tool_calling)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param) from None
    max_tokens = 1 if count_only else body["max_tokens"]
    template_args, wanted = structured.thinking_for_grammar(
        structured.anthropic(body, tools, mp.tokenizer, mp.model.vocab_size), template_args,
        cli.chat_template_args, mp.tokenizer.has_thinking, max_tokens,
        (body.get("thinking") or {}).get("budget_tokens"))
    request = CompletionRequest("chat", "", messages, tools, None)
    # a call to a deferred tool is read with its parameters (their types) too
    call_tools = [_tool(t) for t in body.get("tools") or ()] or None
    extras(request).call_tools = call_tools
    extras(request).images = tuple(images)
    prompt = rg.preflight(request, template_args, max_tokens, check_context=not count_only,
                          count_only=count_only)
    if count_only:
        return handler._send_json(200, {"input_tokens": len(prompt)})
    structured.attach_grammar(request, wanted, mp)
    # the fields the Messages API does not have take mlx_lm.server's defaults
    args = generation_arguments(
        **dict(NEUTRAL, **extension_args(body)), model="default_model", draft="default_model",
        temperature=body.get("temperature", cli.temp), top_p=body.get("top_p", cli.top_p),
        top_k=body.get("top_k", cli.top_k), min_p=cli.min_p, stop_words=stop_words,
        max_tokens=max_tokens, chat_template_kwargs=template_args)
    stream = body.get("stream", False)

    def keepalive(done, total):
        if stream:
            handler._write_event("ping", {"type": "ping"})

    with generate_for(handler, request, args, stream, keepalive) as (ctx, response):
        msg = Message(mp.served_id, len(ctx.prompt), max(ctx.prompt_cache_count, 0),
                      ctx.prompt_cache_created)
        if stream:
            handler._set_stream_headers(200)
            handler.end_headers()
            handler._write_event(*msg.start_event())
        said = Answer(ctx, call_tools, mp.tokenizer)
        try:
            for gen in response:
                for part in said.feed(gen):
                    msg.feed(part)
                if stream:
                    for event in msg.events():
                        handler._write_event(*event)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            raise
        except Exception as e:  # (a shutdown past --shutdown-grace, the generation failing)
            if not stream:
                raise e if isinstance(e, ApiError) else generation_failed(e) from None
            return handler._end_in_protocol(e, "anthropic")
    slot.release()  # (the generation ended: what is left is writing)
    msg.finish(said.finish(), said.tokens)
    if stream:
        for event in msg.events():
            handler._write_event(*event)
    else:
        handler._send_json(200, msg.response())
