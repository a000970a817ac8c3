"""Where a chat's system messages go, for every API (docs/design.md,
"Server: system messages").

Clients send system (or OpenAI "developer") messages anywhere: Claude Code
puts its environment notes after the user's message, Codex sends two
developer messages first. Where the model's chat template takes a system
message in any place (Qwen3, Qwen3-Next renders it there), or the messages
have one system message and it is first, they reach the template as sent,
as in mlx_lm.server. Where the template refuses a later one (Qwen3.5 / 3.6
raise "System message must be at the beginning"), before the chat is
rendered:

- the system messages before the first other message are the system
  prompt, joined in order by a blank line;
- a later one becomes a user message in its place. Never merged into the
  system prompt: that would change the conversation's start, and with it
  every stored prefix, each time one arrives;
- one with no text is left out.
"""

from __future__ import annotations

from typing import List

SYSTEM_ROLES = ("system", "developer")
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe", "description": "", "parameters": {"type": "object", "properties": {}}}}


def late_system_role(tokenizer) -> str:
    """The role a system message after the conversation began takes with
    this tokenizer's chat template: "user" if the template refuses one
    (raises: with or without tools), else "system" (as sent)."""
    if not getattr(tokenizer, "has_chat_template", False):
        return "system"
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    try:
        for tools in ([[_PROBE_TOOL]] if tokenizer.has_tool_calling else []) + [None]:
            tokenizer.apply_chat_template(chat, tools=tools, tokenize=False,
                                          add_generation_prompt=True)
    except Exception:  # (the template refused it)
        return "user"
    return "system"


def _text(content) -> str:
    """A message's text: a string, or its text parts joined (what the chat
    path renders)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def place_system(messages: List[dict], late_role: str) -> List[dict]:
    """The messages with their system messages placed by the rule above
    (`late_role`: `late_system_role`'s; a new list, the messages themselves
    unchanged)."""
    roles = [m.get("role") in SYSTEM_ROLES for m in messages]
    if late_role == "system" or sum(roles) == 0 or (sum(roles) == 1 and roles[0]):
        return messages
    out: List[dict] = []
    leading: List[str] = []
    begun = False
    for m in messages:
        if m.get("role") not in SYSTEM_ROLES:
            begun = True
            out.append(m)
            continue
        text = _text(m.get("content"))
        if not text:
            continue
        if not begun:
            leading.append(text)
        else:
            out.append({"role": "user", "content": text})
    if leading:
        out.insert(0, {"role": "system", "content": "\n\n".join(leading)})
    return out
