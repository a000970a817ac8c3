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

The MTP head (`MTPHead`): one extra full-attention decoder layer that drafts
token t+2. Forward (docs/design.md, "Models"), at position t:
    x = fc(concat[pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])
    x = decoder_layer(x)                   # the family's mlx_lm layer, own KV cache
    g = norm(x)                            # fed back as h for the next draft step
    logits = lm_head(g)                    # shared with the trunk
h_t is the trunk's final hidden after its final norm. Embedding and lm_head are
the trunk's; the head owns none. The decoder layer is built by the family
(`head_layer`, docs/design.md "Families").
"""

from __future__ import annotations

import re
from collections import OrderedDict
from types import MappingProxyType
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from . import metal
from . import params
from .mlx_lm_compat import create_attention_mask


# Zero-centred RMSNorm weights of the head (stored as w, applied as 1+w in HF).
HEAD_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


class MTPHead(nn.Module):
    def __init__(self, args, num_layers: int,
                 make_layer: Callable[[object, int], nn.Module]):
        """args: the trunk's text args; make_layer(args, i): head layer i, a
        full-attention decoder layer of the family (its `head_layer`)."""
        super().__init__()
        H = args.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [make_layer(args, i) for i in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def make_cache(self):
        return [KVCache() for _ in self.layers]

    def __call__(
        self,
        hidden: mx.array,
        token_embeddings: mx.array,
        cache: Optional[list] = None,
    ) -> mx.array:
        """hidden: [B, T, H] post-norm trunk (or head) hiddens at positions p;
        token_embeddings: [B, T, H] embeddings of the tokens at p+1.
        Returns the head's post-norm hidden [B, T, H]."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(token_embeddings), self.pre_fc_norm_hidden(hidden)],
            axis=-1,
        )
        x = self.fc(x)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)


class MTPWeightError(ValueError):
    """Missing, partial, unknown or wrong-shaped MTP tensors, or a head
    configuration mlx_mtp cannot run."""


# Config keys that give the head's layer count: Qwen3.5/3.6 name it
# mtp_num_hidden_layers, Qwen3-Next (and DeepSeek-style configs)
# num_nextn_predict_layers.
MTP_LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")

_HEAD_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def declared_mtp_layers(text_config: dict) -> Optional[int]:
    """The head's layer count the config declares; None when it names none
    (then the `mtp.*` tensors decide: `head_layers_in`)."""
    for key in MTP_LAYER_KEYS:
        if text_config.get(key) is not None:
            return int(text_config[key])
    return None


def head_layers_in(names) -> int:
    """How many head decoder layers the tensor names hold (`mtp.layers.{i}.*`)."""
    found = [int(m.group(1)) for m in map(_HEAD_LAYER.match, names) if m]
    return max(found) + 1 if found else 0


def check_head_config(text_config: dict) -> None:
    """Refuse head variants mlx_mtp cannot run, naming the config key.

    `mtp_use_dedicated_embeddings: true` would give the head an embedding and
    lm_head of its own; every released Qwen3.5/3.6/3.8 config sets it false
    (the head shares the trunk's), which is the only layout supported
    (docs/design.md, "Families")."""
    if text_config.get("mtp_use_dedicated_embeddings"):
        raise MTPWeightError(
            "mtp_use_dedicated_embeddings=true (an MTP head with its own embedding and "
            "lm_head) is not supported by mlx_mtp; the released checkpoints set it false")


