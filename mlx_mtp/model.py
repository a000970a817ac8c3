"""The model the decoder sees: mlx_lm's trunk with the MTP head attached.

A family file (`families/*.py`) subclasses mlx_lm's own model classes with
`MTPModel` and says where that family keeps its parts (`text_model`,
`text_args`), which GDN layer class captures a verify, and how its
checkpoints name the head's tensors (`sanitize_head`, which the converter
uses too). Everything else — the forward pieces the decode cycle calls, the
prompt cache layout, weight checks — is written once here, so a new family
is one new file (docs/design.md, "Model adapter").

The trunk's modules, weights and `__call__` stay mlx_lm's, so the object
also works unchanged with `mlx_lm.generate`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .head import MTPHead


class MTPWeightError(ValueError):
    """Missing, partial or wrong-shaped MTP tensors."""


def mtp_num_layers(text_config: dict) -> int:
    return int(
        text_config.get("mtp_num_hidden_layers")
        or text_config.get("num_nextn_predict_layers")
        or 0
    )


class Runtime:
    """What a model keeps across generations: compiled decode graphs (cycle.py:
    per step, depth and mode, the least recently used dropped past
    `max_graphs`; MLX keeps one trace per input shape) and the adaptive depth
    controllers' measurements (loop.py), so a later request neither retraces
    nor learns its depth again."""

    max_graphs = 64

    def __init__(self):
        self.graphs: "OrderedDict[tuple, object]" = OrderedDict()
        self.traces: Dict[tuple, int] = {}
        self.controllers: Dict[tuple, object] = {}

    def graph(self, key: tuple, make):
        fn = self.graphs.get(key)
        if fn is None:
            fn = self.graphs[key] = make()
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        return fn

    def clear(self):
        """Forget the graphs and the measurements."""
        self.graphs.clear()
        self.traces.clear()
        self.controllers.clear()


class MTPModel:
    """Mixin for a family's model classes (first base, before mlx_lm's class)."""

    # -- family hooks -------------------------------------------------------------
    verifying_gdn = None  # the family's GDN subclass that captures a verify

    @property
    def text_model(self) -> nn.Module:
        """The trunk's inner model: embed_tokens, layers, norm."""
        raise NotImplementedError

    @property
    def text_args(self):
        raise NotImplementedError

    @staticmethod
    def sanitize_trunk_experts(weights: dict) -> dict:
        return weights

    @staticmethod
    def sanitize_head(weights: dict, num_layers: int, shift_norms: bool) -> dict:
        """The checkpoint's `mtp.*` tensors in the head's module layout."""
        raise NotImplementedError

    # -- setup --------------------------------------------------------------------
    def _init_mtp(self, text_config: dict):
        self.mtp_layers = mtp_num_layers(text_config)
        for layer in self.text_model.layers:
            if layer.is_linear:  # same parameters, can capture a verify
                layer.linear_attn = self.verifying_gdn(self.text_args)
        self.mtp = MTPHead(self.text_args, self.mtp_layers) if self.mtp_layers > 0 else None
        self.runtime = Runtime()

    @property
    def has_mtp(self) -> bool:
        return getattr(self, "mtp", None) is not None

    def drop_mtp(self):
        if "mtp" in self:
            del self["mtp"]
        self.mtp = None

    @property
    def is_linear(self) -> list:
        """Per trunk layer: True for a GDN layer, False for attention."""
        return [layer.is_linear for layer in self.text_model.layers]

    @property
    def vocab_size(self) -> int:
        return self.text_args.vocab_size

    def make_cache(self) -> list:
        """mlx_lm's own prompt cache for the trunk: mlx_lm's generation and
        batching use it unchanged; mlx_mtp's first call appends the head's
        entries to it (cache.py)."""
        return self.language_model.make_cache()

    # -- forward pieces the decode cycle calls ------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.text_model.embed_tokens(tokens)

    def trunk_hidden(self, tokens: mx.array, cache) -> mx.array:
        """Post-final-norm trunk hidden states [B, T, H] (cache: trunk layers)."""
        return self.text_model(tokens, cache)

    def _lm_head_module(self):
        if self.text_args.tie_word_embeddings:
            return self.text_model.embed_tokens
        return self.language_model.lm_head

    def logits_from_hidden(self, hidden: mx.array) -> mx.array:
        if self.text_args.tie_word_embeddings:
            return self.text_model.embed_tokens.as_linear(hidden)
        return self.language_model.lm_head(hidden)

    def lm_head_weights(self) -> dict:
        """lm_head (or tied embedding) as draft_project arguments: weight and,
        when quantized, scales / biases / group_size / bits."""
        mod = self._lm_head_module()
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

    # -- weights ------------------------------------------------------------------
    def sanitize(self, weights):
        mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
        trunk = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        # mlx_lm shifts zero-centred norms iff it sees an unconverted checkpoint;
        # the head's norms follow the same rule so they are shifted exactly once.
        unconverted = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in trunk.items())
        trunk = super().sanitize(self.sanitize_trunk_experts(trunk))
        if not mtp:
            if self.has_mtp:
                self.drop_mtp()
                self.mtp_missing = True
            return trunk
        if not self.has_mtp:  # tensors present but config has no head: ignore them
            return trunk
        mtp = self.sanitize_head(mtp, self.mtp_layers, unconverted)
        self._check_mtp(mtp)
        trunk.update(mtp)
        return trunk

    def _check_mtp(self, mtp: dict):
        expected = {f"mtp.{k}": v for k, v in tree_flatten(self.mtp.parameters())}
        quantized = any(k.endswith(".scales") for k in mtp)
        for name, param in expected.items():
            if name not in mtp:
                raise MTPWeightError(f"MTP tensor {name} is missing from the checkpoint")
            got = tuple(mtp[name].shape)
            if not quantized and got != tuple(param.shape):
                raise MTPWeightError(
                    f"MTP tensor {name} has shape {got}, expected {tuple(param.shape)}")
        if not quantized:
            extra = sorted(set(mtp) - set(expected))
            if extra:
                raise MTPWeightError(f"unexpected MTP tensor {extra[0]}")
