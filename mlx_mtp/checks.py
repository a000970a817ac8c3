"""Argument checks shared by the API, the CLI, the loader and the server.

Each raises ValueError (or TypeError for a wrong type) with one message that
names the argument, the value and what is allowed. The ranges are the table's
in params.py (`check(name, value)`; integer and number come from there too):
the functions here apply it and add what needs the model. Token ids are checked on
the host where they already are (the prompt, a logit bias, a sampler's
output): MLX's gather does no bounds check, so an id past the vocabulary
would read arbitrary memory.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional

from .params import MAX_DEPTH, _is_int, check, depth, integer, number  # noqa: F401 (re-exported)


def max_tokens(v: Any) -> int:
    """max_tokens for generate_step: the table's (at least 1, or -1 for no
    limit), or 0: the prompt is only prefilled into the prompt cache."""
    if _is_int(v) and v == 0:
        return v
    return check("max_tokens", v)


def top_k(v: int, vocab_size: int, name: str = "top_k") -> int:
    """top_k below the vocabulary size, which mlx_lm's sampler needs (the
    table's check, which does not know the model, comes first)."""
    check("top_k", v, name)
    if v >= vocab_size:
        raise ValueError(f"{name} must be in 0..{vocab_size - 1} (the model's vocabulary has "
                         f"{vocab_size} tokens), not {v}")
    return v


def token_ids(name: str, ids: Iterable, vocab_size: int) -> list:
    """Token ids as a list of ints, each in [0, vocab_size)."""
    try:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of token ids, not {ids!r}") from None
    if ids and isinstance(ids[0], list):
        raise TypeError(f"{name} must be one sequence of token ids (1-D), not nested lists")
    for t in ids:
        if not _is_int(t):
            raise TypeError(f"{name} must hold integer token ids, not {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name} has token id {t}, outside the vocabulary (0..{vocab_size - 1})")
    return ids


def logit_bias(bias: Any, vocab_size: int) -> Optional[dict]:
    """{token id: additive bias}, ids in the vocabulary."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must map token ids to numbers, not {bias!r}")
    out = {}
    for k, v in bias.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {k!r} is not a token id") from None
        if not 0 <= t < vocab_size:
            raise ValueError(f"logit_bias has token id {t}, outside the vocabulary "
                             f"(0..{vocab_size - 1})")
        out[t] = number(f"logit_bias[{k}]", v)
    return out


def sampling(temp, top_p, min_p, min_tokens_to_keep, top_k, xtc_probability, xtc_threshold,
             draft_temp=None):
    """mlx_lm's sampler settings in the table's ranges (top_p 0 means off)."""
    for name, v in (("temp", temp), ("top_p", top_p), ("min_p", min_p),
                    ("min_tokens_to_keep", min_tokens_to_keep), ("top_k", top_k),
                    ("xtc_probability", xtc_probability), ("xtc_threshold", xtc_threshold)):
        check(name, v)
    if draft_temp is not None:
        check("draft_temp", draft_temp)


_warned_context = set()


def prompt_length(n: int, context: Optional[int], model_id: int):
    """Warn once per model when a prompt is longer than its context."""
    if context and n > context and model_id not in _warned_context:
        _warned_context.add(model_id)
        warnings.warn(f"the prompt has {n} tokens, more than the model's context of {context}: "
                      "quality past that length is not what the model was trained for",
                      stacklevel=4)


# -- the API's other arguments (their types: one line naming the argument) ------------------
def prompt(v: Any, name: str = "prompt", text: bool = True):
    """A prompt: token ids (a list or tuple of ints, an mx.array, anything
    with `tolist`), or text where a tokenizer encodes it (`text`). Not None,
    a number or bytes (MLX would read bytes as token ids)."""
    ids = "a list of token ids or an mx.array"
    what = f"a string, {ids}" if text else ids
    if isinstance(v, (bytes, bytearray)):
        raise TypeError(f"{name} must be {what}, not bytes (decode them to a string first)")
    if isinstance(v, str):
        if not text:
            raise TypeError(f"{name} must be {what}, not a string (encode it with the "
                            "tokenizer first)")
        return v
    if not isinstance(v, (list, tuple)) and not hasattr(v, "tolist") or \
            getattr(v, "ndim", 1) == 0:
        raise TypeError(f"{name} must be {what}, not {v!r}")
    return v


def tokenizer(v: Any):
    """A tokenizer: mlx_lm's TokenizerWrapper (what mlx_mtp.load returns) or
    a Hugging Face tokenizer."""
    if not (callable(getattr(v, "encode", None)) and callable(getattr(v, "decode", None))):
        raise TypeError("tokenizer must be a tokenizer (the second value mlx_mtp.load returns), "
                        f"not {v!r}")
    return v


def logits_processors(v: Any, name: str = "logits_processors") -> Optional[list]:
    """A list of logits processors (each `processor(tokens, logits) -> logits`)."""
    if v is None:
        return None
    if callable(v):
        raise TypeError(f"{name} must be a list of processors, not one processor (pass [it])")
    try:
        items = list(v)
    except TypeError:
        raise TypeError(f"{name} must be a list of processors, not {v!r}") from None
    for p in items:
        if not callable(p):
            raise TypeError(f"{name} must hold processors (callables (tokens, logits) -> "
                            f"logits), not {p!r}")
    return items


def one_depth(draft_tokens: Any, num_draft_tokens: Any, default: Any = "auto"):
    """draft_tokens, or num_draft_tokens (mlx_lm's name for it): one of
    them, not both (draft_tokens at its default counts as not given)."""
    if num_draft_tokens is None:
        return draft_tokens
    if draft_tokens is not None and not (draft_tokens == default
                                         and type(draft_tokens) is type(default)):
        raise ValueError(f"give draft_tokens or num_draft_tokens (mlx_lm's name for it), not "
                         f"both (draft_tokens={draft_tokens!r}, "
                         f"num_draft_tokens={num_draft_tokens!r})")
    return num_draft_tokens
