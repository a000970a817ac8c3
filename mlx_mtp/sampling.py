"""What a row samples from: mlx_lm's samplers and processors, introspected.

`make_sampler` has mlx_lm's signature and returns an `MTPSampler`: a callable
that samples exactly like `mlx_lm.sample_utils.make_sampler(...)` (so it works
with mlx_lm.generate too) and that also tells the MTP decoder WHICH
distribution it samples from:

  p_i = target distribution at verify position i: softmax(filter(logprobs_i) / temp),
        logprobs_i already processed by the logits processors with the history
        position i would have in plain decoding (`target_rows`);
  q_i = the distribution the head's draft d_i was sampled from (`sample_drafts`).

With that the decoder verifies drafts by Leviathan–Chen acceptance instead of
requiring an exact match (the rule, for every kind of draft, is
`acceptance.accept`). Everything here is in-graph (keys are explicit
`mx.random` keys).

XTC's filter is itself random (a coin per token decides whether it applies):
the target is then the mixture of the coin's two outcomes, one distribution
like any other (`target_rows`). A sampler the decoder cannot introspect (any
other callable) is still exact: the decoder falls back to "match"
verification (targets sampled independently at every position, drafts kept
while equal to them), which is exact for any sampler but accepts less.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors as _mlx_lm_make_logits_processors
from mlx_lm.sample_utils import make_sampler as _mlx_lm_make_sampler

from .mlx_lm_compat import apply_top_k, apply_top_p, greedy_sampler
from .params import SAMPLER_DEFAULTS

__all__ = ["MTPSampler", "make_sampler", "make_logits_processors", "is_greedy", "RowSampling",
           "Penalties"]


class MTPSampler:
    """mlx_lm sampler with introspectable settings.

    Calling it is exactly mlx_lm's sampler built from the same arguments (it
    IS that sampler underneath), so it can be handed to mlx_lm.generate.

    draft_temp: the temperature the MTP head drafts at (None: the target's
    `temp`; 0: greedy drafts, q one-hot). The head's logits go through the
    same logits processors and top-p/top-k/min-p filters as the target. Any
    value is exact; the default measured best. Demo model, depth 3, 8 code
    prompts x 96 tokens, acceptance per draft position (tokens per cycle):
      temp 0.6: q at 0.6 [65%, 42%, 24%] (2.28); at 0.8 [69%, 37%, 23%] (2.26);
                at 0.3 [51%, 28%, 15%] (1.92); greedy drafts [39%, 17%, 7%] (1.61)
      temp 1.0: q at 1.0 [68%, 40%, 24%] (2.31); at 1.3 [64%, 41%, 23%] (2.26);
                at 0.6 [41%, 19%, 8%] (1.67); greedy drafts [23%, 10%, 3%] (1.35)
      (greedy decoding, temp 0: [75%, 49%, 29%] (2.50))
    """

    def __init__(
        self,
        temp: float = SAMPLER_DEFAULTS["temp"],
        top_p: float = SAMPLER_DEFAULTS["top_p"],
        min_p: float = SAMPLER_DEFAULTS["min_p"],
        min_tokens_to_keep: int = SAMPLER_DEFAULTS["min_tokens_to_keep"],
        top_k: int = SAMPLER_DEFAULTS["top_k"],
        xtc_probability: float = SAMPLER_DEFAULTS["xtc_probability"],
        xtc_threshold: float = SAMPLER_DEFAULTS["xtc_threshold"],
        xtc_special_tokens: Optional[List[int]] = None,
        draft_temp: Optional[float] = None,
    ):
        from . import checks

        checks.sampling(temp, top_p, min_p, min_tokens_to_keep, top_k, xtc_probability,
                        xtc_threshold, draft_temp)
        self.temp = float(temp)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.min_tokens_to_keep = int(min_tokens_to_keep)
        self.top_k = int(top_k)
        self.xtc_probability = float(xtc_probability)
        self.xtc_threshold = float(xtc_threshold)
        self.xtc_special_tokens = list(xtc_special_tokens or [])
        self.draft_temp = None if draft_temp is None else float(draft_temp)
        self._sampler = _mlx_lm_make_sampler(
            temp, top_p, min_p, min_tokens_to_keep, top_k=top_k,
            xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
            xtc_special_tokens=xtc_special_tokens,
        )

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._sampler(logprobs)

    def __repr__(self):
        return (f"MTPSampler(temp={self.temp}, top_p={self.top_p}, min_p={self.min_p}, "
                f"min_tokens_to_keep={self.min_tokens_to_keep}, top_k={self.top_k}, "
                f"xtc_probability={self.xtc_probability}, draft_temp={self.draft_temp})")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def speculative(self) -> bool:
        """True when the decoder can verify drafts by Leviathan–Chen."""
        return not self.greedy and self.xtc_probability <= 0.0


def make_sampler(
    temp: float = SAMPLER_DEFAULTS["temp"],
    top_p: float = SAMPLER_DEFAULTS["top_p"],
    min_p: float = SAMPLER_DEFAULTS["min_p"],
    min_tokens_to_keep: int = SAMPLER_DEFAULTS["min_tokens_to_keep"],
    top_k: int = SAMPLER_DEFAULTS["top_k"],
    xtc_probability: float = SAMPLER_DEFAULTS["xtc_probability"],
    xtc_threshold: float = SAMPLER_DEFAULTS["xtc_threshold"],
    xtc_special_tokens: Optional[List[int]] = None,
    draft_temp: Optional[float] = None,
) -> MTPSampler:
    """Drop-in for `mlx_lm.sample_utils.make_sampler` (same arguments, plus
    `draft_temp`); the result works with mlx_lm and lets the MTP decoder
    sample exactly with Leviathan–Chen acceptance."""
    return MTPSampler(temp, top_p, min_p, min_tokens_to_keep, top_k, xtc_probability,
                      xtc_threshold, xtc_special_tokens, draft_temp)


def is_greedy(sampler) -> bool:
    return sampler is None or sampler is greedy_sampler or (
        isinstance(sampler, MTPSampler) and sampler.greedy)


# -- one batch, a sampler per row ------------------------------------------------------------
# Rows of a batch may sample with different settings: greedy rows and rows
# sampling with their own temperature, top-p, min-p, draft temperature, key
# and logit bias decode together; the settings are arrays of the decode state
# (one entry per row), so a compiled cycle serves any mix. Only what decides
# the graph's shape is shared (`Filters`). See docs/design.md, "Sampling".


def _rows(fn):
    """fn over each row's key (MLX's random ops take one key)."""
    return mx.vmap(fn)


def categorical_rows(logits: mx.array, keys: mx.array) -> mx.array:
    """mx.random.categorical of each row [B, ..., V] with its own key [B, 2]."""
    return _rows(lambda lg, key: mx.random.categorical(lg, key=key))(logits, keys)


def split_rows(keys: mx.array, num: int) -> mx.array:
    """Each row's key split in `num`: [B, num, 2]."""
    return _rows(lambda key: mx.random.split(key, num))(keys)


