"""Qwen3-Next (`qwen3_next`): where this family keeps its parts, its verifying
GDN layer, and its checkpoints' head tensor names.

Layout: mlx_lm's `qwen3_next.Model`, flat: `model` (embed_tokens, layers,
norm) and `lm_head`. HF checkpoints use the same names (`model.*`,
`lm_head.weight`) plus `mtp.*`, and store one tensor per MoE expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`), in the head too. The GDN
layers fuse their input projections (`in_proj_qkvz`, `in_proj_ba`, grouped
per key head). The config names the head's layers `num_nextn_predict_layers`
when it names them at all (released configs do not: the tensors decide).

The head is vLLM's `Qwen3NextMultiTokenPredictor`: the same fc / norms as
Qwen3.5's, and layer i is a full-attention Qwen3-Next decoder layer whose
MLP follows the trunk's rule for layer index i (MoE unless i is in
`mlp_only_layers` or off `decoder_sparse_step`). See docs/design.md, "Families".
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import mlx.core as mx
from mlx_lm.models import qwen3_next

from ..cache import CaptureCache
from ..model import MTPModel
from .common import sanitize_head
from .qwen3_5 import verify_capturing


@dataclasses.dataclass
class ModelArgs(qwen3_next.ModelArgs):
    """mlx_lm's args plus the config itself, which the head needs
    (`num_nextn_predict_layers`, `mtp_use_dedicated_embeddings`) and mlx_lm's
    dataclass drops."""

    config: Optional[dict] = None

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        args = super().from_dict(params)
        args.config = dict(params)
        return args


def head_layer(args, index: int):
    """Head layer `index`: mlx_lm's Qwen3NextDecoderLayer as a full-attention
    layer (interval 1), so `index` picks its MLP exactly as vLLM's
    `mtp.layers.{index}` does."""
    return qwen3_next.Qwen3NextDecoderLayer(
        dataclasses.replace(args, full_attention_interval=1), index)


def is_unconverted(tensors: dict) -> bool:
    """mlx_lm's qwen3_next rule, from names alone: it shifts the norms (and
    re-lays conv1d) when the trunk stores one tensor per expert."""
    return any(k.startswith("model.layers.") and k.endswith(".mlp.experts.0.up_proj.weight")
               for k in tensors)


class VerifyingGatedDeltaNet(qwen3_next.Qwen3NextGatedDeltaNet):
    """mlx_lm's Qwen3NextGatedDeltaNet that, in a capturing cache, keeps what the
    commit needs to roll its state back (Qwen3.5's verify_capturing).

    Same parameters and arithmetic as the parent: its fused projections and
    `fix_query_key_value_ordering`, then mlx_lm's single-token recurrence (the
    kernels' reference), so an accepted position is bit-identical to plain
    decoding. Outside a verify it is the parent, unchanged.
    """

    def __call__(self, inputs, mask=None, cache=None):
        if not (isinstance(cache, CaptureCache) and cache.capturing):
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs))
        mixed_qkv = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return verify_capturing(self, cache, inputs, mixed_qkv, z, b, a)


class Model(MTPModel, qwen3_next.Model):
    verifying_gdn = VerifyingGatedDeltaNet
    mtp_layers_key = "num_nextn_predict_layers"
    float_dtype_tensor = "model.norm.weight"
    mlx_vlm_drafter = "qwen3_5_mtp"  # mlx-vlm splits Qwen3-Next's head into Qwen3.5's drafter

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self._init_mtp(args.config or {})

    @property
    def text_model(self):
        return self.model

    @property
    def text_args(self):
        return self.args

    @property
    def untied_lm_head(self):
        return self.lm_head

    @classmethod
    def args_from_config(cls, config: dict):
        return ModelArgs.from_dict(config)

    head_layer = staticmethod(head_layer)
    is_unconverted = staticmethod(is_unconverted)
    sanitize_head = staticmethod(sanitize_head)


MODEL_CLASSES = {
    "qwen3_next": (Model, ModelArgs),
}
