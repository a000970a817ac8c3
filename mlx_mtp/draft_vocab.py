"""Trimmed draft vocabulary: the head drafts only among the most frequent ids.

Drafting projects the head's hidden onto these rows of lm_head instead of the
full vocabulary (248K rows on Qwen3.5/3.6), which is most of a draft step's
cost. Verification stays full-vocabulary, so the output does not change; only
drafts of rare tokens are lost.

A vocabulary is a sorted int32 array of token ids, from
  - a count over the user's own text (`python -m mlx_mtp.evaluate
    --write-draft-vocab FILE`), saved as JSON {"ids": [...]}, or
  - the tokenizer alone: BPE ids are assigned in merge order, so the lowest
    ids are the most frequent pieces (`size` = N takes ids 0..N-1), plus the
    special tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Union

import mlx.core as mx


def from_tokenizer(tokenizer, size: int, vocab_size: int) -> mx.array:
    ids = set(range(min(size, vocab_size)))
    ids |= {int(i) for i in getattr(tokenizer, "all_special_ids", []) if int(i) < vocab_size}
    ids |= {int(i) for i in tokenizer.eos_token_ids if int(i) < vocab_size}
    return mx.array(sorted(ids), dtype=mx.int32)


def count(token_lists: Iterable[Iterable[int]], size: int, tokenizer=None,
          vocab_size: Optional[int] = None) -> list:
    """The `size` most frequent ids of the given token sequences (+ specials)."""
    c = Counter()
    for toks in token_lists:
        c.update(int(t) for t in toks)
    ids = {t for t, _ in c.most_common(size)}
    if tokenizer is not None:
        ids |= {int(i) for i in tokenizer.eos_token_ids}
    if vocab_size is not None:
        ids = {i for i in ids if i < vocab_size}
    return sorted(ids)


def save(path: Union[str, Path], ids: list, source: str = ""):
    Path(path).write_text(json.dumps({"source": source, "size": len(ids), "ids": ids}))


def load(spec: Union[str, int, Path, None], tokenizer, vocab_size: int) -> Optional[mx.array]:
    """A JSON file written by `save`, or an int N (the tokenizer's first N ids)."""
    if spec is None:
        return None
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        return from_tokenizer(tokenizer, int(spec), vocab_size)
    try:
        ids = json.loads(Path(spec).read_text())["ids"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"draft vocabulary {spec}: {e}") from None
    bad = [i for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise ValueError(f"draft vocabulary {spec}: id {bad[0]} is outside the vocabulary")
    return mx.array(sorted(int(i) for i in ids), dtype=mx.int32)