# the longest context a penalty counts in-graph (mlx_lm's default is 20 tokens); a
# longer one, or 0 (mlx_lm then counts the whole history), runs as mlx_lm's processor
PENALTY_WINDOW = 256
PENALTY_KINDS = ("repetition", "presence", "frequency")  # mlx_lm's order


@dataclass(frozen=True)
class Penalties:
    """mlx_lm's repetition, presence and frequency penalties
    (`make_logits_processors`), each (penalty, context size) or None when
    off, applied in-graph with mlx_lm's arithmetic (`penalize_rows`)."""

    repetition: Optional[Tuple[float, int]] = None
    presence: Optional[Tuple[float, int]] = None
    frequency: Optional[Tuple[float, int]] = None

    @classmethod
    def of(cls, repetition_penalty=None, repetition_context_size=20, presence_penalty=None,
           presence_context_size=20, frequency_penalty=None,
           frequency_context_size=20) -> Optional["Penalties"]:
        """The penalties mlx_lm would apply (a penalty of None or 0 is off,
        as there), or None when one counts a context kept only on the host."""
        given = {"repetition": (repetition_penalty, repetition_context_size),
                 "presence": (presence_penalty, presence_context_size),
                 "frequency": (frequency_penalty, frequency_context_size)}
        on = {}
        for kind, (penalty, size) in given.items():
            if penalty is None or penalty == 0:
                continue
            if not isinstance(size, int) or not 0 < size <= PENALTY_WINDOW:
                return None
            on[kind] = (float(penalty), int(size))
        return cls(**on)

    def __bool__(self) -> bool:
        return any(getattr(self, kind) is not None for kind in PENALTY_KINDS)


