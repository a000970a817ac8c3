"""Stop strings (OpenAI's `stop`, Anthropic's `stop_sequences`), matched on
the generated text: the answer ends where the first one begins.

mlx_lm.server 0.32.2 matches them on token ids (the string encoded alone)
and strips the text from the answer: a model writing " return" as one
token never matches `return`, so the word is deleted and the generation
carries on. Here the generation thread (lane.py) feeds each row's text
through `StopStrings`, on mlx_lm's own text state machine (each string a
transition that ends the text): text that could be the start of a stop
string is held back until it cannot, so a stream never sends what the
answer then leaves out.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..mlx_lm_compat import TextStateMachine


class StopStrings:
    """One row's stop strings over its text, fed piece by piece (`feed`);
    `found` is the stop string once one appeared."""

    def __init__(self, words: Sequence[str]):
        self.words = tuple(dict.fromkeys(w for w in words if w))  # ("": no string to match)
        machine = TextStateMachine({"text": [(w, None) for w in self.words]}) \
            if self.words else None
        self._state = machine.make_state("text") if machine is not None else None
        self._held = ""  # text that may begin a stop string
        self.found: Optional[str] = None

    def feed(self, piece: str) -> str:
        """A token's text in; out, the text now known to come before any stop
        string (possibly none). Once one appears, the rest is dropped."""
        if self._state is None or self.found is not None:
            return "" if self.found is not None else piece
        pending = self._held + piece
        self._state, segments = TextStateMachine.split(self._state, piece)
        safe = "".join(text for kind, text in segments if kind is not None)
        rest = pending[len(safe):]
        if segments[-1][0] is None:  # (the last segment's state: None once a string matched)
            # the strings starting there complete in order of length: the first is the shortest
            self.found = min((w for w in self.words if rest.startswith(w)), key=len)
            self._held = ""
        else:
            self._held = rest
        return safe

    def flush(self) -> str:
        """At the end (no stop string came): what was held back."""
        held, self._held = self._held, ""
        return held


def answered_tokens(tokens: Sequence[int], stop: str, decode: Callable) -> int:
    """How many of `tokens` (a generation through the token that completed
    `stop`) decode to text wholly before the stop string begins: those the
    answer holds. Decoded from the ids, not from the streamed pieces (a
    streaming detokenizer may hand a token's text over with the next one);
    0 where the string is not in their decoded text (nothing is claimed)."""
    begin = decode(list(tokens)).find(stop)
    if begin < 0:
        return 0
    low, high = 0, len(tokens)  # (a prefix's text only grows with it)
    while low < high:
        mid = (low + high + 1) // 2
        if len(decode(list(tokens[:mid]))) <= begin:
            low = mid
        else:
            high = mid - 1
    return low
