"""Where a chat prompt is split for the prefix cache besides mlx_lm's
segments (system prompt, conversation, generation tail): a prefill stores
a copy of the cache at each segment's end (lane.py, `_snapshot_points`).
Two more points, each one state that later requests start from:

- the branch point: the conversation up to its last answer, where every
  next turn of that answer starts (a retry, an edited last message, a
  sub-agent; the turn that came next took it from RAM);
- the shared head: the end of the last content block but one of a
  conversation's opening message, what another session of the same agent
  sends again (Claude Code's interactive `<system-reminder>` blocks before
  the user's text). It applies to a message of several text parts only:
  Codex CLI's instructions and developer messages are system messages (the
  system prompt's segment), its environment a user message of its own
  (Responses' parts are joined into one string, `responses.to_chat`),
  which no point here splits from the user's text.

Both are found on the rendered text, tokenizing only what follows the
chat template's marker before them (text never merges across a marker:
an added token), and each is checked against the prompt's own tokens, so
a template that renders otherwise costs the point, never a wrong one."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

# a snapshot's kind (its segment's): its type in mlx_lm's LRU (which evicts
# assistant, then user, then system entries first) and whether it goes to
# disk too: what another conversation or a later turn starts from
SNAPSHOT_KINDS: Dict[str, Tuple[str, bool]] = {
    "system": ("system", True),
    # the shared head: a user's entry (normal LRU rank), though on disk, since
    # a block the client sends before the user's text may be the user's own
    # (then this entry is one session's, and must not outlive a system prompt)
    "head": ("user", True),
    "branch": ("user", True),  # the branch point
    "user": ("user", False),  # (superseded by the prompt's end and its answer)
    "assistant": ("assistant", False),
}
SYSTEM_ROLES = ("system", "developer")
# a block's last tokens may merge with the text after it (BPE: '>' then '\n'
# is one token, '>\n'): the head's point is this many tokens before its end,
# where another session's different text leaves the tokens as they are. A
# margin: the demo's byte-level BPE needs 1 (a merge spans the block's last
# token and the next text's first); a tokenizer whose merges reach further
# back needs more, and 4 costs at most 3 tokens of prefill
BLOCK_END_SLACK = 4
# a shared head shorter than this is not worth a copy of the whole cache
MIN_HEAD_TOKENS = 64
# the probe render's stand-in for a message's content (private-use
# characters: no conversation or template writes them)
PROBE = "\ue000mlx-mtp probe\ue001"

Render = Callable[[List[dict], bool], str]  # (messages, add_generation_prompt) -> the text


def opening_head(messages: Optional[Sequence[dict]]) -> Optional[Tuple[int, str]]:
    """(index, text) of the content blocks but the last of a conversation's
    opening message (the first after its system messages: a user's, as a
    list of text parts), while the conversation has no answer yet (its
    first request: later ones extend a prefix stored by then). Read before
    mlx_lm joins the parts into one string."""
    if not messages or any(m.get("role") == "assistant" for m in messages):
        return None
    i = next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), None)
    if i is None or messages[i].get("role") != "user":
        return None
    content = messages[i].get("content")
    if not isinstance(content, list) or len(content) < 2:
        return None
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in content):
        return None
    return i, "".join(p["text"] for p in content[:-1])


def extra_points(encode: Callable[[str], list], render: Render, markers: Sequence[str],
                 messages: List[dict], prompt: list,
                 head: Optional[Tuple[int, str]]) -> Dict[int, str]:
    """{token offset in `prompt`: kind} of the branch point and the shared
    head (`opening_head`'s, read before the join) found in this prompt.
    `render`: the chat template on these messages (the request's tools and
    arguments), as text; `encode`: its tokenizer, no special tokens added."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if head is None and (last is None or last + 1 >= len(messages)):
        return {}
    text = render(messages, True)
    points = {}
    if last is not None and last + 1 < len(messages):
        at = _message_start(render, messages, last + 1, text)
        if at is not None:
            offset = _offset(encode, prompt, text, after_marker(text, at, markers))
            if offset is not None:
                points[offset] = "branch"
    if head is not None:
        i, head_text = head
        at = _message_start(render, messages, i, text)
        if at is not None and text.startswith(head_text, at):
            start = after_marker(text, at, markers)
            offset = _offset(encode, prompt, text, start)
            if offset is not None:
                piece = encode(text[start:at + len(head_text)])
                same = next((k for k, (a, b) in enumerate(zip(piece, prompt[offset:]))
                             if a != b), min(len(piece), len(prompt) - offset))
                if same - BLOCK_END_SLACK >= MIN_HEAD_TOKENS:
                    points[offset + same - BLOCK_END_SLACK] = "head"
    return points


def _message_start(render: Render, messages: List[dict], i: int, text: str) -> Optional[int]:
    """Where message i's content begins in the rendered `text`: where the
    probe (the whole conversation, message i's content `PROBE`) writes it,
    if `text` begins as the probe does up to there. The messages after i
    stay: a template may decide for the whole conversation (Qwen3's
    `last_query_index` keeps or drops earlier answers' reasoning)."""
    try:
        probe = render(messages[:i] + [dict(messages[i], content=PROBE)] + messages[i + 1:],
                       True)
    except Exception:  # (a template that refuses the probe: no point)
        return None
    at = probe.find(PROBE)
    return at if at >= 0 and text.startswith(probe[:at]) else None


def after_marker(text: str, end: int, markers: Sequence[str]) -> int:
    """The end of the last marker that ends at or before `end` (0: none):
    where a prefix of `text` is final, whatever text comes after `end`
    (generation.next_turn_prefix cuts its tokens there too: the test of
    the points checks the two cuts agree)."""
    return max((k + len(m) for m in markers if m and (k := text.rfind(m, 0, end)) >= 0),
               default=0)


def _offset(encode, prompt: list, text: str, start: int) -> Optional[int]:
    """The token offset in `prompt` where text[start:] begins (`start` just
    after a marker), if the prompt ends in that text's tokens."""
    if start <= 0:
        return None
    tail = list(encode(text[start:]))
    if not 0 < len(tail) < len(prompt) or list(prompt[len(prompt) - len(tail):]) != tail:
        return None
    return len(prompt) - len(tail)


def split(segments: list, kinds: list, points: Dict[int, str]) -> Tuple[list, list]:
    """The segments (token lists that make the prompt, one kind each) split
    at `points` (token offsets), the part before each point of its kind."""
    if not points:
        return segments, kinds
    out, out_kinds, start = [], [], 0
    for segment, kind in zip(segments, kinds):
        end, cut = start + len(segment), start
        for p in sorted(p for p in points if start < p < end):
            out.append(segment[cut - start:p - start])
            out_kinds.append(points[p])
            cut = p
        out.append(segment[cut - start:])
        out_kinds.append(kind)
        start = end
    return out, out_kinds