class LogitsProcessors(list):
    """mlx_lm's logits processors (the list its `make_logits_processors`
    returns, so it works with mlx_lm too) that also tell the decoder their
    settings: the logit bias and penalties then run in the compiled cycle
    instead of on the host. A list changed after it was made is opaque."""

    def __init__(self, processors: list, logit_bias: Optional[Dict[int, float]],
                 penalties: Penalties):
        super().__init__(processors)
        self.logit_bias, self.penalties = logit_bias or None, penalties
        self._made = tuple(processors)

    @property
    def intact(self) -> bool:
        return tuple(self) == self._made


def make_logits_processors(logit_bias: Optional[Dict[int, float]] = None,
                           repetition_penalty: Optional[float] = None,
                           repetition_context_size: Optional[int] = 20,
                           presence_penalty: Optional[float] = None,
                           presence_context_size: Optional[int] = 20,
                           frequency_penalty: Optional[float] = None,
                           frequency_context_size: Optional[int] = 20) -> list:
    """Drop-in for `mlx_lm.sample_utils.make_logits_processors` (same
    arguments, same processors): with `mlx_mtp` the logit bias and penalties
    run in the compiled cycle (a penalty counting more than PENALTY_WINDOW
    tokens, or all of them, stays mlx_lm's processor on the host)."""
    processors = _mlx_lm_make_logits_processors(
        logit_bias, repetition_penalty, repetition_context_size, presence_penalty,
        presence_context_size, frequency_penalty, frequency_context_size)
    penalties = Penalties.of(repetition_penalty, repetition_context_size, presence_penalty,
                             presence_context_size, frequency_penalty, frequency_context_size)
    if penalties is None:
        return processors
    return LogitsProcessors(processors, logit_bias, penalties)


@dataclass(frozen=True)
class RowSampling:
    """One row's sampler, as arrays a compiled cycle reads: greedy (temp 0),
    or sampled exactly by Leviathan–Chen from mlx_lm's target distribution
    (top-p, min-p, top-k in mlx_lm's order, then temperature). The head
    drafts at `draft_temp` (None: temp; 0: greedy drafts). `logit_bias` is
    added to the logits of every position (mlx_lm's logit-bias processor,
    in-graph), then the `penalties`. top_k and min_tokens_to_keep decide the
    graph's shape: the sampled rows of a batch share them (`shared`)."""

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    min_tokens_to_keep: int = 1
    draft_temp: Optional[float] = None
    logit_bias: Optional[Tuple[Tuple[int, float], ...]] = None
    penalties: Optional[Penalties] = None
    xtc_probability: float = 0.0  # mlx_lm's XTC (its random coin is a mixture here)
    xtc_threshold: float = 0.1
    xtc_special: Tuple[int, ...] = ()  # never excluded by XTC

    @classmethod
    def of(cls, sampler, logit_bias: Optional[Dict[int, float]] = None,
           penalties: Optional[Penalties] = None) -> Optional["RowSampling"]:
        """The row settings of a sampler: None (greedy), mlx_lm's greedy
        sampler or an MTPSampler that can be introspected; None for any
        other callable (it is called as it is: `Spec.sampler`)."""
        bias = tuple(sorted(logit_bias.items())) if logit_bias else None
        penalties = penalties or None
        if is_greedy(sampler):
            return cls(logit_bias=bias, penalties=penalties)
        if isinstance(sampler, MTPSampler):
            return cls(sampler.temp, sampler.top_p, sampler.min_p, sampler.top_k,
                       sampler.min_tokens_to_keep, sampler.draft_temp, bias, penalties,
                       sampler.xtc_probability, sampler.xtc_threshold,
                       tuple(sampler.xtc_special_tokens) if sampler.xtc_probability > 0 else ())
        return None

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def shared(self) -> Optional[tuple]:
        """What the sampled rows of one batch must have in common (None: greedy)."""
        return None if self.greedy else (self.top_k, self.min_tokens_to_keep)


