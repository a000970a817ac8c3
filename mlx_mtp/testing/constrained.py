"""The reference for structured output: plain constrained decoding.

mlx_lm's own `generate_step` with one logits processor that masks each
step's logits to what the grammar allows (-inf elsewhere) before the
sampler. MTP decoding under the same constraint must give exactly this:
token for token when greedy, this distribution when sampled
(docs/design.md, "Structured output").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..constraint import Constraint, MaskingProcessor


@dataclass
class ConstrainedOutput:
    tokens: List[int]  # emitted tokens, the stop token excluded
    text: str
    finish_reason: str  # "stop": a stop token ended it; "length": max_tokens did


def constrained_plain_generate(model, tokenizer, prompt, constraint: Constraint, *,
                               max_tokens: int = 256, sampler=None) -> ConstrainedOutput:
    """Decode `prompt` (text or token ids) plainly under `constraint`;
    `sampler`: mlx_lm's (greedy when None)."""
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    processor = MaskingProcessor(constraint, tokenizer)
    tokens, finish = [], "length"
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                  sampler=sampler, logits_processors=[processor]):
        if token in tokenizer.eos_token_ids:
            finish = "stop"
            break
        tokens.append(token)
    return ConstrainedOutput(tokens, tokenizer.decode(tokens), finish)