class Runtime:
    """What a model keeps across generations: compiled decode graphs (cycle.py:
    per step, depth and mode, the least recently used dropped past
    `max_graphs`; MLX keeps one trace per input shape) and the adaptive depth
    controllers' measurements (schedule.controller_for), so a later request neither retraces
    nor learns its depth again."""

    max_graphs = 128  # (context runs' widths add graphs: schedule.CONTEXT_WIDTHS)

    def __init__(self):
        self.graphs: "OrderedDict[tuple, object]" = OrderedDict()
        self.traces: Dict[tuple, int] = {}
        self.controllers: Dict[tuple, object] = {}
        # seconds of a cycle wider than the head's chain, and their counts, by
        # (width, head's chain, batch-size bucket) (schedule.ContextPolicy)
        self.width_costs: Dict[tuple, list] = {}
        # the process's first graph runs, eager (params.CPU_EAGER_RUNS); they
        # are not cost samples (cycle.Graphs.traces)
        self.eager_limit = params.CPU_EAGER_RUNS if mx.default_device() == mx.cpu else 0
        self.eager_runs = 0
        self.vision = None  # the folder's vision tower, loaded at the first image (vision.py)

    def runs_eagerly(self) -> bool:
        """Whether the next run of a graph not compiled yet is eager (counted)."""
        if self.eager_runs >= self.eager_limit:
            return False
        self.eager_runs += 1
        return True

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
        self.width_costs.clear()


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