@dataclass(frozen=True)
class Filters:
    """Which of the per-row steps a batch's graph contains (its rows decide)."""

    sampled: bool = False  # some row samples: keys, Leviathan–Chen
    top_p: bool = False
    min_p: bool = False
    top_k: int = 0
    min_keep: int = 1
    bias: bool = False
    penalties: Tuple[bool, ...] = (False,) * len(PENALTY_KINDS)  # which kinds some row has
    xtc: bool = False  # some sampled row applies XTC

    @classmethod
    def of(cls, rows: Iterable[RowSampling]) -> "Filters":
        rows = list(rows)
        sampled = [r for r in rows if not r.greedy]
        shared = {r.shared for r in sampled}
        if len(shared) > 1:
            raise ValueError("the sampled rows of a batch must share top_k and "
                             "min_tokens_to_keep")
        top_k, min_keep = shared.pop() if shared else (0, 1)
        return cls(bool(sampled), any(0 < r.top_p < 1 for r in sampled),
                   any(r.min_p != 0 for r in sampled), top_k, min_keep,
                   any(r.logit_bias for r in rows),
                   tuple(any(r.penalties is not None and getattr(r.penalties, kind) is not None
                             for r in rows) for kind in PENALTY_KINDS),
                   any(r.xtc_probability > 0 for r in sampled))


def bias_row(logit_bias, vocab_size: int) -> List[float]:
    """One row's logit bias over the vocabulary, from its (token, bias) pairs."""
    row = [0.0] * vocab_size
    for t, v in logit_bias or ():
        row[t] += v
    return row


