"""Argument checks shared by the API, the CLI, the loader and the server.

Each raises ValueError (or TypeError for a wrong type) with one message that
names the argument, the value and what is allowed. Token ids are checked on
the host where they already are (the prompt, a logit bias, a sampler's
output): MLX's gather does no bounds check, so an id past the vocabulary
would read arbitrary memory.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional, Union

MAX_DEPTH = 16  # draft_tokens above this only cost time


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(name: str, v: Any, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    if not _is_int(v):
        raise TypeError(f"{name} must be an integer, not {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at least {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{name} must be {span}, not {v}")
    return v


def number(name: str, v: Any, lo: Optional[float] = None, hi: Optional[float] = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise TypeError(f"{name} must be a number, not {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {span}, not {v}")
    return float(v)


def max_tokens(v: Any) -> int:
    """An int >= 0, or -1 for no limit (mlx_lm's convention)."""
    if _is_int(v) and v == -1:
        return v
    return integer("max_tokens", v, lo=0)


def depth(v: Any, name: str = "draft_tokens") -> Union[int, str]:
    """An int in 0..MAX_DEPTH, or 'auto'."""
    if v == "auto":
        return v
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if not _is_int(v):
        raise TypeError(f"{name} must be an integer in 0..{MAX_DEPTH} or 'auto', not {v!r}")
    if not 0 <= v <= MAX_DEPTH:
        raise ValueError(f"{name} must be in 0..{MAX_DEPTH} or 'auto', not {v}")
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


def sampling(temp=0.0, top_p=0.0, min_p=0.0, min_tokens_to_keep=1, top_k=0,
             xtc_probability=0.0, xtc_threshold=0.1, draft_temp=None):
    """mlx_lm's sampler settings in their valid ranges (top_p 0 means off)."""
    number("temp", temp, lo=0)
    number("top_p", top_p, lo=0, hi=1)
    number("min_p", min_p, lo=0, hi=1)
    integer("min_tokens_to_keep", min_tokens_to_keep, lo=1)
    integer("top_k", top_k, lo=0)
    number("xtc_probability", xtc_probability, lo=0, hi=1)
    number("xtc_threshold", xtc_threshold, lo=0, hi=0.5)
    if draft_temp is not None:
        number("draft_temp", draft_temp, lo=0)


_warned_context = set()


def prompt_length(n: int, context: Optional[int], model_id: int):
    """Warn once per model when a prompt is longer than its context."""
    if context and n > context and model_id not in _warned_context:
        _warned_context.add(model_id)
        warnings.warn(f"the prompt has {n} tokens, more than the model's context of {context}: "
                      "quality past that length is not what the model was trained for",
                      stacklevel=4)
