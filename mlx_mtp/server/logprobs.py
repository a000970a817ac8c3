"""Log probabilities in OpenAI's shape.

For each generated token, `logprobs.content` holds
`{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}`
(the OpenAI chat API's `ChatCompletionTokenLogprob`): `token` is the token's
text (decoded, not the tokenizer's byte-level piece such as "Ġdef"; a token
that is only part of a UTF-8 character is "bytes:\\xe4\\xbd", as OpenAI
writes it), `bytes` its UTF-8 bytes, `top_logprobs` the most likely tokens at
that position, most likely first; a logprob of -inf (a token a grammar's mask
or a filter removed) is written -9999.0, OpenAI's "very unlikely", as JSON
has no infinity. Each entry also carries `id`, the token id, as
mlx_lm.server's do. Not mlx_lm's `_format_top_logprobs`: it named the
first of an unsorted top list as the chosen token and returned raw pieces.
"""

from __future__ import annotations

import math
import threading
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode


def top_logprobs(logprobs: mx.array, n: int) -> Tuple[Tuple[int, float], ...]:
    """The `n` most likely tokens of a log-probability row [V]: ((id, logprob),
    ...), most likely first (equal ones: lower id first)."""
    n = min(n, logprobs.shape[-1])
    if n <= 0:
        return ()
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
    pairs = zip(ids.tolist(), logprobs[ids].tolist())
    return tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))


class TokenText:
    """A tokenizer's token ids as (text, UTF-8 bytes), worked out once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        detokenizer = type(tokenizer.detokenizer)
        self.kind = ("bpe" if issubclass(detokenizer, BPEStreamingDetokenizer) else
                     "spm" if issubclass(detokenizer, SPMStreamingDetokenizer) else "text")
        self._bytes: Dict[int, bytes] = {}
        self._lock = threading.Lock()

    _BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE's alphabet

    def bytes(self, token: int) -> bytes:
        with self._lock:
            out = self._bytes.get(token)
        if out is not None:
            return out
        if self.kind == "text":
            out = self.tokenizer.decode([token]).encode("utf-8")
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token) or ""
            if self.kind == "bpe":  # each character one byte (added tokens: their own text)
                out = b"".join(bytes([self._BYTE_OF[c]]) if c in self._BYTE_OF else
                               c.encode("utf-8") for c in piece)
            elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                out = bytes([int(piece[3:5], 16)])  # SentencePiece's byte fallback
            else:
                out = piece.replace("\u2581", " ").encode("utf-8")
        with self._lock:
            self._bytes[token] = out
        return out

    def text(self, token: int) -> str:
        data = self.bytes(token)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:  # part of a character
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def item(self, token: int, logprob: float) -> dict:
        return {"id": token, "token": self.text(token), "logprob": finite(logprob),
                "bytes": list(self.bytes(token))}

    def entry(self, token: int, logprob: float, top: Sequence[Tuple[int, float]]) -> dict:
        """One generated token's `logprobs.content` entry."""
        return dict(self.item(token, logprob),
                    top_logprobs=[self.item(i, lp) for i, lp in top])


# OpenAI's logprob for "very unlikely": a token a grammar's mask removed (or a
# filter) has -inf, which JSON cannot carry (json.dumps writes -Infinity)
UNLIKELY = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY


def entries(table: TokenText, responses: Sequence) -> List[dict]:
    """`logprobs.content` of mlx_lm.server Responses (token, logprob,
    top_tokens: our `top_logprobs` pairs)."""
    return [table.entry(r.token, float(r.logprob), r.top_tokens or ()) for r in responses]