@dataclass(frozen=True)
class SamplerArrays:
    """Each row's sampler settings as device arrays, batch axis first (None
    where no row of the batch uses them): a `DecodeState`'s `sampling`."""

    inv_temp: Optional[mx.array] = None  # [B]: 1 / temperature (0: greedy)
    top_p: Optional[mx.array] = None  # [B]
    min_p_log: Optional[mx.array] = None  # [B]: log(min-p), -inf when off
    inv_draft_temp: Optional[mx.array] = None  # [B]: the drafts' (0: greedy drafts)
    bias: Optional[mx.array] = None  # [B, V]: logit bias
    penalty: Optional[mx.array] = None  # [B, 3]: repetition, presence, frequency penalties
    penalty_n: Optional[mx.array] = None  # [B, 3]: their context sizes (0: off)
    xtc_p: Optional[mx.array] = None  # [B]: XTC's probability, threshold and the
    xtc_threshold: Optional[mx.array] = None  # ... tokens it never excludes [B, V]
    xtc_keep: Optional[mx.array] = None

    @classmethod
    def of(cls, rows: List[RowSampling], filters: Filters, vocab_size: int) -> "SamplerArrays":
        """The arrays the filters need, for these rows. Host arithmetic in
        double, as mlx_lm's scalar settings are, so a row samples what
        mlx_lm's sampler would."""
        out = {}
        if filters.sampled:
            def inv(t):
                return 0.0 if t == 0 else 1.0 / t

            out["inv_temp"] = mx.array([inv(r.temp) for r in rows], dtype=mx.float32)
            out["top_p"] = mx.array([r.top_p for r in rows], dtype=mx.float32)
            out["min_p_log"] = mx.array([math.log(r.min_p) if r.min_p > 0 else -math.inf
                                         for r in rows], dtype=mx.float32)
            out["inv_draft_temp"] = mx.array(
                [0.0 if r.greedy else inv(r.temp if r.draft_temp is None else r.draft_temp)
                 for r in rows], dtype=mx.float32)
        if filters.bias:
            out["bias"] = mx.array([bias_row(r.logit_bias, vocab_size) for r in rows],
                                   dtype=mx.float32)
        if filters.xtc:
            out["xtc_p"] = mx.array([r.xtc_probability for r in rows], dtype=mx.float32)
            out["xtc_threshold"] = mx.array([r.xtc_threshold for r in rows], dtype=mx.float32)
            keep = np.zeros((len(rows), vocab_size), bool)
            for k, r in zip(keep, rows):
                k[list(r.xtc_special)] = True
            out["xtc_keep"] = mx.array(keep)
        if any(filters.penalties):
            kinds = [[getattr(r.penalties, kind, None) or (0.0, 0) for kind in PENALTY_KINDS]
                     for r in rows]
            out["penalty"] = mx.array([[p for p, _ in row] for row in kinds], dtype=mx.float32)
            out["penalty_n"] = mx.array([[n for _, n in row] for row in kinds], dtype=mx.int32)
        return cls(**out)

    def tree(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **kw) -> "SamplerArrays":
        return dataclasses.replace(self, **kw)

    def take_rows(self, rows: mx.array) -> "SamplerArrays":
        return SamplerArrays(**{n: None if x is None else x[rows] for n, x in self.tree().items()})

    @staticmethod
    def concat(a: "SamplerArrays", b: "SamplerArrays") -> "SamplerArrays":
        """a's rows, then b's; a setting only one side has is dropped (the
        batch's settings decide which exist)."""
        return SamplerArrays(**{n: None if x is None or y is None else mx.concatenate([x, y])
                                for (n, x), y in zip(a.tree().items(), b.tree().values())})


# -- penalties over a window of each row's last tokens ----------------------------------------
# A row's `window` [W] holds the last W tokens fed to the trunk before its
# last emitted one (-1 where the history is shorter); a position's context is
# that window, then the tokens of the cycle up to it, as mlx_lm's processors
# see the history at that point of plain decoding.
def start_window(history: Sequence[int]) -> mx.array:
    """A row's window [1, PENALTY_WINDOW] over its history before the last token."""
    last = list(history)[-PENALTY_WINDOW:]
    return mx.array([[-1] * (PENALTY_WINDOW - len(last)) + last], dtype=mx.int32)


def advance_window(window: mx.array, tokens: mx.array, fed: mx.array) -> mx.array:
    """The window after each row fed its first `fed` [B] tokens [B, T] (the
    last one emitted is not fed yet)."""
    W = window.shape[1]
    ext = mx.concatenate([window, tokens.astype(mx.int32)], axis=1)
    return mx.take_along_axis(ext, fed[:, None].astype(mx.int32) + mx.arange(W), axis=1)


