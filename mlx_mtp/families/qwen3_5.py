"""Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`): where this family keeps its
parts, its verifying GDN layer (whose verify forward Qwen3-Next and
qwen4_exp share: `verify_capturing`), and its checkpoints' head tensor names.

Layout: `language_model.model` (embed_tokens, layers, norm) and
`language_model.lm_head` (or the tied embedding); HF checkpoints name the
trunk `model.language_model.*` and the head `mtp.*`, MoE experts fused
(`experts.gate_up_proj`, `experts.down_proj`) or one tensor per expert
(also in the head of a fused trunk). The head layer is mlx_lm's Qwen3.5
DecoderLayer. See docs/design.md, "Families".
"""

from __future__ import annotations

from mlx_lm.models import qwen3_5, qwen3_5_moe

import mlx.core as mx

from .. import metal
from ..cache import CaptureCache, rollback_by_tape
from ..checkpoint import text_config
from ..model import LanguageModelTrunk, MTPModel
from . import mrope
from .common import sanitize_head, stack_expert_tensors

TRUNK_PREFIX = "model.language_model."


def head_layer(args, index: int):
    """Head layer `index`: mlx_lm's Qwen3.5 DecoderLayer, built as a
    full-attention layer (layer_idx = interval - 1), with the MoE MLP when
    the trunk is MoE, as in the released checkpoints; its rope M-RoPE as
    the trunk's."""
    layer = qwen3_5.DecoderLayer(args, args.full_attention_interval - 1)
    mrope.install([layer.self_attn], args.rope_parameters)
    return layer


def is_unconverted(tensors: dict) -> bool:
    """mlx_lm's qwen3_5 rule: an unconverted checkpoint has conv1d [C, 1, K]
    (mlx_lm stores it [C, K, 1]). From names alone: mlx_lm's conversions name
    every trunk tensor `language_model.*`, the HF release `model.language_model.*`."""
    if all(shape is None for shape in tensors.values()):
        return not any(k.startswith("language_model.") for k in tensors)
    return any("conv1d.weight" in k and shape[-1] != 1 for k, shape in tensors.items())


def verify_capturing(layer, cache: CaptureCache, inputs, qkv, z, b, a):
    """The verify forward of a GatedDeltaNet layer on `inputs` [B, S, H] after
    its input projections (qkv [B, S, conv_dim], before the conv): the conv and mlx_lm's single-token
    recurrence at every position, keeping in the cache what the commit needs:
    the conv input, and every state or a tape (`rollback_by_tape`). Shared by the families' verifying layers."""
    B, S, _ = inputs.shape
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), inputs.dtype)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), mx.float32)
    conv_out, conv_input = metal.conv_verify(conv_state, qkv, layer.conv1d.weight)
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    if rollback_by_tape(S):  # keep what the updates consume, replay at the commit
        y, cache.captured_tape = metal.gdn_verify_taped(q, k, v, a, b, layer.A_log,
                                                        layer.dt_bias, state)
    else:
        y, cache.captured_states = metal.gdn_verify(q, k, v, a, b, layer.A_log, layer.dt_bias,
                                                    state)
    cache.captured_conv_input = conv_input
    out = layer.out_proj(layer.norm(y, z).reshape(B, S, -1))
    group = getattr(layer, "sharding_group", None)
    if group is not None:  # tensor parallel: each rank holds some heads (as the parent)
        out = mx.distributed.all_sum(out, group=group)
    return out


class VerifyingGatedDeltaNet(qwen3_5.GatedDeltaNet):
    """mlx_lm's GatedDeltaNet that, in a capturing cache, keeps what the
    commit needs to roll its state back (a tape, or every state).

    Same parameters and same arithmetic as the parent: the projections are the
    parent's modules and the recurrence is mlx_lm's single-token update (via the
    kernels' reference), so an accepted position is bit-identical to plain
    decoding. Outside a verify it is the parent, unchanged.
    """

    def __call__(self, inputs, mask=None, cache=None):
        if not (isinstance(cache, CaptureCache) and cache.capturing):
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)
        return verify_capturing(self, cache, inputs, qkv, z, b, a)


class _Qwen35(LanguageModelTrunk, MTPModel):
    verifying_gdn = VerifyingGatedDeltaNet
    mtp_layers_key = "mtp_num_hidden_layers"
    float_dtype_tensor = "language_model.model.norm.weight"
    mlx_vlm_drafter = "qwen3_5_mtp"  # its splitter shifts the norms

    @classmethod
    def args_from_config(cls, config: dict):
        return qwen3_5.TextModelArgs.from_dict(text_config(config))

    @staticmethod
    def sanitize_trunk_experts(weights: dict) -> dict:
        return stack_expert_tensors(weights, TRUNK_PREFIX)

    head_layer = staticmethod(head_layer)
    is_unconverted = staticmethod(is_unconverted)
    sanitize_head = staticmethod(sanitize_head)

    def _init_mtp(self, text_config: dict):
        # (before the head is built: its layers install their own)
        self.takes_images = mrope.install([layer.self_attn for layer in self.text_model.layers
                                           if not layer.is_linear],
                                          self.text_args.rope_parameters)
        super()._init_mtp(text_config)


class Model(_Qwen35, qwen3_5.Model):
    def __init__(self, args: qwen3_5.ModelArgs):
        super().__init__(args)
        self._init_mtp(args.text_config)


class MoeModel(_Qwen35, qwen3_5_moe.Model):
    def __init__(self, args: qwen3_5_moe.ModelArgs):
        super().__init__(args)
        self._init_mtp(args.text_config)


MODEL_CLASSES = {
    "qwen3_5": (Model, qwen3_5.ModelArgs),
    "qwen3_5_moe": (MoeModel, qwen3_5_moe.ModelArgs),
}
