"""Qwen3.8-Flash-Next (`qwen4_exp`): the MTP hooks on its trunk.

The trunk is `mlx_mtp/models/qwen4_exp.py`, an mlx_lm model file.
`Qwen4ExpMTPModel` is what `mlx_mtp.load` builds: the trunk with the MTP
head (`MTPHead` here: split-add fusion on the per-stream hidden, one QSA
decoder layer, its own hyper-connection mixer), a verifying GDN layer, and
the PLE / QSA states rolled back after a verify. Prompts prefill together on
mlx_lm's batch caches (the indexer and the PLE read their padding). Images:
M-RoPE in the trunk's and the head's attention and indexer
(`PositionedAttention`). See docs/qwen4_exp.md.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache

from mlx_lm.models.qwen3_next import Qwen3NextAttention

from ..cache import CaptureCache
from ..model import LanguageModelTrunk, MTPModel, MTPWeightError
from ..models.qwen4_exp import (Attention, DecoderLayer, GatedDeltaNet, HyperConnection, Model,
                                ModelArgs, QSAIndexer, TextModelArgs, ZERO_CENTRED_NORMS)
from . import mrope
from .common import split_fused_experts, stack_expert_tensors
from .qwen3_5 import verify_capturing


class PositionedIndexer(QSAIndexer):
    """The QSA indexer whose queries and block keys also take M-RoPE
    positions (docs/qwen4_exp.md, "Images"): `positions` is `mrope.Positions`
    (a prefill over images: the forward's ids and the earlier tokens') or each
    row's delta [B] (text after an image: every axis at index + delta). A
    block key is roped at its first token's three ids, as transformers'
    indexer does; without positions it is the parent, unchanged."""

    def __init__(self, args: TextModelArgs, rope_dims: int, rope_base: float, sections):
        super().__init__(args, rope_dims, rope_base)
        self.mrope = mrope.MRoPE(nn.RoPE(rope_dims, traditional=False, base=rope_base), sections,
                                 interleaved=True)

    def rope_queries(self, q, offset, positions):
        if positions is None:
            return super().rope_queries(q, offset, None)
        if isinstance(positions, mrope.Positions):
            return self.mrope(q, mrope.Positions(positions.ids))
        return super().rope_queries(q, offset + positions, None)  # (mlx_lm's rope, shifted)

    def rope_blocks(self, blocks, first, positions):
        if positions is None:
            return super().rope_blocks(blocks, first, None)
        B, K, _ = blocks.shape
        first = mx.broadcast_to(mx.array(first) if isinstance(first, int) else first, (B,))
        index = (first[:, None] + mx.arange(K)[None]) * self.ratio  # each block's first token [B, K]
        if isinstance(positions, mrope.Positions):
            ids = positions.ids if positions.before is None else mx.concatenate(
                [positions.before, positions.ids], axis=-1)
            # (a block past the tokens so far is never kept: clipped, any ids do)
            at = mx.broadcast_to(mx.minimum(index, ids.shape[-1] - 1)[None], (3, B, K))
            ids = mx.take_along_axis(mx.broadcast_to(ids, (3, B, ids.shape[-1])), at, axis=-1)
        else:  # text after the last image: its index + the row's delta, on every axis
            ids = mx.broadcast_to((index + positions[:, None])[None], (3, B, K))
        return self.mrope(blocks[:, None], mrope.Positions(ids.astype(mx.int32)))[:, 0]


class PositionedAttention(Attention):
    """The QSA attention layer with M-RoPE (`PositionedIndexer`; the
    attention's rope wrapped in `mrope.MRoPE`), for prompts with images. Its
    cache list arrives wrapped in `mrope.PositionedCache` where the tokens are
    not at their index; unwrapped it is the parent, bit for bit."""

    def __init__(self, args: TextModelArgs, sections):
        super().__init__(args)
        self.indexer = PositionedIndexer(args, self.rope.dims, self.rope.base, sections)
        self.rope = mrope.MRoPE(self.rope, sections, interleaved=True)

    def __call__(self, x: mx.array, cache=None) -> mx.array:
        if not isinstance(cache, mrope.PositionedCache):
            return super().__call__(x, cache)
        positions, cache = cache.offset, cache.wrapped
        kv, index = cache[0], (cache[1], cache[2])
        # the indexer takes the positions, or each row's delta (the shifted offset - the index)
        mask = self.indexer(x, index, kv.offset, positions if isinstance(positions, mrope.Positions)
                            else positions - kv.offset)
        return Qwen3NextAttention.__call__(self, x, mask, mrope.PositionedCache(kv, positions))


def install_mrope(layers, args: TextModelArgs) -> bool:
    """Give each attention layer of `layers` M-RoPE (before its weights load:
    same parameters) when the config names an `mrope_section`; transformers'
    Qwen4Exp interleaves the axes always. Returns whether it did."""
    sections = (args.rope_parameters or {}).get("mrope_section")
    if not sections:
        return False
    for layer in layers:
        if not layer.is_linear and not isinstance(layer.self_attn, PositionedAttention):
            layer.self_attn = PositionedAttention(args, sections)
    return True


class MTPHead(nn.Module):
    """The released MTP head, as vLLM's `Qwen4ExpMultiTokenPredictor` and
    mlx-vlm's `qwen4_exp_mtp` drafter compute it: at pair (streams_p, tok_{p+1})

        e = fc_embedding(pre_fc_norm_embedding(embed(tok_{p+1})))       [H]
        s = fc_hidden(pre_fc_norm_hidden(streams_p) per stream) + e     [hc, H]
        s = decoder layer (QSA attention + MoE, hyper-connections)(s)
        -> [hyper_connection_mixer(s) | s]

    `pre_fc_norm_hidden` normalises all hc*H features at once (not per
    stream). The chained draft feeds s back as the next streams. Embedding
    and lm_head are the trunk's. One layer only: vLLM runs layer j at draft
    step j, mlx-vlm has one; every released config has one."""

    def __init__(self, args: TextModelArgs, num_layers: int = 1):
        super().__init__()
        if num_layers != 1:
            raise MTPWeightError(
                f"qwen4_exp: an MTP head of {num_layers} layers is not supported (released "
                "checkpoints have mtp_num_hidden_layers=1)")
        H, hc = args.hidden_size, args.hc_count
        self.hidden, self.hc = H, hc
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hc * H, eps=args.rms_norm_eps)
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        layer_args = dataclasses.replace(args, num_hidden_layers=1, layer_types=["indexed_attention"],
                                         ple_layer_ids=[])
        self.layers = [DecoderLayer(layer_args, 0)]
        install_mrope(self.layers, layer_args)
        self.hyper_connection_mixer = HyperConnection(layer_args, use_combine=False)

    def make_cache(self):
        return [CacheList(KVCache(), KVCache(), KVCache()) for _ in self.layers]

    def __call__(self, hidden: mx.array, token_embeddings: mx.array, cache=None) -> mx.array:
        """hidden [B, T, (hc+1)*H] (trunk or head: [collapsed | streams]) at
        positions p; token_embeddings [B, T, H] of the tokens at p+1."""
        B, T, _ = token_embeddings.shape
        e = self.fc_embedding(self.pre_fc_norm_embedding(token_embeddings))
        s = self.pre_fc_norm_hidden(hidden[..., self.hidden:]).reshape(B, T, self.hc, self.hidden)
        x = (self.fc_hidden(s) + e[..., None, :]).reshape(B, T, -1)
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            x = layer(x, None, None, c)
        return mx.concatenate([self.hyper_connection_mixer(x), x], axis=-1)


class VerifyingGatedDeltaNet(GatedDeltaNet):
    """This family's GDN (its gated norm) that, in a capturing cache, keeps
    what the commit needs: Qwen3.5's verify (families/qwen3_5.py), same parameters."""

    def __call__(self, inputs, mask=None, cache=None):
        if not (isinstance(cache, CaptureCache) and cache.capturing):
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return verify_capturing(self, cache, inputs, self.in_proj_qkv(inputs), z,
                                self.in_proj_b(inputs), self.in_proj_a(inputs))


# Zero-centred norms of the head (shifted +1 once, as the trunk's).
_HEAD_ZERO_CENTRED = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight") + tuple(
    n[1:] for n in ZERO_CENTRED_NORMS)