def penalize_rows(logits: mx.array, window: mx.array, tokens: mx.array, offset: int,
                  arrays: SamplerArrays, f: Filters) -> mx.array:
    """mlx_lm's repetition, presence and frequency processors, in its order
    and arithmetic, each row with its own penalties and context sizes, over
    logits [B, T, V]: position i sees the window, then tokens[:, : offset + i + 1].
    Repetition and presence change each token seen once (mlx_lm's gather and
    assignment), frequency once per occurrence (its scatter-add)."""
    B, T, V = logits.shape
    W = window.shape[1]
    ext = mx.concatenate([window, tokens[:, :offset + T].astype(mx.int32)], axis=1)
    context = mx.take(ext, offset + 1 + mx.arange(T)[:, None] + mx.arange(W), axis=1)  # [B, T, W]
    age = (W - 1) - mx.arange(W)  # 0: the newest token
    b, t = mx.arange(B)[:, None, None], mx.arange(T)[None, :, None]
    for j, kind in enumerate(PENALTY_KINDS):
        if not f.penalties[j]:
            continue
        counted = (context >= 0) & (age < arrays.penalty_n[:, j, None, None])
        ids = mx.where(counted, context, 0)
        p = arrays.penalty[:, j, None, None].astype(logits.dtype)
        if kind == "frequency":  # x + (-0.0) is x: uncounted entries change nothing
            logits = logits.at[b, t, ids].add(mx.where(counted, -p, mx.array(-0.0, p.dtype)))
            continue
        seen = mx.zeros((B, T, V), mx.int32).at[b, t, ids].add(counted.astype(mx.int32)) > 0
        if kind == "repetition":
            logits = mx.where(seen, mx.where(logits < 0, logits * p, logits / p), logits)
        else:
            logits = mx.where(seen, logits - p, logits)
    return logits


def _per_row(x: mx.array, like: mx.array) -> mx.array:
    """A per-row value [B] broadcast against [B, ..., V]."""
    return x.reshape(x.shape + (1,) * (like.ndim - 1))


def filter_rows(logprobs: mx.array, arrays: SamplerArrays, f: Filters, top_k: bool = True) -> mx.array:
    """Each sampled row's top-p, min-p and the shared top-k, in mlx_lm's
    order, over [B, ..., V]; removed tokens get -inf (a row whose setting
    is off keeps its log-probs unchanged)."""
    if f.top_p:
        p = _per_row(arrays.top_p, logprobs)
        logprobs = mx.where((p > 0) & (p < 1), apply_top_p(logprobs, p), logprobs)
    if f.min_p:  # mlx_lm's apply_min_p with a threshold per row
        top = mx.max(logprobs, axis=-1, keepdims=True)
        remove = logprobs < top + _per_row(arrays.min_p_log, logprobs)
        if f.min_keep > 1:
            keep = mx.argpartition(logprobs, kth=-f.min_keep, axis=-1)[..., -f.min_keep:]
            remove = mx.put_along_axis(remove, keep, mx.array(False), axis=-1)
        logprobs = mx.where(remove, -float("inf"), logprobs)
    return _top_k(logprobs, f) if top_k else logprobs


def _xtc_excluded(logprobs: mx.array, arrays: SamplerArrays) -> mx.array:
    """mlx_lm's `apply_xtc` when its coin says apply: every token more probable
    than the least probable one above the row's threshold removed (special
    tokens kept)."""
    probs = mx.softmax(logprobs, -1)
    threshold = _per_row(arrays.xtc_threshold, probs)
    least = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    keep = arrays.xtc_keep if probs.ndim == 2 else arrays.xtc_keep[:, None]
    return mx.where((probs > least) & ~keep, -mx.inf, logprobs)


def _top_k(logprobs: mx.array, f: Filters) -> mx.array:
    return apply_top_k(logprobs, f.top_k) if f.top_k > 0 else logprobs


def target_rows(logprobs: mx.array, arrays: SamplerArrays, f: Filters, inv_t: mx.array) -> mx.array:
    """Logits [B, ..., V] whose softmax is each row's sampling distribution
    at inverse temperature inv_t: mlx_lm's filters in its order (top-p,
    min-p, XTC, top-k), then the temperature."""
    return _target_of_kept(filter_rows(logprobs, arrays, f, top_k=False), arrays, f, inv_t)


