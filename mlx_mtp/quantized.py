"""Quantized layers whose few-row products read each weight once.

A verify runs the trunk on k+1 tokens. MLX's quantized matmul computes 2..7
rows by running its one-row kernel once per row on CUDA and on M1/M2 Macs, so
each weight is read k+1 times; `metal.quantized_matmul` reads it once and
gives each row the bits of the decode step (docs/design.md, "Verify reads each
weight once"). These subclasses of mlx's layers route their products through
it and are otherwise the same layers: same parameters, same results, and
mlx_lm uses them unchanged.
"""

from __future__ import annotations


import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import metal
from .params import env_flag


def _shared_read(layer, x):
    return metal.quantized_matmul(x, layer["weight"], layer["scales"], layer.get("biases"),
                                  group_size=layer.group_size, bits=layer.bits, mode=layer.mode)


class SharedReadQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        y = _shared_read(self, x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class SharedReadQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x):
        return _shared_read(self, x)


_SUBCLASS = {nn.QuantizedLinear: SharedReadQuantizedLinear,
             nn.QuantizedEmbedding: SharedReadQuantizedEmbedding}


def share_weight_reads(model: nn.Module) -> int:
    """Make every quantized linear layer and embedding of `model` the shared
    read subclass, in place, keeping its arrays; returns how many."""
    swaps = []
    for path, layer in model.named_modules():
        cls = _SUBCLASS.get(type(layer))
        if cls is not None:
            new = cls.__new__(cls)
            dict.update(new, layer)
            new.__dict__.update(layer.__dict__)
            swaps.append((path, new))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def use_shared_reads(model: nn.Module) -> int:
    """share_weight_reads on a GPU kernel backend, unless MLX_MTP_QMV_ROWS=0
    (MLX's own op for every product: the comparison the benches make)."""
    if metal.backend() == "ref" or not env_flag("MLX_MTP_QMV_ROWS"):
        return 0
    return share_weight_reads(model)
