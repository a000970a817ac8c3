"""One acceptance rule for every draft (the counterpart of vLLM's `RejectionSampler`).

A cycle verifies k drafts per row against the trunk's processed log-probs at
the k+1 verify positions and emits `accepted` drafts, then one token of its own.
Every draft goes through `accept`, whatever proposed it:

  - a draft drawn from a distribution q (the MTP head's sampled drafts);
  - a point draft: a token proposed with certainty (a copied token), q = δx.
    Its q is not materialised: a `DraftRun` with q None (every draft) or
    `point` set (some positions) says it. (The head's greedy drafts and a
    grammar's forced tokens are point drafts too; they still come as their
    one-hot q, which the rule treats bitwise the same.)

Per row, by its sampler:
  greedy rows      keep the longest prefix of drafts equal to the arg-max, then
                   the arg-max after it;
  sampled rows     Leviathan–Chen on the row's target distribution p (every
                   sampler transform applied: `sampling.target_rows`): keep d_i
                   with probability min(1, p(d_i) / q(d_i)); at the first
                   rejection emit a sample of norm(max(p - q, 0)), after k
                   accepted drafts a sample of p. For a point draft x that is:
                   keep x with probability p(x), else sample p with x removed
                   and renormalised;
  an opaque sampler (one we cannot introspect, shared by the batch): its own
                   draw at every position, drafts kept while equal to it.
The emitted tokens have exactly the distribution plain decoding samples from,
for any q and any choice of point drafts (docs/design.md, "One acceptance rule").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from .sampling import (Filters, SamplerArrays, categorical_rows, sample_opaque, split_rows,
                       target_rows)

__all__ = ["DraftRun", "Verdict", "accept", "match_length", "speculative_sample",
           "speculative_sample_rows"]


@dataclass(frozen=True)
class DraftRun:
    """A cycle's drafts and what each was drawn from (batch axis first).

    q None: every draft is a point draft (q = δ at it); `point` [B, k] bool:
    the positions whose draft is a point draft (q ignored there), so rows of
    one batch may carry drafts of different sources."""

    tokens: mx.array  # [B, k] int32
    q: Optional[mx.array] = None  # [B, k, V]: the distribution each draft was drawn from
    point: Optional[mx.array] = None  # [B, k] bool


class Verdict(NamedTuple):
    """Per row: how many drafts are kept, and the k+1 tokens the cycle may
    emit (tokens[:accepted] the drafts, tokens[accepted] the trunk's own;
    entries after it are meaningless)."""

    accepted: mx.array  # [B] int32
    tokens: mx.array  # [B, k+1] int32


def match_length(drafts: mx.array, choices: mx.array) -> mx.array:
    """The number of leading drafts [B, k] equal to the choices [B, k(+1)]."""
    k = drafts.shape[-1]
    return mx.cumprod((drafts == choices[..., :k]).astype(mx.int32), axis=-1).sum(axis=-1)


def accept(logprobs: mx.array, run: DraftRun, arrays: SamplerArrays, filters: Filters,
           keys: Optional[mx.array], sampler: Optional[Callable] = None) -> Verdict:
    """The cycle's acceptance: logprobs [B, k+1, V] processed (bias, penalties,
    processors, grammar masks), each row by its sampler's rule (module doc);
    keys [B, 2] the sampled rows' acceptance keys (None when no row samples)."""
    if sampler is not None:  # opaque: its draws, drafts kept while equal to them
        out = sample_opaque(sampler, logprobs)
        return Verdict(match_length(run.tokens, out), out)
    out = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    accepted = match_length(run.tokens, out)
    if not filters.sampled:
        return Verdict(accepted, out)
    target = target_rows(logprobs, arrays, filters, arrays.inv_temp)
    acc_s, out_s = speculative_sample_rows(target, run.q, run.tokens, keys, run.point)
    sampled = arrays.inv_temp > 0
    return Verdict(mx.where(sampled, acc_s, accepted.astype(mx.int32)),
                   mx.where(sampled[:, None], out_s, out))


