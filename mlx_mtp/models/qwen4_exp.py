"""Qwen3.8-Flash-Next (`qwen4_exp`): the trunk, as an mlx_lm model file.

mlx-lm 0.32.2 has no such model, so the project carries it, built from
mlx_lm's pieces where they fit: Qwen3.5's GatedDeltaNet, Qwen3-Next's gated
attention and sparse MoE block (`SwitchGLU` experts), RoPE, RMSNorm. It
imports nothing but MLX and mlx_lm, so it could go upstream as it is. What
is new, written from transformers' `qwen4_exp` modeling code:

- hyper-connections: the residual is `hc_count` streams of `hidden_size`,
  mixed into one block input before each block and re-injected after;
  a final mixer collapses them (there is no final RMSNorm);
- QSA: the attention layers attend only to the key blocks a learned indexer
  picks (top `indexer_budget / indexer_compress_ratio` mean-pooled blocks)
  plus the incomplete tail block;
- PLE: hashed n-gram embeddings of the token ids gate a per-stream value,
  followed by a dilated depthwise convolution over recent positions.

Caches are mlx_lm's own kinds, composed, so `save_prompt_cache`,
`load_prompt_cache` and `trim_prompt_cache` work unchanged:
GDN layer -> `ArraysCache(2)` [conv window, recurrent state], or
`ArraysCache(4)` with PLE [.., PLE conv window, last n-1 token ids];
QSA layer -> `CacheList(KVCache, KVCache, KVCache)`: attention K/V, the
indexer's raw keys, its pooled block keys (as keys; values are zero-width).

`Model` is the trunk alone (`mtp.*` dropped by its `sanitize`). A cache
object may ask a PLE layer to keep what a later rollback needs
(`capturing`); mlx_mtp's MTP hooks are in `mlx_mtp/families/qwen4_exp.py`.
See docs/qwen4_exp.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.base import BaseModelArgs, create_ssm_mask, gather_last_axis
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache
from mlx_lm.models.pipeline import PipelineMixin


# ------------------------------------------------------------------ config


@dataclass
class TextModelArgs(qwen3_5.TextModelArgs):
    """Config keys as transformers' `Qwen4ExpTextConfig` reads them."""

    model_type: str = "qwen4_exp_text"
    head_dim: Optional[int] = 256
    hidden_act: str = "silu"
    layer_types: Optional[List[str]] = None
    eos_token_id: Any = None
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: Optional[List[int]] = None
    ple_embed_dim: Optional[int] = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: Optional[int] = None
    indexer_kv_heads: Optional[int] = None
    indexer_head_dim: Optional[int] = None
    indexer_budget: Optional[int] = None
    indexer_compress_ratio: Optional[int] = None
    output_gate_type: Optional[str] = None

    def __post_init__(self):
        super().__post_init__()
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        if self.layer_types is None:
            self.layer_types = [
                "linear_attention" if (i + 1) % self.full_attention_interval else "indexed_attention"
                for i in range(self.num_hidden_layers)
            ]
        # released configs write "full_attention" for the indexed layers
        self.layer_types = [
            "indexed_attention" if t == "full_attention" else t for t in self.layer_types
        ]
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None
        if self.ple_layer_ids and self.eos_token_id is None:
            raise ValueError("qwen4_exp: PLE layers need eos_token_id (it pads the n-gram context)")
        qsa = (self.indexer_n_heads, self.indexer_kv_heads, self.indexer_head_dim,
               self.indexer_budget, self.indexer_compress_ratio)
        # transformers builds the indexer on every attention layer: no QSA fields, no model
        if "indexed_attention" in self.layer_types and None in qsa:
            raise ValueError("qwen4_exp: attention layers need the indexer_* (QSA) fields")
        if self.indexer_kv_heads not in (None, 1):
            raise ValueError("qwen4_exp: QSA needs indexer_kv_heads=1")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    text_config: dict

    @classmethod
    def from_dict(cls, params):
        if "text_config" not in params:
            return cls(model_type=params["model_type"], text_config=params)
        tc = dict(params["text_config"])
        # eos sits at the top level of the released config
        if tc.get("eos_token_id") is None and params.get("eos_token_id") is not None:
            tc["eos_token_id"] = params["eos_token_id"]
        return cls(model_type=params["model_type"], text_config=tc)


# ------------------------------------------------------------------ pieces