def is_unconverted(tensors: dict) -> bool:
    """`Model.sanitize`'s rule: an HF checkpoint has torch conv layout [C, 1, K].
    From names alone (shapes None): this MLX layout names the trunk
    `language_model.*`, the HF release `model.language_model.*`."""
    if all(shape is None for shape in tensors.values()):
        return not any(k.startswith("language_model.") for k in tensors)
    return any(k.endswith("conv1d.weight") and shape[-1] != 1 for k, shape in tensors.items())


def sanitize_head(weights: dict, num_layers: int, shift_norms: bool) -> dict:
    """The checkpoint's `mtp.*` in `MTPHead`'s layout: experts fused or per
    expert -> switch_mlp, zero-centred norms shifted once (HF source), the
    final mixer's unused `block_inject_weight` dropped (vLLM drops it too)."""
    weights = stack_expert_tensors(dict(weights), "mtp.")
    weights.pop("mtp.hyper_connection_mixer.block_inject_weight", None)
    for i in range(num_layers):
        split_fused_experts(weights, f"mtp.layers.{i}.mlp")
    if shift_norms:
        for k, v in weights.items():
            if k.endswith(_HEAD_ZERO_CENTRED):
                weights[k] = v + 1.0
    return weights


class Qwen4ExpMTPModel(LanguageModelTrunk, MTPModel, Model):
    """The trunk with its MTP head, as `mlx_mtp.load` builds it (model.py's
    family interface; docs/qwen4_exp.md)."""

    verifying_gdn = VerifyingGatedDeltaNet
    mtp_layers_key = "mtp_num_hidden_layers"
    float_dtype_tensor = "language_model.model.hyper_connection_mixer.hc_norm.weight"  # (no final norm)
    # mlx-vlm's drafter keeps the released zero-centred norms (its Qwen4ExpRMSNorm
    # applies 1 + w); the head's layer is built from these trunk keys too
    mlx_vlm_drafter, mlx_vlm_drafter_norms_shifted = "qwen4_exp_mtp", False
    head_match_keys = MTPModel.head_match_keys + (
        "hc_count", "hc_lowrank", "indexer_n_heads", "indexer_head_dim", "indexer_budget",
        "indexer_compress_ratio")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.takes_images = install_mrope(self.text_model.layers, self.text_args)
        self._init_mtp(args.text_config)

    @property
    def text_after_images(self) -> int:
        """A block completing while decoding is roped at its first token, at
        most `indexer_compress_ratio` - 1 tokens back: decoding knows it as
        index + delta only after the last image (docs/qwen4_exp.md, "Images")."""
        return self.text_args.indexer_compress_ratio

    @property
    def hidden_width(self) -> int:
        return (self.text_args.hc_count + 1) * self.text_args.hidden_size

    @classmethod
    def args_from_config(cls, config: dict):
        return TextModelArgs.from_dict(ModelArgs.from_dict(config).text_config)

    @classmethod
    def make_head(cls, args, num_layers: int) -> MTPHead:
        return MTPHead(args, num_layers)

    def trunk_hidden(self, tokens: mx.array, cache, embeddings=None) -> mx.array:
        """[collapsed | streams] [B, T, (hc+1)*H] (see above); `embeddings`:
        in place of the tokens' (an image's features at its pads)."""
        streams = self.text_model.streams(tokens, cache, embeddings)
        return mx.concatenate([self.text_model.hyper_connection_mixer(streams), streams], axis=-1)

    def lm_input(self, hidden: mx.array) -> mx.array:
        return hidden[..., : self.text_args.hidden_size]

    def empty_entry(self, shape, dtype) -> mx.array:
        # the PLE n-gram context (the only integer entry) starts as EOS, as `PLELayer` does
        if mx.issubdtype(dtype, mx.integer):
            return mx.full(shape, self.text_args.eos_token_id, dtype)
        return mx.zeros(shape, dtype)

    is_unconverted = staticmethod(is_unconverted)
    sanitize_head = staticmethod(sanitize_head)


MODEL_CLASSES = {"qwen4_exp": (Qwen4ExpMTPModel, ModelArgs)}
