"""What the families' checkpoints share: MoE expert tensors in mlx_lm's
`switch_mlp` layout and the head's tensors in MTPHead's (docs/design.md,
"Families"). Load time only: nothing here runs in a decode cycle."""

from __future__ import annotations

import re

import mlx.core as mx

from ..model import HEAD_NORM_SUFFIXES, MTPWeightError


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