class GroupedRMSNorm(nn.Module):
    """RMSNorm over each `group` features of a wider vector (the `hc_count`
    streams are normalised one by one), weight over the whole width."""

    def __init__(self, dims: int, group: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group, self.eps = group, eps

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        y = mx.fast.rms_norm(x.reshape(*shape[:-1], -1, self.group), None, self.eps)
        return y.reshape(shape) * self.weight


class HyperConnection(nn.Module):
    """transformers' `Qwen4ExpTextGatedResidual`: mixes the streams into one
    block input; with `use_combine`, also the per-stream injection weights."""

    def __init__(self, args: TextModelArgs, use_combine: bool = True):
        super().__init__()
        self.hc, self.hidden = args.hc_count, args.hidden_size
        width = self.hc * self.hidden
        self.hc_norm = GroupedRMSNorm(width, self.hidden, args.rms_norm_eps)
        self.input_mix_weight_down = nn.Linear(width, args.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(args.hc_lowrank, width, bias=False)
        if use_combine:
            self.block_inject_weight = nn.Linear(width, self.hc, bias=False)
        self.use_combine = use_combine

    def __call__(self, x: mx.array):
        xn = self.hc_norm(x)
        w = nn.silu(self.input_mix_weight_down(xn) / self.hc)
        w = mx.sigmoid(self.input_mix_weight_up(w))
        mixed = (w * xn).reshape(*x.shape[:-1], self.hc, self.hidden).mean(axis=-2)
        if not self.use_combine:
            return mixed
        return mixed, 2 * mx.sigmoid(self.block_inject_weight(xn) / self.hc)


def inject(x: mx.array, out: mx.array, weights: mx.array) -> mx.array:
    """Residual: each stream gets the block output times its weight."""
    return x + (out[..., None, :] * weights[..., :, None]).reshape(x.shape)


class GatedRMSNorm(qwen3_next.Qwen3NextRMSNormGated):
    """Qwen3-Next's gated norm, with the gate activation the config names
    (`output_gate_type`: silu as mlx_lm's, or sigmoid)."""

    def __init__(self, dims: int, eps: float, activation: str):
        super().__init__(dims, eps)
        self.activation = activation

    def __call__(self, x, gate=None):
        if self.activation == "silu" or gate is None:
            return super().__call__(x, gate)
        y = mx.fast.rms_norm(x, self.weight, self.eps).astype(mx.float32)
        return (y * mx.sigmoid(gate.astype(mx.float32))).astype(x.dtype)


class GatedDeltaNet(qwen3_5.GatedDeltaNet):
    def __init__(self, args: TextModelArgs):
        super().__init__(args)
        act = args.output_gate_type or args.hidden_act
        if act not in ("silu", "sigmoid"):
            raise ValueError(f"qwen4_exp: unsupported output gate {act!r}")
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps, act)


# ------------------------------------------------------------------ PLE

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2, _PRIME_1 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> List[int]:
    """Odd hash multipliers of one PLE layer (transformers' `_build_layer_multipliers`);
    small enough that token * multiplier never overflows int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def ngram_head_sizes(args: TextModelArgs, ple_index: int) -> List[int]:
    """Each hashed head's table size: the (g+1)-th prime above the base, g the
    head's index over all PLE layers."""
    heads = (args.ngram_size - 1) * args.heads_per_ngram
    sizes, p = [], args.ngram_vocab_size_base - 1
    for g in range(ple_index * heads + heads):
        p += 1
        while not _is_prime(p):
            p += 1
        if g >= ple_index * heads:
            sizes.append(p)
    return sizes


def chunk_rows(rows: int, parts: int) -> List[int]:
    """The row counts of torch.chunk(table, parts) (how the release stores
    each n-gram table): chunks of ceil(rows / parts) rows, the last shorter,
    so there may be fewer than `parts`."""
    step = -(-rows // parts)
    return [min(step, rows - lo) for lo in range(0, rows, step)]


# At most this many arrays per n-gram table: a lookup costs one take per array
# (measured on a CPU, 16 ids: 0.10 ms with 1, 2.6 ms with 64, 25 ms with 512),
# and a load joins at most one group at a time (~1/NGRAM_GROUPS of a table).
NGRAM_GROUPS = 8


def group_shards(shards: int, groups: int) -> List[tuple]:
    """[first, last] checkpoint shard of each group: consecutive shards,
    `groups` groups as even as can be (one shard each when there are no
    more shards than groups)."""
    groups = min(groups, shards)
    return [(g * shards // groups, (g + 1) * shards // groups - 1) for g in range(groups)]


def piece_name(first: int, last: int) -> str:
    """A group's parameter name: `shard_{i}` (one checkpoint shard, named as
    the checkpoint names it) or `shards_{first}_{last}` (shards first..last)."""
    return f"shard_{first}" if first == last else f"shards_{first}_{last}"


_PIECE_NAME = re.compile(r"^(?:shard_(\d+)|shards_(\d+)_(\d+))$")


class RowShardedEmbedding(nn.Module):
    """An embedding table kept as groups of the checkpoint's row shards, never
    joined whole: at most `groups` arrays, each the rows of consecutive
    shards (`piece_name`; an `nn.Embedding`, or `nn.QuantizedEmbedding` once
    quantized), its bounds derived from the shards' rows alone (the config),
    before any weight is seen. A lookup takes each id from the group holding
    its row (one take per group): exactly the joined table's lookup. Rows
    this module does not hold (dropped by `keep_rows`) read as zeros."""

    def __init__(self, rows: List[int], dims: int, groups: int = NGRAM_GROUPS):
        super().__init__()
        self.total_rows = sum(rows)
        self.shard_starts = [sum(rows[:i]) for i in range(len(rows) + 1)]  # (and the end)
        bounds = group_shards(len(rows), groups)
        self._names = [piece_name(a, b) for a, b in bounds]
        self._starts = [self.shard_starts[a] for a, _ in bounds]
        for name, (a, b) in zip(self._names, bounds):
            setattr(self, name, nn.Embedding(self.shard_starts[b + 1] - self.shard_starts[a], dims))

    def pieces(self):
        """(name, first row in the whole table, rows) of each group held."""
        return [(name, start, self[name].weight.shape[0]) for name, start in zip(self._names, self._starts)]

    def rows_of(self, name: str) -> tuple:
        """[start, end) rows of the whole table that a piece name covers
        (`shard_{i}`, `shards_{a}_{b}`: of the checkpoint's shards)."""
        m = _PIECE_NAME.match(name)
        if m is None:
            raise ValueError(f"not an n-gram table piece: {name}")
        a, b = (int(m.group(1)),) * 2 if m.group(1) else (int(m.group(2)), int(m.group(3)))
        if not 0 <= a <= b < len(self.shard_starts) - 1:
            raise ValueError(f"{name}: the config's table has {len(self.shard_starts) - 1} shards")
        return self.shard_starts[a], self.shard_starts[b + 1]

    def regroup(self, parts: List[tuple]) -> dict:
        """Arrays holding rows of the whole table (one leaf: the weight, or a
        quantization's scales / biases: rows are independent), as
        [(first row, array)] (checkpoint shards, groups, or the table joined
        whole, as older conversions wrote it) -> {group name: array}: a
        part that is a group is passed as it is, a group inside a part is a
        view of it (no copy), a group over several parts joins them (only
        its own rows: at most one group's worth at a time). A group whose
        rows are not all there is left out (a strict load names it)."""
        parts = sorted(parts, key=lambda p: p[0])
        out = {}
        for name, start, n in self.pieces():
            end, pieces, covered = start + n, [], 0
            for lo, w in parts:
                a, b = max(start, lo), min(end, lo + w.shape[0])
                if a < b:
                    pieces.append(w if (a, b) == (lo, lo + w.shape[0]) else w[a - lo : b - lo])
                    covered += b - a
            if covered == n:  # (the parts' rows are disjoint: a checkpoint's)
                out[name] = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
        return out

    def keep_rows(self, lo: int, hi: int):
        """Keep only rows [lo, hi) of the whole table: groups inside stay as
        they are, a group across a bound is sliced, the others are dropped
        (with a lazy load, never read). `mx.contiguous` copies what is a
        view (a sliced group; a joined table's cut), so the rest of its
        buffer is freed, and leaves an array of its own as it is."""
        names, starts = [], []
        for name, start, n in self.pieces():
            a, b = max(lo, start), min(hi, start + n)
            if a >= b:
                delattr(self, name)
                continue
            group = self[name]
            group.update(tree_map(lambda w: mx.contiguous(w[a - start : b - start]), group.parameters()))
            names.append(name)
            starts.append(a)
        self._names, self._starts = names, starts

    def __call__(self, ids: mx.array) -> mx.array:
        out = None
        for name, start, n in self.pieces():
            if start == 0 and n == self.total_rows:
                return self[name](ids)
            local = ids - start
            here = local.astype(mx.uint32) < n  # (negative offsets wrap past n)
            e = self[name](mx.where(here, local, 0))
            out = mx.where(here[..., None], e, 0 if out is None else out)
        return out


class NGramEmbedding(nn.Module):
    """Hashed 2..n-gram embeddings; n-grams do not reach across an EOS."""

    def __init__(self, args: TextModelArgs, ple_index: int):
        super().__init__()
        self.n = args.ngram_size
        self.per_ngram = args.heads_per_ngram
        heads = (self.n - 1) * self.per_ngram
        self.eos = int(args.eos_token_id)
        sizes = ngram_head_sizes(args, ple_index)
        offsets = [sum(sizes[:i]) for i in range(heads)]
        div = args.make_ngram_vocab_size_divisible_by
        padded = -(-sum(sizes) // div) * div
        # derived from the config: private, not parameters
        self._mult = [int(m) for m in ngram_multipliers(args.vocab_size, self.n, ple_index, args.seed)]
        self._sizes = mx.array(sizes, dtype=mx.int64)
        self._offsets = mx.array(offsets, dtype=mx.int64)
        # as the release stores it, torch.chunk'ed rows (`shard_{i}`), in at
        # most NGRAM_GROUPS groups of consecutive shards (never joined whole)
        self.ngram_embedding = RowShardedEmbedding(chunk_rows(padded, args.split_ngram_parts),
                                                   args.ple_embed_dim // heads, NGRAM_GROUPS)
        self.sharding_group = None  # tensor parallel: each rank holds a block of rows

    def __call__(self, history: mx.array, length: int) -> mx.array:
        """history [B, n-1+L] int: the n-1 previous ids, then the L new ones."""
        B, T = history.shape
        h = history.astype(mx.int64)
        pos = mx.arange(T)
        is_eos = h == self.eos
        eos_pos = mx.where(is_eos, pos, -1)
        prev = mx.concatenate([mx.full((B, 1), -1, mx.int64), mx.cummax(eos_pos, axis=1)[:, :-1]], axis=1)
        in_segment = pos[None] - (prev + 1)  # position within the EOS-delimited segment
        shifted = [h]
        for s in range(1, self.n):
            src = mx.concatenate([mx.full((B, s), self.eos, mx.int64), h[:, : T - s]], axis=1)
            shifted.append(mx.where(in_segment >= s, src, self.eos))
        blocks = []
        for n in range(2, self.n + 1):
            mixed = shifted[0] * self._mult[0]
            for p in range(1, n):
                mixed = mx.bitwise_xor(mixed, shifted[p] * self._mult[p])
            lo = (n - 2) * self.per_ngram
            sizes = self._sizes[lo : lo + self.per_ngram]
            blocks.append(mx.remainder(mixed[..., None], sizes) + self._offsets[lo : lo + self.per_ngram])
        ids = mx.concatenate(blocks, axis=-1)[:, -length:].astype(mx.int32)
        e = self.ngram_embedding(ids)
        if self.sharding_group is not None:
            # each rank holds a block of rows, the others' read as zeros:
            # the sum over ranks is each row itself, bit for bit
            e = mx.distributed.all_sum(e, group=self.sharding_group)
        return e.reshape(B, length, -1)


class PLELayer(nn.Module):
    """transformers' `Qwen4ExpTextPLELayer`: n-gram features gate a value per
    stream; a dilated depthwise conv adds recent positions' gated values."""

    def __init__(self, args: TextModelArgs, ple_index: int):
        super().__init__()
        self.hc, self.hidden = args.hc_count, args.hidden_size
        width = self.hc * self.hidden
        self.context = args.ngram_size - 1
        self.eos = int(args.eos_token_id)
        self.dilation = args.ngram_size
        self.state_len = (args.ple_conv_kernel_size - 1) * self.dilation
        self.ple_embedding = NGramEmbedding(args, ple_index)
        self.key_proj = nn.Linear(args.ple_embed_dim, width, bias=False)
        self.value_proj = nn.Linear(args.ple_embed_dim, self.hidden, bias=False)
        eps = args.rms_norm_eps
        self.norm_key = GroupedRMSNorm(width, self.hidden, eps)
        self.norm_query = GroupedRMSNorm(width, self.hidden, eps)
        self.norm_conv = GroupedRMSNorm(width, self.hidden, eps)
        self.conv1d = nn.Conv1d(width, width, args.ple_conv_kernel_size,
                                dilation=self.dilation, groups=width, bias=False)

    def __call__(self, x: mx.array, inputs: mx.array, mask=None, cache=None) -> mx.array:
        """mask [B, L] (a batched prefill's: mlx_lm's `ArraysCache.make_mask`,
        the GDN's own): each row's valid positions, one run; they are moved to
        the front, so its n-grams and conv window continue the row's own
        context and never see padding, and its windows are kept at its end."""
        L = x.shape[1]
        if mask is not None:
            valid = mask.astype(mx.int32)
            start = mx.argmax(valid, axis=1)[:, None].astype(mx.int32)  # first valid position
            count = valid.sum(axis=1)[:, None]
            at = mx.minimum(mx.arange(L)[None] + start, L - 1)
            out = self._run(mx.take_along_axis(x, at[..., None], axis=1),
                            mx.take_along_axis(inputs, at, axis=1), count, cache)
            back = mx.maximum(mx.arange(L)[None] - start, 0)
            return mx.take_along_axis(out, back[..., None], axis=1)
        return self._run(x, inputs, None, cache)

    def _run(self, x: mx.array, inputs: mx.array, count, cache) -> mx.array:
        """The layer over rows whose valid positions are the first `count`
        [B, 1] (None: all of them)."""
        B, L, _ = x.shape
        ctx = cache[3] if cache is not None and cache[3] is not None else None
        if ctx is None:
            ctx = mx.full((B, self.context), self.eos, dtype=inputs.dtype)
        history = mx.concatenate([ctx, inputs.astype(ctx.dtype)], axis=1)
        emb = self.ple_embedding(history, L)
        key = self.norm_key(self.key_proj(emb)).reshape(B, L, self.hc, self.hidden)
        value = self.value_proj(emb)
        query = self.norm_query(x).reshape(B, L, self.hc, self.hidden)
        gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(self.hidden)
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        gated = (mx.sigmoid(gate) * value[..., None, :]).reshape(B, L, -1)
        normed = self.norm_conv(gated)

        state = cache[2] if cache is not None and cache[2] is not None else None
        if state is None:
            state = mx.zeros((B, self.state_len, normed.shape[-1]), dtype=normed.dtype)
        conv_in = mx.concatenate([state, normed], axis=1)
        if getattr(cache, "capturing", False):  # a verify: the commit picks the windows
            cache.captured_ple = (conv_in, history)
        if cache is not None:
            if count is None:
                cache[2] = mx.contiguous(conv_in[:, -self.state_len :])
                cache[3] = mx.contiguous(history[:, -self.context :])
            else:  # the windows ending at each row's last valid position
                at = count + mx.arange(self.state_len)[None]
                cache[2] = mx.take_along_axis(conv_in, at[..., None], axis=1)
                at = count + mx.arange(self.context)[None]
                cache[3] = mx.take_along_axis(history, at, axis=1)
        return gated + nn.silu(self.conv1d(conv_in))


# ------------------------------------------------------------------ QSA


class QSAIndexer(nn.Module):
    """transformers' `Qwen4ExpTextQSAIndexer`, vectorised: which keys each
    query may attend to, as a boolean mask [B, 1, L, T].

    Its cache is a pair of KV caches as long as the attention's: the raw
    indexer keys, and the pooled block keys, each block's (mean, norm, rope)
    kept at the block's last position (zeros elsewhere). A block is pooled
    once, in the call where its last token arrives, from the raw keys; so a
    rollback (the lengths cut) also drops the blocks it cut, and a decode
    step pools at most one block of `indexer_compress_ratio` raw keys."""

    def __init__(self, args: TextModelArgs, rope_dims: int, rope_base: float):
        super().__init__()
        self.n_heads, self.head_dim = args.indexer_n_heads, args.indexer_head_dim
        self.ratio = args.indexer_compress_ratio
        self.block_topk = args.indexer_budget // self.ratio
        self.index_qk_proj = nn.Linear(args.hidden_size, (self.n_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_layernorm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope_dims, self.rope_base = rope_dims, rope_base

    def __call__(self, x: mx.array, cache=None, offset=0, positions=None) -> mx.array:
        """cache: (raw keys, pooled keys) caches, or None. positions: where
        the rope puts the tokens when not at their index (None: at their
        index; otherwise only `rope_queries` / `rope_blocks` of a subclass
        read it: mlx_mtp's images). offset: the cache's
        length, an int (mlx_lm's KVCache) or one per row [B] (mlx_mtp's
        PaddedKVCache, whose keys span its whole buffer: entries past a row's
        length are never selected, being after every query of that row;
        mlx_lm's BatchKVCache in a batched prefill, whose rows start after
        their `left_padding`: each row's blocks are counted from its first
        real key, and the mask is put back in the buffer's places, the
        padding masked)."""
        B, L, _ = x.shape
        d, r = self.head_dim, self.ratio
        qk = self.index_qk_proj(x)
        q = self.q_layernorm(qk[..., : self.n_heads * d].reshape(B, L, self.n_heads, d))
        q = self.rope_queries(q.transpose(0, 2, 1, 3), offset, positions)
        keys = qk[..., self.n_heads * d :][:, None]  # [B, 1, L, d], raw (pooled before the norm)
        if cache is None:
            nb = L // r
            blocks = self._pool(keys[:, 0, : nb * r].reshape(B, nb, r, d), 0, positions)
            return self._select(q, blocks, offset, L)
        raw_cache, pooled_cache = cache
        zero = mx.zeros((B, 1, L, 0), dtype=keys.dtype)
        raw, _ = raw_cache.update_and_fetch(keys, zero)
        padding = getattr(raw_cache, "left_padding", None)
        T = raw.shape[2]
        pooled, _ = pooled_cache.update_and_fetch(
            self._completed(raw, offset, padding, L, positions), zero)
        # block j's key sits at its last position, (j+1)*r - 1 (+ the row's padding)
        nb = T // r
        if padding is None:
            # (contiguous: MLX's CPU matmul is far slower on the strided slice)
            return self._select(q, mx.contiguous(pooled[:, 0, r - 1 : nb * r : r]), offset, T)
        at = mx.minimum((mx.arange(nb) + 1)[None] * r - 1 + padding[:, None], T - 1)
        blocks = mx.take_along_axis(pooled[:, 0], at[..., None], axis=1)
        mask = self._select(q, blocks, offset, T)  # [B, 1, L, T] over real positions
        back = mx.arange(T)[None] - padding[:, None]  # row b's real key t sits at t + padding[b]
        mask = mx.take_along_axis(mask, mx.maximum(back, 0)[:, None, None], axis=-1)
        return mask & (back >= 0)[:, None, None]

    def rope_queries(self, q: mx.array, offset, positions) -> mx.array:
        """The queries [B, heads, L, d] roped at their indices from `offset`."""
        return mx.fast.rope(q, self.rope_dims, traditional=False, base=self.rope_base, scale=1.0,
                            offset=offset)

    def rope_blocks(self, blocks: mx.array, first, positions) -> mx.array:
        """Block keys [B, K, d] roped at each block's first token: block
        index `first` + k (an int or one per row [B]), token (first + k) * r."""
        return mx.fast.rope(blocks[:, None], self.rope_dims, traditional=False, base=self.rope_base,
                            scale=float(self.ratio), offset=first)[:, 0]

    def _pool(self, raw: mx.array, first, positions=None) -> mx.array:
        """Block keys [B, K, d] of raw keys [B, K, r, d]: the mean (in
        float32), normed, roped at each block's first position (block index
        `first` + k; `first` an int or one per row [B])."""
        blocks = raw.astype(mx.float32).mean(axis=2).astype(raw.dtype)
        return self.rope_blocks(self.k_layernorm(blocks), first, positions)

    def _completed(self, raw: mx.array, offset, padding, L: int, positions=None) -> mx.array:
        """What the pooled cache takes for the L new positions [B, 1, L, d]:
        the key of each block completing here at its last position, zeros
        elsewhere. At most ceil(L/r) blocks complete in L positions; they are
        pooled from the raw keys `raw` [B, 1, T, d] (after the update)."""
        B, _, T, d = raw.shape
        r, K = self.ratio, -(-L // self.ratio)
        if isinstance(offset, int) and padding is None and (offset + L) // r == offset // r:
            return mx.zeros((B, 1, L, d), raw.dtype)  # none completes (an mlx_lm KVCache's step)
        start = offset[:, None] if isinstance(offset, mx.array) else mx.array([[offset]])
        first = start // r  # the first block that can complete here [B or 1, 1]
        at = (first * r + mx.arange(K * r))[..., None]  # its raw keys and the next K-1 blocks'
        if padding is not None:
            at = at + padding[:, None, None]
        at = mx.broadcast_to(mx.clip(at, 0, T - 1), (B, K * r, 1))
        blocks = self._pool(mx.take_along_axis(raw[:, 0], at, axis=1).reshape(B, K, r, d),
                            mx.broadcast_to(first[:, 0], (B,)), positions)  # [B, K, d]
        end = start + mx.arange(1, L + 1)  # [B or 1, L]: one past each new position
        if K > 1:  # block first + k ends at position (first + k + 1) * r - 1
            which = mx.broadcast_to(mx.clip(end // r - 1 - first, 0, K - 1), (B, L))
            blocks = mx.take_along_axis(blocks, which[..., None], axis=1)
        ends = (end % r == 0) & (end > 0)  # (a prefill's left padding has positions < 0)
        return mx.where(ends[..., None], blocks, 0).astype(raw.dtype)[:, None]

    def _select(self, q: mx.array, blocks: mx.array, offset, T: int) -> mx.array:
        """The mask [B, 1, L, T] of queries q (roped at offset) over T keys
        whose index is their position, given the block keys [B, nb, d]
        (nb = T // r; blocks a query does not see complete are never chosen)."""
        B, _, L, _ = q.shape
        r, d = self.ratio, self.head_dim
        start = offset[:, None] if isinstance(offset, mx.array) else offset
        qpos = start + mx.arange(L)[None]  # absolute query positions [1 or B, L]
        kpos = mx.arange(T)
        n_full = (qpos + 1) // r  # complete blocks each query sees
        nb = T // r
        mask = kpos <= qpos[..., None]  # causal [1 or B, L, T]
        if nb == 0:
            return mask[:, None]
        scores = mx.maximum(q.astype(mx.float32) @ blocks.astype(mx.float32)[:, None].swapaxes(-1, -2), 0)
        scores = scores.sum(axis=1) / math.sqrt(d)  # [B, L, nb]
        valid = mx.arange(nb) < n_full[..., None]  # [1 or B, L, nb]
        if nb > self.block_topk:
            scores = mx.where(valid, scores, -mx.inf)
            top = mx.argpartition(scores, kth=nb - self.block_topk, axis=-1)[..., nb - self.block_topk :]
            chosen = (mx.arange(nb)[:, None] == top[..., None, :]).any(axis=-1) & valid
        else:
            chosen = mx.broadcast_to(valid, (B, L, nb))
        in_block = mx.repeat(chosen, r, axis=-1)  # [B, L, nb*r]
        if T > nb * r:
            in_block = mx.concatenate([in_block, mx.zeros((B, L, T - nb * r), dtype=mx.bool_)], axis=-1)
        tail = (kpos >= (n_full * r)[..., None]) & mask  # the incomplete block, causal
        return (in_block | tail)[:, None]


class Attention(qwen3_next.Qwen3NextAttention):
    """Qwen3.5's gated attention, restricted to the keys QSA selects."""

    def __init__(self, args: TextModelArgs):
        super().__init__(args)
        if not isinstance(self.rope, nn.RoPE):  # the block keys reuse plain RoPE at block starts
            raise NotImplementedError("qwen4_exp: QSA with a scaled RoPE")
        self.indexer = QSAIndexer(args, self.rope.dims, self.rope.base)

    def __call__(self, x: mx.array, cache=None) -> mx.array:
        kv, index = (cache[0], (cache[1], cache[2])) if cache is not None else (None, None)
        mask = self.indexer(x, index, kv.offset if kv is not None else 0)
        return super().__call__(x, mask, kv)


# ------------------------------------------------------------------ model


class DecoderLayer(nn.Module):
    def __init__(self, args: TextModelArgs, layer_idx: int):
        super().__init__()
        self.is_linear = args.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.mlp = qwen3_next.Qwen3NextSparseMoeBlock(args)
        self.has_ple = layer_idx + 1 in args.ple_layer_ids
        if self.has_ple:
            if not self.is_linear:
                raise ValueError("qwen4_exp: PLE only on linear_attention layers")
            self.ple = PLELayer(args, args.ple_layer_ids.index(layer_idx + 1))
        self.attn_hyper_connection = HyperConnection(args)
        self.mlp_hyper_connection = HyperConnection(args)

    def __call__(self, x, inputs, mask=None, cache=None):
        if self.has_ple:
            x = x + self.ple(x, inputs, mask, cache)
        h, w = self.attn_hyper_connection(x)
        h = self.linear_attn(h, mask, cache) if self.is_linear else self.self_attn(h, cache)
        x = inject(x, h, w)
        h, w = self.mlp_hyper_connection(x)
        return inject(x, self.mlp(h), w)


def _with_ids(x: mx.array, ids: mx.array) -> mx.array:
    """x with the token ids appended on its last axis, both as raw bits (one
    message between pipeline stages)."""
    bits = mx.uint16 if x.dtype.size == 2 else mx.uint32
    return mx.concatenate([x.view(bits), ids.astype(mx.int32)[..., None].view(bits)], axis=-1)


def _without_ids(message: mx.array, like: mx.array):
    """`_with_ids`'s x (as `like`'s dtype) and ids [B, L] (int32)."""
    width = like.shape[-1]
    return message[..., :width].view(like.dtype), message[..., width:].view(mx.int32)[..., 0]


class Qwen4ExpTextModel(PipelineMixin, nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.hyper_connection_mixer = HyperConnection(args, use_combine=False)
        self.ssm_idx = next((i for i, l in enumerate(self.layers) if l.is_linear), None)

    def pipeline(self, group, split=None):
        super().pipeline(group, split=split)
        self.ssm_idx = next((e for e, l in enumerate(self.pipeline_layers) if l.is_linear), None)

    def streams(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        """The `hc_count` residual streams after the last layer, [B, L, hc*H]
        (the MTP head reads these, before the mixer collapses them).
        `input_embeddings` [B, L, H]: in place of the tokens' own (an image's
        features at its pads); the PLE layers still hash the token ids, as
        transformers' `Qwen4ExpModel` passes them (`ple_input_ids`)."""
        if cache is None:
            cache = [None] * len(self.pipeline_layers)
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        ssm_mask = create_ssm_mask(h, cache[self.ssm_idx]) if self.ssm_idx is not None else None
        x = mx.tile(h, (1, 1, self.args.hc_count))

        # Pipeline: the streams come from the previous stage. PLE layers read
        # the token ids too; they travel with the streams, so that every stage
        # hashes the ids the first stage embedded (a speculative decoder's
        # drafts may differ by rank where ranks compute unequal floats)
        rank, size = self.pipeline_rank, self.pipeline_size
        with_ids = bool(self.args.ple_layer_ids)
        if rank < size - 1:
            if with_ids:
                x, inputs = _without_ids(mx.distributed.recv_like(_with_ids(x, inputs), rank + 1), x)
            else:
                x = mx.distributed.recv_like(x, rank + 1)

        for layer, c in zip(self.pipeline_layers, cache):
            x = layer(x, inputs, ssm_mask if layer.is_linear else None, c)

        # Send to the next stage
        if rank != 0:
            sent = mx.distributed.send(_with_ids(x, inputs) if with_ids else x, rank - 1)
            x = mx.depends(x, sent)
            if cache[-1] is not None:  # evaluating the cache sends too
                if self.pipeline_layers[-1].is_linear:  # ArraysCache: conv window first
                    cache[-1][0] = mx.depends(cache[-1][0], sent)
                else:  # CacheList: attention K/V first
                    cache[-1][0].keys = mx.depends(cache[-1][0].keys, sent)

        # Broadcast the streams while keeping them in the graph
        if size > 1:
            x = mx.distributed.all_gather(x)[: x.shape[0]]
        return x

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        return self.hyper_connection_mixer(self.streams(inputs, cache, input_embeddings))


class TextModel(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen4ExpTextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.sharding_group = None

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        out = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        out = self.lm_head(out)
        if self.sharding_group is not None:
            out = gather_last_axis(out, self.sharding_group)
        return out

    @property
    def layers(self):
        return self.model.pipeline_layers

    def make_cache(self):
        caches = []
        for l in self.layers:
            if l.is_linear:
                caches.append(ArraysCache(size=4 if l.has_ple else 2))
            else:  # attention K/V, the indexer's raw keys, its pooled block keys
                caches.append(CacheList(KVCache(), KVCache(), KVCache()))
        return caches


# Qwen4ExpTextRMSNorm is zero-centred ((1 + w)); shifted once at load so the
# MLX layout uses plain RMSNorm weights. The GDN's gated norm is not.
ZERO_CENTRED_NORMS = (".q_norm.weight", ".k_norm.weight", ".q_layernorm.weight", ".k_layernorm.weight",
                 ".hc_norm.weight", ".norm_key.weight", ".norm_query.weight", ".norm_conv.weight")
_DERIVED = (".layer_multipliers", ".ngram_heads_vocab_sizes", ".ngram_heads_offsets")
# an n-gram table's rows: a checkpoint shard (`shard_{i}`), a group of them
# (`shards_{a}_{b}`, as converted), or the table joined whole (no name: this
# project's conversions before the row shards were kept)
_TABLE = re.compile(r"^language_model\.model\.layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\."
                    r"(?:(\w+)\.)?(weight|scales|biases)$")


def mlx_name(name: str) -> str:
    """A trunk tensor's name in this file's layout (HF `model.language_model.*`
    -> `language_model.model.*`; `lm_head` etc. under `language_model.`)."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    return name if name.startswith("language_model.") else "language_model." + name


def table_tensor(name: str) -> Optional[tuple]:
    """(layer, piece name or None for a joined table, leaf) of an n-gram
    table tensor (HF or MLX name); None for any other tensor."""
    m = _TABLE.match(mlx_name(name))
    return None if m is None else (int(m.group(1)), m.group(2), m.group(3))


class Model(nn.Module):
    """`qwen4_exp` text trunk (vision tower and MTP head dropped). See docs/qwen4_exp.md."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = TextModel(TextModelArgs.from_dict(args.text_config))

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None):
        """input_embeddings: in place of the tokens' embeddings (the ids still
        feed the PLE layers)."""
        return self.language_model(inputs, cache, input_embeddings)

    @property
    def model(self):
        return self.language_model.model

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self):
        return self.language_model.make_cache()

    def shard(self, group=None):
        """Tensor parallel. The layers have Qwen3.5's layout, so Qwen3.5's
        shard splits what they share: the lm_head over the vocabulary, each
        GDN layer's heads, each attention layer's heads (q with its gate,
        k, v, o), each MoE's expert and shared-expert columns (`SwitchGLU`),
        with an all_sum after attention/GDN and after the MoE. Then each PLE
        layer's n-gram table by rows: it is most of the PLE weights, and the
        lookup is exact (each row comes from one rank, zeros from the
        others), for one more all_sum per PLE layer. Rank r keeps rows
        [r*R/N, (r+1)*R/N) of the table's R: the row groups inside whole,
        the one or two across a bound sliced, the others dropped unread
        (the table is never joined).

        Replicated: the QSA indexer (a few heads whose one choice of key
        blocks serves every attention head; split, its scores would need one
        more all_sum before the top-k, in another summation order than one
        process's), the hyper-connections (low-rank mixers over all streams,
        which every rank holds) and the rest of PLE (per-stream projections,
        norms and conv, small)."""
        group = group or mx.distributed.init()
        qwen3_5.Model.shard(self, group)
        for layer in self.layers:
            if layer.has_ple:
                table = layer.ple.ple_embedding
                R, N, r = table.ngram_embedding.total_rows, group.size(), group.rank()
                table.ngram_embedding.keep_rows(r * R // N, (r + 1) * R // N)
                table.sharding_group = group

    def sanitize(self, weights):
        """HF layout (`model.language_model.*`, `lm_head`, `model.visual.*`,
        `mtp.*`, row-sharded n-gram tables, fused or per-expert MoE, zero-centred
        norms, torch conv layout) or this class's MLX layout -> MLX layout."""
        hf = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())
        args = self.language_model.args
        out, tables = {}, {}
        for k, v in weights.items():
            if k.startswith(("vision_tower", "model.visual", "mtp.", "model.mtp.")) or k.endswith(_DERIVED):
                continue
            k = mlx_name(k)
            m = _TABLE.match(k)
            if m:  # regrouped below, table by table
                tables.setdefault((int(m.group(1)), m.group(3)), []).append((m.group(2), v))
                continue
            if hf:
                if k.endswith("conv1d.weight") and v.shape[-1] != 1:
                    v = v.moveaxis(2, 1)
                if k.endswith(ZERO_CENTRED_NORMS):
                    v = v + 1.0
            out[k] = v
        for (l, leaf), parts in tables.items():
            # into the module's groups: shards joined within a group only, a
            # group passed as it is, a joined table cut into views
            table = self.language_model.model.layers[l].ple.ple_embedding.ngram_embedding
            rows = []
            for name, v in parts:
                lo, hi = (0, table.total_rows) if name is None else table.rows_of(name)
                if v.shape[0] != hi - lo:
                    raise ValueError(f"layer {l} n-gram table {name or 'joined'}.{leaf}: {v.shape[0]} rows, "
                                     f"the config's split_ngram_parts gives {hi - lo}")
                rows.append((lo, v))
            for name, v in table.regroup(rows).items():
                out[f"language_model.model.layers.{l}.ple.ple_embedding.ngram_embedding.{name}.{leaf}"] = v
        if args.tie_word_embeddings:
            out.pop("language_model.lm_head.weight", None)
        for l in range(args.num_hidden_layers):
            p = f"language_model.model.layers.{l}.mlp"
            if f"{p}.experts.gate_up_proj" in out:
                gate_up = out.pop(f"{p}.experts.gate_up_proj")
                mid = gate_up.shape[-2] // 2
                out[f"{p}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
                out[f"{p}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
                out[f"{p}.switch_mlp.down_proj.weight"] = out.pop(f"{p}.experts.down_proj")
            elif f"{p}.experts.0.gate_proj.weight" in out:
                for n in ("gate_proj", "up_proj", "down_proj"):
                    out[f"{p}.switch_mlp.{n}.weight"] = mx.stack(
                        [out.pop(f"{p}.experts.{e}.{n}.weight") for e in range(args.num_experts)])
        return out

    @property
    def quant_predicate(self):
        def predicate(path, _):
            if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
                return {"group_size": 64, "bits": 8}
            return True

        return predicate

    @property
    def cast_predicate(self):
        return lambda path: not path.endswith("A_log")


# ------------------------------------------------------------------ MTP
#
# The hidden the decode cycle passes around (cycle.py: `trunk_hidden`, the
# head's output, the ring) is, for this family, [collapsed H | streams hc*H]:
# the first H features are what lm_head reads (the trunk's or the head's own
# mixer output), the rest the pre-collapse streams the head drafts from.
# So cycle.py needs no family branch: `lm_input` slices (docs/qwen4_exp.md).