class MTPModel:
    """Mixin for a family's model classes (first base, before mlx_lm's class).

    A family says where it keeps its parts and how its checkpoints name the
    head (docs/design.md, "Families"); everything else is here."""

    # -- family hooks -------------------------------------------------------------
    verifying_gdn = None  # the family's GDN subclass that captures a verify
    mtp_layers_key = "mtp_num_hidden_layers"  # the config key the family's configs use
    # a trunk tensor (MLX name) never quantized: its dtype is a conversion's
    # floating-point dtype (what convert reports, what graft casts a head to)
    float_dtype_tensor: str = None
    # draft folders (draft.py): the model_type of mlx-vlm's split drafter for this
    # family's head (None: none known), whether its splitter stores the head's norms
    # shifted (+1) or zero-centred as released, and the trunk config keys a head must
    # share with the trunk it drafts for (a difference is refused naming the key)
    mlx_vlm_drafter: Optional[str] = None
    mlx_vlm_drafter_norms_shifted = True
    # the context the head was trained on (config `mlx_mtp.head_context`): the
    # head follows only a prompt's last this many tokens (None: all of them)
    head_context: Optional[int] = None
    head_match_keys = ("hidden_size", "vocab_size", "num_hidden_layers", "num_experts")
    # whether the trunk and head rotate by M-RoPE positions (images; set at init)
    takes_images = False
    # the tokens a prompt needs after its last image (where each token is at its
    # index + the row's delta: what decoding knows of positions)
    text_after_images = 1
    # a lookup reads the host (n-gram tables on disk, mlx_mtp/ngram_tables.py):
    # the decode graphs run uncompiled
    host_lookups = False

    @property
    def text_model(self) -> nn.Module:
        """The trunk's inner model: embed_tokens, layers, norm."""
        raise NotImplementedError

    @property
    def text_args(self):
        raise NotImplementedError

    @property
    def untied_lm_head(self) -> nn.Module:
        """The trunk's lm_head module (used when embeddings are not tied)."""
        raise NotImplementedError

    @classmethod
    def args_from_config(cls, config: dict):
        """The trunk's text args from a config.json dict, without building a
        model (the converter's graft and draft folders build a head alone)."""
        raise NotImplementedError

    @staticmethod
    def head_layer(args, index: int) -> nn.Module:
        """Head decoder layer `index`: the family's full-attention layer."""
        raise NotImplementedError

    @staticmethod
    def sanitize_trunk_experts(weights: dict) -> dict:
        return weights

    @staticmethod
    def is_unconverted(tensors: dict) -> bool:
        """Whether a checkpoint is an unconverted HF release, whose zero-centred
        norms mlx_lm shifts (+1) at load: mlx_lm's own rule for the family, which
        the head's norms follow so both are shifted exactly once. `tensors` maps
        the checkpoint's tensor names to their shapes, or every name to None
        where only the names are at hand (an index, part of a checkpoint)."""
        raise NotImplementedError

    @staticmethod
    def sanitize_head(weights: dict, num_layers: int, shift_norms: bool) -> dict:
        """The checkpoint's `mtp.*` tensors in the head's module layout."""
        raise NotImplementedError

    # -- setup --------------------------------------------------------------------
    def _init_mtp(self, text_config: dict):
        check_head_config(text_config)
        self.mtp_layers_declared = declared_mtp_layers(text_config)
        for layer in self.text_model.layers:
            if layer.is_linear:  # same parameters, can capture a verify
                layer.linear_attn = self.verifying_gdn(self.text_args)
        self.mtp = None
        self.set_head(self.mtp_layers_declared or 0)
        self.runtime = Runtime()

    @classmethod
    def make_head(cls, args, num_layers: int) -> "MTPHead":
        return MTPHead(args, num_layers, cls.head_layer)

    def set_head(self, num_layers: int):
        """A fresh head of `num_layers` layers (none for 0), replacing any."""
        self.drop_mtp()
        self.mtp_layers = num_layers
        if num_layers > 0:
            self.mtp = self.make_head(self.text_args, num_layers)
        if hasattr(self, "runtime"):
            self.runtime.clear()

    @property
    def has_mtp(self) -> bool:
        return getattr(self, "mtp", None) is not None

    def drop_mtp(self):
        if "mtp" in self:
            del self["mtp"]
        self.mtp = None

    @property
    def is_linear(self) -> list:
        """Per trunk layer this rank runs (a pipeline stage: its own layers):
        True for a GDN layer, False for attention."""
        tm = self.text_model
        return [layer.is_linear for layer in getattr(tm, "pipeline_layers", tm.layers)]

    # set by distributed.sharded_load: the ranks that decode this model in lockstep
    distributed_group = None
    # set by distributed.sharded_load when a pipeline stage holds no attention
    # layer: the stages that agree on the trunk's length (distributed.trunk_length)
    length_group = None

    @property
    def lm_head_group(self):
        """The group an lm_head sharded over the vocabulary (tensor parallel,
        untied) is gathered across, else None."""
        return None

    @property
    def vocab_size(self) -> int:
        return self.text_args.vocab_size

    # -- forward pieces the decode cycle calls ------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.text_model.embed_tokens(tokens)

    def trunk_hidden(self, tokens: mx.array, cache, embeddings: Optional[mx.array] = None
                     ) -> mx.array:
        """Post-final-norm trunk hidden states [B, T, H] (cache: trunk layers;
        `embeddings` [B, T, H]: the input in place of the tokens' own, an
        image's features merged in)."""
        if embeddings is None:
            return self.text_model(tokens, cache)
        return self.text_model(tokens, cache, input_embeddings=embeddings)

    @property
    def hidden_width(self) -> int:
        """Features of a `trunk_hidden` / head hidden (wider than hidden_size
        where a family carries more than lm_head reads: docs/qwen4_exp.md)."""
        return self.text_args.hidden_size

    def lm_input(self, hidden: mx.array) -> mx.array:
        """What lm_head reads of a trunk or head hidden (all of it here)."""
        return hidden

    def empty_entry(self, shape, dtype) -> mx.array:
        """An ArraysCache entry before any token (cache.fill_empty): zeros,
        as mlx_lm's GDN layers start from."""
        return mx.zeros(shape, dtype)

    def _lm_head_module(self):
        if self.text_args.tie_word_embeddings:
            return self.text_model.embed_tokens
        return self.untied_lm_head

    def logits_from_hidden(self, hidden: mx.array) -> mx.array:
        hidden = self.lm_input(hidden)
        if self.text_args.tie_word_embeddings:
            return self.text_model.embed_tokens.as_linear(hidden)
        logits = self.untied_lm_head(hidden)
        if self.lm_head_group is not None:  # each rank holds a slice of the vocabulary
            from .mlx_lm_compat import gather_last_axis

            logits = gather_last_axis(logits, self.lm_head_group)
        return logits

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
        g = self.lm_input(g)
        h = g.reshape(-1, g.shape[-1])
        if self.lm_head_group is not None:  # a vocabulary slice per rank: gathered logits
            logits = self.logits_from_hidden(h)
            if vocab_ids is None:
                return mx.argmax(logits, axis=-1)
            return vocab_ids[mx.argmax(logits[:, vocab_ids], axis=-1)]
        # On GPUs the fused kernel never materializes the full-vocabulary logits.
        _, ids = metal.draft_project(h, vocab_ids=vocab_ids, **self.lm_head_weights())
        return ids[:, 0]

    # -- weights ------------------------------------------------------------------
    # after a lenient load (strict=False: a sharded one), each parameter it left
    # unset, with why (see load_weights); None after a strict one
    unset_weights = None

    def load_weights(self, file_or_weights, strict: bool = True):
        """nn.Module's, remembering what a lenient load left unset: mlx_lm's
        load_model calls it with the sanitized (and, quantized, packed)
        weights, and without `strict` nn.Module keeps a missing or
        wrong-shaped parameter's random init silently. sharded_load checks the
        parameters its rank keeps against this (distributed.check_loaded)."""
        if not strict and not isinstance(file_or_weights, str):
            file_or_weights = list(file_or_weights)
            given = {k: tuple(v.shape) for k, v in file_or_weights}
            unset = {}
            for name, param in tree_flatten(self.parameters()):
                if name not in given:
                    unset[name] = "is missing from the checkpoint"
                elif given[name] != tuple(param.shape):
                    unset[name] = f"has shape {given[name]}, expected {tuple(param.shape)}"
            # (read-only, and not a dict: an nn.Module keeps dict attributes as children)
            self.unset_weights = MappingProxyType(unset)
        return super().load_weights(file_or_weights, strict=strict)

    def sanitize(self, weights):
        mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
        trunk = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        # mlx_lm shifts zero-centred norms iff it sees an unconverted checkpoint;
        # the head's norms follow the same rule so they are shifted exactly once.
        unconverted = self.is_unconverted({k: v.shape for k, v in trunk.items()})
        trunk = super().sanitize(self.sanitize_trunk_experts(trunk))
        if not mtp:
            self.drop_mtp()
            self.mtp_missing = self.mtp_layers_declared != 0
            return trunk
        if self.mtp_layers_declared is None:  # the config names no count: the tensors say
            self.set_head(head_layers_in(mtp))
        if not self.has_mtp:  # tensors present but the config declares 0 layers: ignore them
            return trunk
        mtp = self.sanitize_head(mtp, self.mtp_layers, unconverted)
        self._check_mtp(mtp)
        trunk.update(mtp)
        return trunk

    def _check_mtp(self, mtp: dict):
        check_head_weights(self.mtp, mtp)


def check_head_weights(head: nn.Module, mtp: dict) -> None:
    """Every tensor the head needs is there with its shape (quantized tensors:
    by name), and no tensor is unknown; errors name the tensor."""
    expected = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    quantized = any(k.endswith(".scales") for k in mtp)
    for name, param in expected.items():
        if name not in mtp:
            raise MTPWeightError(f"MTP tensor {name} is missing from the checkpoint")
        got = tuple(mtp[name].shape)
        if not quantized and got != tuple(param.shape):
            raise MTPWeightError(
                f"MTP tensor {name} has shape {got}, expected {tuple(param.shape)}")

    def known(name):
        if name in expected:
            return True
        base, _, kind = name.rpartition(".")
        return quantized and kind in ("scales", "biases") and f"{base}.weight" in expected

    extra = sorted(k for k in mtp if not known(k))
    if extra:
        raise MTPWeightError(f"unexpected MTP tensor {extra[0]} (a head layout mlx_mtp does not know)")
