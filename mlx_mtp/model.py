"""The trunk (mlx_lm's own Qwen3.5 model classes) plus the MTP head.

`Model` subclasses mlx_lm's `qwen3_5.Model` / `qwen3_5_moe.Model`: the trunk's
modules, weights and `__call__` are mlx_lm's, so the object works unchanged
with `mlx_lm.generate`. Additions: `mtp` (the head, or None when the
checkpoint has none), GDN layers that can capture states during a verify, and
`trunk_hidden` / `logits_from_hidden` for the decode loop.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_5_moe

from .caches import VerifyingGatedDeltaNet, make_trunk_cache
from .head import HEAD_NORM_SUFFIXES, MTPHead

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


class MTPWeightError(ValueError):
    """Missing, partial or wrong-shaped MTP tensors."""


def mtp_num_layers(text_config: dict) -> int:
    return int(
        text_config.get("mtp_num_hidden_layers")
        or text_config.get("num_nextn_predict_layers")
        or 0
    )


def _split_expert_tensors(weights: dict, prefix: str, num_layers_hint=None) -> dict:
    """Accept one-tensor-per-expert MoE weights (`experts.{e}.gate_proj.weight`)
    by stacking them into mlx_lm's `switch_mlp.*` layout."""
    import re

    pat = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
    groups: dict = {}
    for k in list(weights):
        m = pat.match(k)
        if m and k.startswith(prefix):
            groups.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = weights.pop(k)
    for (mlp, proj, kind), per_expert in groups.items():
        n = max(per_expert) + 1
        missing = [e for e in range(n) if e not in per_expert]
        if missing:
            raise MTPWeightError(f"{mlp}.experts.{missing[0]}.{proj}.{kind} is missing")
        weights[f"{mlp}.switch_mlp.{proj}.{kind}"] = mx.stack([per_expert[e] for e in range(n)])
    return weights


def _split_fused_experts(weights: dict, mlp: str) -> None:
    gate_up = weights.pop(f"{mlp}.experts.gate_up_proj", None)
    if gate_up is not None:
        mid = gate_up.shape[-2] // 2
        weights[f"{mlp}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{mlp}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        down = weights.pop(f"{mlp}.experts.down_proj", None)
        if down is None:
            raise MTPWeightError(f"{mlp}.experts.down_proj is missing")
        weights[f"{mlp}.switch_mlp.down_proj.weight"] = down


class _MTPMixin:
    """Shared by the dense and MoE model classes."""

    def _init_mtp(self):
        text_args = self.language_model.args
        self.mtp_layers = mtp_num_layers(self.args.text_config)
        # Swap in GDN layers that can capture a verify (same parameters).
        for layer in self.language_model.model.layers:
            if layer.is_linear:
                layer.linear_attn = VerifyingGatedDeltaNet(text_args)
        self.mtp = MTPHead(text_args, self.mtp_layers) if self.mtp_layers > 0 else None

    @property
    def has_mtp(self) -> bool:
        return getattr(self, "mtp", None) is not None

    def drop_mtp(self):
        if "mtp" in self:
            del self["mtp"]
        self.mtp = None

    # -- forward pieces the decode loop needs ---------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.language_model.model.embed_tokens(tokens)

    def trunk_hidden(self, tokens: mx.array, cache) -> mx.array:
        """Post-final-norm trunk hidden states [B, T, H]."""
        return self.language_model.model(tokens, cache)

    def logits_from_hidden(self, hidden: mx.array) -> mx.array:
        lm = self.language_model
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(hidden)
        return lm.lm_head(hidden)

    def lm_head_weights(self) -> dict:
        """lm_head (or tied embedding) as draft_project arguments: weight and,
        when quantized, scales / biases / group_size / bits."""
        lm = self.language_model
        mod = lm.model.embed_tokens if lm.args.tie_word_embeddings else lm.lm_head
        out = {"weight": mod.weight}
        if hasattr(mod, "scales"):
            out.update(scales=mod.scales, biases=mod.get("biases"),
                       group_size=mod.group_size, bits=mod.bits)
        return out

    def draft_tokens_from_hidden(self, g: mx.array, vocab_ids: Optional[mx.array] = None) -> mx.array:
        """Greedy draft ids [N] from head hiddens [..., H]: the lm_head
        projection fused with arg-max, over `vocab_ids` rows only when given."""
        from . import metal as kernels

        h = g.reshape(-1, g.shape[-1])
        # On GPUs the fused kernel never materializes the full-vocabulary logits.
        _, ids = kernels.draft_project(h, vocab_ids=vocab_ids, **self.lm_head_weights())
        return ids[:, 0]

    def make_mtp_caches(self):
        return make_trunk_cache(self), self.mtp.make_cache()

    # -- weights ---------------------------------------------------------------
    def sanitize(self, weights):
        mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
        trunk = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        # mlx_lm shifts zero-centred norms iff it sees an unconverted checkpoint;
        # the head's norms follow the same rule so they are shifted exactly once.
        unconverted = any(
            "conv1d.weight" in k and v.shape[-1] != 1 for k, v in trunk.items()
        )
        trunk = _split_expert_tensors(trunk, "model.language_model.")
        trunk = super().sanitize(trunk)
        if not mtp:
            if self.has_mtp:
                self.drop_mtp()
                self.mtp_missing = True
            return trunk
        if not self.has_mtp:  # tensors present but config has no head: ignore them
            return trunk
        mtp = _split_expert_tensors(mtp, "mtp.")
        for i in range(self.mtp_layers):
            _split_fused_experts(mtp, f"mtp.layers.{i}.mlp")
        if unconverted:
            for k, v in mtp.items():
                if v.ndim == 1 and k.endswith(HEAD_NORM_SUFFIXES) and ".mlp." not in k:
                    mtp[k] = v + 1.0
        self._check_mtp(mtp)
        trunk.update(mtp)
        return trunk

    def _check_mtp(self, mtp: dict):
        from mlx.utils import tree_flatten

        expected = dict(tree_flatten(self.mtp.parameters()))
        expected = {f"mtp.{k}": v for k, v in expected.items()}
        quantized = any(k.endswith(".scales") for k in mtp)
        for name, param in expected.items():
            if name not in mtp:
                raise MTPWeightError(f"MTP tensor {name} is missing from the checkpoint")
            got = tuple(mtp[name].shape)
            if not quantized and got != tuple(param.shape):
                raise MTPWeightError(
                    f"MTP tensor {name} has shape {got}, expected {tuple(param.shape)}"
                )
        if not quantized:
            extra = sorted(set(mtp) - set(expected))
            if extra:
                raise MTPWeightError(f"unexpected MTP tensor {extra[0]}")


class Model(_MTPMixin, qwen3_5.Model):
    def __init__(self, args: qwen3_5.ModelArgs):
        super().__init__(args)
        self._init_mtp()


class MoeModel(_MTPMixin, qwen3_5_moe.Model):
    def __init__(self, args: qwen3_5_moe.ModelArgs):
        super().__init__(args)
        self._init_mtp()


MODEL_CLASSES = {
    "qwen3_5": (Model, qwen3_5.ModelArgs),
    "qwen3_5_moe": (MoeModel, qwen3_5_moe.ModelArgs),
}
