"""What the families share: MoE expert tensors in mlx_lm's `switch_mlp`
layout, the head's tensors in MTPHead's, and the verify forward of a GDN
layer (docs/design.md, "Families")."""

from __future__ import annotations

import re

import mlx.core as mx

from .. import metal
from ..cache import CaptureCache
from ..head import HEAD_NORM_SUFFIXES
from ..model import MTPWeightError


class LanguageModelTrunk:
    """The trunk accessors of a family whose checkpoint nests the text model
    as `language_model` (Qwen3.5/3.6 and qwen4_exp, as mlx_lm loads them)."""

    @property
    def text_model(self):
        return self.language_model.model

    @property
    def text_args(self):
        return self.language_model.args

    @property
    def untied_lm_head(self):
        return self.language_model.lm_head

    @property
    def lm_head_group(self):
        """The group `shard()` split the lm_head over (by vocabulary), else None."""
        return getattr(self.language_model, "sharding_group", None)

_PER_EXPERT = re.compile(
    r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def stack_expert_tensors(weights: dict, prefix: str) -> dict:
    """One-tensor-per-expert MoE weights (`experts.{e}.gate_proj.weight`)
    stacked into mlx_lm's `switch_mlp.*` layout (only keys under `prefix`)."""
    groups: dict = {}
    for k in list(weights):
        m = _PER_EXPERT.match(k)
        if m and k.startswith(prefix):
            groups.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = weights.pop(k)
    for (mlp, proj, kind), per_expert in groups.items():
        n = max(per_expert) + 1
        missing = [e for e in range(n) if e not in per_expert]
        if missing:
            raise MTPWeightError(f"{mlp}.experts.{missing[0]}.{proj}.{kind} is missing")
        weights[f"{mlp}.switch_mlp.{proj}.{kind}"] = mx.stack([per_expert[e] for e in range(n)])
    return weights


def split_fused_experts(weights: dict, mlp: str) -> None:
    """`experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` -> switch_mlp.*."""
    gate_up = weights.pop(f"{mlp}.experts.gate_up_proj", None)
    if gate_up is not None:
        mid = gate_up.shape[-2] // 2
        weights[f"{mlp}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{mlp}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        down = weights.pop(f"{mlp}.experts.down_proj", None)
        if down is None:
            raise MTPWeightError(f"{mlp}.experts.down_proj is missing")
        weights[f"{mlp}.switch_mlp.down_proj.weight"] = down


def sanitize_head(weights: dict, num_layers: int, shift_norms: bool) -> dict:
    """The checkpoint's `mtp.*` tensors in MTPHead's layout: MoE experts
    stacked, zero-centred norms shifted (+1) when the source is unconverted.
    Shared by the loader and `mlx_mtp.convert --graft`."""
    weights = stack_expert_tensors(dict(weights), "mtp.")
    for i in range(num_layers):
        split_fused_experts(weights, f"mtp.layers.{i}.mlp")
    if shift_norms:
        for k, v in weights.items():
            if v.ndim == 1 and k.endswith(HEAD_NORM_SUFFIXES) and ".mlp." not in k:
                weights[k] = v + 1.0
    return weights


def verify_capturing(layer, cache: CaptureCache, inputs, qkv, z, b, a):
    """The verify forward of a GatedDeltaNet layer on `inputs` [B, S, H] after
    its input projections (qkv [B, S, conv_dim], before the conv): the conv and mlx_lm's single-token
    recurrence at every position, keeping every state and conv input in the
    cache for the commit. Shared by the families' verifying layers."""
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
    y, states = metal.gdn_verify(q, k, v, a, b, layer.A_log, layer.dt_bias, state)
    cache.captured_states = states
    cache.captured_conv_input = conv_input
    out = layer.out_proj(layer.norm(y, z).reshape(B, S, -1))
    group = getattr(layer, "sharding_group", None)
    if group is not None:  # tensor parallel: each rank holds some heads (as the parent)
        out = mx.distributed.all_sum(out, group=group)
    return out