# -- Leviathan–Chen ---------------------------------------------------------------------------
def speculative_sample(target_logits: mx.array, q: Optional[mx.array], drafts: mx.array,
                       key: mx.array, point: Optional[mx.array] = None):
    """Leviathan–Chen verification of k drafts, in-graph, batched over any
    leading dimensions, with one random key.

    target_logits [..., k+1, V]: logits of p at each verify position (row i
        is the distribution of the token after drafts d_1..d_i; -inf allowed);
    q [..., k, V]: probabilities the drafts were sampled from (None: every
        draft a point draft; `point` [..., k]: these drafts are, q ignored there);
    drafts [..., k]: the drafted tokens.
    Returns (accepted [...] int32, tokens [..., k+1] int32) where tokens[:a]
    are the accepted drafts, tokens[a] is the correction (a < k) or the bonus
    token (a == k); entries after a are meaningless.
    """
    k_u, k_s = mx.random.split(key)
    u = mx.random.uniform(shape=drafts.shape, key=k_u)
    return _leviathan_chen(target_logits, q, point, drafts, u,
                           lambda logits: mx.random.categorical(logits, key=k_s))


def speculative_sample_rows(target_logits: mx.array, q: Optional[mx.array], drafts: mx.array,
                            keys: mx.array, point: Optional[mx.array] = None):
    """`speculative_sample` with a key per row (keys [B, 2], inputs [B, ...]):
    row b draws exactly what it draws in a batch of its own with keys[b]."""
    split = split_rows(keys, 2)  # [B, 2, 2]
    u = mx.vmap(lambda key: mx.random.uniform(shape=drafts.shape[1:], key=key))(split[:, 0])
    return _leviathan_chen(target_logits, q, point, drafts, u,
                           lambda logits: categorical_rows(logits, split[:, 1]))


def _leviathan_chen(target_logits, q, point, drafts, u, categorical):
    k = drafts.shape[-1]
    drafts = drafts.astype(mx.int32)
    logits = target_logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1)  # [..., k+1]
    ld = mx.take_along_axis(logits[..., :k, :], drafts[..., None], axis=-1)[..., 0]
    pd = mx.exp(ld - lse[..., :k])
    qd = _draft_probability(q, point, drafts)
    ok = u * qd < pd  # u < p/q  <=>  accept with probability min(1, p/q)
    accepted = mx.cumprod(ok.astype(mx.int32), axis=-1).sum(axis=-1)  # [...]
    # only row a is ever emitted from: the residual (a < k) or p_{k+1} (a == k)
    ia = accepted[..., None, None]
    p_a = mx.exp(mx.take_along_axis(logits, ia, axis=-2)[..., 0, :]
                 - mx.take_along_axis(lse, accepted[..., None], axis=-1))
    resid = _residual(p_a, q, point, drafts, accepted)
    # p == q (up to rounding) rejects with probability ~0; keep the row valid
    use_resid = (accepted < k) & (resid.sum(axis=-1) > 0)
    row = mx.where(use_resid[..., None], resid, p_a)
    sample = categorical(mx.log(row)).astype(mx.int32)  # [...]
    pad = mx.zeros(drafts.shape[:-1] + (1,), mx.int32)
    tokens = mx.where(mx.arange(k + 1) == accepted[..., None], sample[..., None],
                      mx.concatenate([drafts, pad], axis=-1))
    return accepted.astype(mx.int32), tokens


def _draft_probability(q, point, drafts):
    """q(d_i) for each draft [..., k]: 1 for a point draft."""
    if q is None:
        return mx.ones(drafts.shape, mx.float32)
    qd = mx.take_along_axis(q.astype(mx.float32), drafts[..., None], axis=-1)[..., 0]
    return qd if point is None else mx.where(point, 1.0, qd)


def _residual(p_a, q, point, drafts, accepted):
    """max(p - q, 0) at the first rejected position a (clamped to k-1; unused
    when every draft was kept): for a point draft x, p with x removed (what
    max(p - δx, 0) is wherever x was rejected, i.e. p(x) < 1)."""
    k = drafts.shape[-1]
    at = mx.minimum(accepted, k - 1)[..., None]
    x = mx.take_along_axis(drafts, at, axis=-1)  # [..., 1]
    without_x = mx.where(mx.arange(p_a.shape[-1]) == x, 0.0, p_a)
    if q is None:
        return without_x
    q_a = mx.take_along_axis(q.astype(mx.float32), at[..., None], axis=-2)[..., 0, :]
    resid = mx.maximum(p_a - q_a, 0.0)
    if point is None:
        return resid
    return mx.where(mx.take_along_axis(point, at, axis=-1), without_x, resid)