def _target_of_kept(kept: mx.array, arrays: SamplerArrays, f: Filters, inv_t: mx.array) -> mx.array:
    """`target_rows` from log-probs already through top-p and min-p. XTC
    applies with probability xtc_p on mlx_lm's coin: as one distribution,
    the mixture xtc_p * p(excluded) + (1 - xtc_p) * p(kept), which
    Leviathan–Chen verifies exactly like any other (rows without XTC:
    unchanged logits)."""
    plain = _scaled(_top_k(kept, f), inv_t)
    if not f.xtc:
        return plain
    excluded = _scaled(_top_k(_xtc_excluded(kept, arrays), f), inv_t)
    w = _per_row(arrays.xtc_p, plain)
    mixture = w * mx.softmax(excluded.astype(mx.float32), axis=-1) + (1 - w) * mx.softmax(
        plain.astype(mx.float32), axis=-1)
    return mx.where(w > 0, mx.log(mixture), plain)


def _scaled(logits: mx.array, inv_t: mx.array) -> mx.array:
    """logits * (1 / t) per row; rows with inv_t 0 (greedy) get finite garbage."""
    inv_t = _per_row(inv_t, logits)
    return logits * mx.where(inv_t > 0, inv_t, 1.0)


def sample_rows(logprobs: mx.array, arrays: SamplerArrays, f: Filters, keys) -> mx.array:
    """One token per row of [B, V]: greedy rows arg-max, sampled rows a draw
    from their target distribution with their key."""
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if not f.sampled:
        return greedy
    target = target_rows(logprobs, arrays, f, arrays.inv_temp)
    drawn = categorical_rows(target, keys).astype(mx.int32)
    return mx.where(arrays.inv_temp > 0, drawn, greedy)


def sample_opaque(sampler, logprobs: mx.array) -> mx.array:
    """An opaque sampler's token for every row of [B, T, V]: called once per
    position, as plain decoding calls it once per token (XTC, for one, draws
    one coin per call for all its rows)."""
    B, T, V = logprobs.shape
    rows = []
    for t in range(T):
        out = sampler(logprobs[:, t])
        if not isinstance(out, mx.array) or out.size != B:
            shape = getattr(out, "shape", type(out).__name__)
            raise TypeError(f"the sampler returned {shape} for log-probabilities of shape "
                            f"{tuple(logprobs[:, t].shape)}: it must return one token id per row")
        rows.append(out.astype(mx.int32).reshape(B))
    return mx.stack(rows, axis=1)


def sample_drafts(logprobs: mx.array, arrays: SamplerArrays, f: Filters, keys) -> Tuple[mx.array, mx.array]:
    """Each row's draft from the head's log-probs [B, V] and the distribution
    q [B, V] it was drawn from (one-hot for greedy drafts)."""
    kept = filter_rows(logprobs, arrays, f, top_k=False)  # once, for both kinds of draft
    greedy = mx.argmax(_top_k(kept, f), axis=-1).astype(mx.int32)
    logits = _target_of_kept(kept.astype(mx.float32), arrays, f, arrays.inv_draft_temp)
    drawn = categorical_rows(logits, keys).astype(mx.int32)
    sampled = arrays.inv_draft_temp > 0
    tok = mx.where(sampled, drawn, greedy)
    one_hot = (mx.arange(logprobs.shape[-1]) == greedy[:, None]).astype(mx.float32)
    return tok, mx.where(sampled[:, None], mx.softmax(logits, axis=-1), one_hot)


# -- a sampled row's key ------------------------------------------------------------
def mix_seed(seed: int) -> int:
    """splitmix64 of the user's seed. MLX keys of nearby seeds give measurably
    correlated samples; mixing makes runs with seeds 0, 1, 2, ... independent."""
    m = (1 << 64) - 1
    z = (int(seed) + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def row_key(sampling: Optional[RowSampling], seed: Optional[int]) -> Optional[mx.array]:
    """A sampled row's key [1, 2] (None when greedy): from the seed, else
    drawn from mx.random (so mx.random.seed makes runs repeatable too)."""
    if sampling is None or sampling.greedy:
        return None
    key = (mx.random.key(mix_seed(seed)) if seed is not None
           else mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32))
    return key[None]
