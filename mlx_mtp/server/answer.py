"""What an answer says, for both APIs: the generation's responses split by
mlx_lm's text state machine into reasoning, text and tool calls (`Answer`),
and how it ended (`finish`), each decided once here; handler.py writes them
in OpenAI's shape, anthropic.py in Anthropic's.

A tool-call block the tool parser cannot read (malformed, or cut off by
max_tokens) is text, as the model wrote it, markers included: never a call
dropped with its text. The finish reason follows what happened: max_tokens
is "length" / "max_tokens" whatever was cut, a stop string "stop" /
"stop_sequence", and "tool_calls" / "tool_use" only when calls were read.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from ..mlx_lm_compat import text_segments


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # as the tool parser read them (a dict for a well-formed call)
    id: Optional[str] = None  # the parser's, if it gave one


@dataclass(frozen=True)
class Part:
    """A run of the answer: kind "reasoning" or "text" (`text`), or "calls"."""

    kind: str
    text: str = ""
    calls: Tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Ending:
    """How an answer ended, in each API's words."""

    openai: str  # finish_reason: "stop", "length" or "tool_calls"
    anthropic: str  # stop_reason: "end_turn", "max_tokens", "stop_sequence" or "tool_use"
    stop_sequence: Optional[str] = None  # the stop string that ended it


def finish(ended: str, stop_sequence: Optional[str], has_calls: bool) -> Ending:
    """The finish reasons of an answer that `ended` ("stop": EOS or a stop
    string, "length": max_tokens) with `stop_sequence` (or None), with or
    without tool calls read."""
    if ended == "length":
        return Ending("length", "max_tokens")
    if stop_sequence is not None:
        return Ending("stop", "stop_sequence", stop_sequence)
    if has_calls:
        return Ending("tool_calls", "tool_use")
    return Ending("stop", "end_turn")


def openai_call(call: ToolCall, index: Optional[int] = None) -> dict:
    """A call in OpenAI's shape, as mlx_lm.server's ToolCallFormatter writes
    it (`index` in a stream)."""
    out = {"function": {"name": call.name,
                        "arguments": json.dumps(call.arguments, ensure_ascii=False)},
           "type": "function", "id": call.id or str(uuid.uuid4())}
    if index is not None:
        out["index"] = index
    return out


class Answer:
    """Responses in (`feed`), the parts they complete out; `finish()` once
    the last one (its finish_reason set) is in."""

    def __init__(self, ctx, tools: Optional[Sequence[dict]], tokenizer):
        self._state = ctx.text_sm.make_state(ctx.initial_state)
        self._parser = ctx.tool_parser if ctx.has_tool_calling else None
        self._tools = tools
        self._markers = (getattr(tokenizer, "tool_call_start", None) or "",
                         getattr(tokenizer, "tool_call_end", None) or "")
        self._call_text: Optional[str] = None  # the open tool-call block's text
        self._ctx = ctx  # (lane.py's: its stop_sequence is set by the answer's end)
        self.tokens = 0  # responses fed: the generated tokens
        self.calls = 0  # tool calls read
        self.ended: Optional[str] = None
        self._said: List[Part] = []  # every part so far (`message`)

    def feed(self, response) -> List[Part]:
        self.tokens += 1
        self._state, segments = text_segments(self._state, response.text,
                                              response.finish_reason)
        parts: List[Part] = []
        for kind, text in segments:
            if kind == "tool":
                self._call_text = (self._call_text or "") + text
                continue
            if self._call_text is not None:  # the block closed
                parts.append(self._read_call(closed=True))
            if text:
                parts.append(Part("reasoning" if kind == "reasoning" else "text", text))
        if response.finish_reason is not None:
            self.ended = response.finish_reason
            if self._call_text is not None:  # a block left open (cut off, or no end marker)
                parts.append(self._read_call(closed=False))
        parts = _merged(parts)
        self._said += parts
        return parts

    def message(self) -> dict:
        """The answer as the assistant message a client sends back with its
        next turn (the chat template's input: text, reasoning as
        `reasoning_content`, calls with their arguments parsed, as mlx_lm's
        server hands a request's calls to the template)."""
        said = _merged(self._said)
        msg = {"role": "assistant",
               "content": "".join(p.text for p in said if p.kind == "text")}
        reasoning = "".join(p.text for p in said if p.kind == "reasoning")
        if reasoning:
            msg["reasoning_content"] = reasoning
        calls = [c for p in said if p.kind == "calls" for c in p.calls]
        if calls:
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in calls]
        return msg

    def finish(self) -> Ending:
        return finish(self.ended or "stop", self._ctx.stop_sequence, self.calls > 0)

    def _read_call(self, closed: bool) -> Part:
        text, self._call_text = self._call_text, None
        calls = self._parse(text)
        if calls:
            self.calls += len(calls)
            return Part("calls", calls=calls)
        start, end = self._markers
        return Part("text", start + text + (end if closed else ""))

    def _parse(self, text: str) -> Tuple[ToolCall, ...]:
        """The calls in a block's text; () when the parser cannot read them."""
        if self._parser is None or not text.strip():
            return ()
        try:
            parsed = self._parser(text, self._tools)
            calls = tuple(ToolCall(c["name"], c.get("arguments") or {}, c.get("id"))
                          for c in (parsed if isinstance(parsed, list) else [parsed]))
        except Exception as e:  # (a parser's error on what it cannot read, whatever its type)
            logging.info("a tool call the parser cannot read is kept as text: %s: %s",
                         type(e).__name__, e)
            return ()
        if not all(isinstance(c.name, str) for c in calls):
            return ()
        return calls


def _merged(parts: List[Part]) -> List[Part]:
    """Adjacent text (or reasoning) parts as one."""
    out: List[Part] = []
    for p in parts:
        if out and p.kind == out[-1].kind and p.kind != "calls":
            out[-1] = Part(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out
