"""`qwen4_exp`'s n-gram tables read from disk (docs/qwen4_exp.md, "N-gram
tables on disk").

Each PLE layer's table is most of the checkpoint (tens of billions of
parameters at the config's defaults) while a token reads
`(ngram_size - 1) * heads_per_ngram` of its rows. With `ngram_tables="disk"`
the tables stay in their safetensors files, memory-mapped; a lookup reads
the ids it is given (one evaluation of the ids: the host needs their
values), copies just those rows out of the files, and makes an array of
them: a float table's rows as stored, a quantized table's packed rows,
scales and biases dequantized as `nn.QuantizedEmbedding` does, so the
result is the in-memory lookup's, bit for bit. The host read cannot run
inside a compiled graph, so a model with tables on disk decodes with its
graphs uncompiled (`MTPModel.host_lookups`).
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .checkpoint import CheckpointError, safetensors_data_start, safetensors_header, weight_files
from .models.qwen4_exp import table_tensor

MODES = ("auto", "disk", "memory")
# auto: the tables stay in memory while the whole checkpoint takes at most this
# share of the machine's memory (the rest: caches, activations, the system)
MEMORY_SHARE = 0.6

# the stored dtype -> how numpy holds it (bfloat16: its raw bits, viewed in MLX)
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32}


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _tensors(model_path: Path, strict: bool = True):
    """(file, header) of each weight file."""
    return [(f, safetensors_header(f)) for f in weight_files(model_path, must_exist=strict)]


def weight_bytes(headers) -> Tuple[int, int]:
    """(bytes of the n-gram tables, bytes of all weights) from the files' headers."""
    tables = total = 0
    for _, header in headers:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            size = info["data_offsets"][1] - info["data_offsets"][0]
            total += size
            if table_tensor(name) is not None:
                tables += size
    return tables, total


def choose(mode: str, total: int, memory: Optional[int] = None) -> str:
    """'disk' or 'memory' for `mode` ('auto': memory while the checkpoint
    takes at most MEMORY_SHARE of the machine's memory)."""
    if mode not in MODES:
        raise ValueError(f"ngram_tables must be one of {', '.join(MODES)}, not {mode!r}")
    if mode != "auto":
        return mode
    memory = machine_memory() if memory is None else memory
    return "memory" if total <= MEMORY_SHARE * memory else "disk"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _map(file: Path) -> np.ndarray:
    """A file's bytes, memory-mapped read-only. Lookups read scattered rows:
    no readahead (MADV_RANDOM), so the pages touched are about the rows read."""
    with open(file, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        m.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(m, dtype=np.uint8)


class _Store:
    """The memory-mapped parts of one table (a plain object: nothing of it is
    a module parameter). Part i holds rows [starts[i], starts[i] + rows[i]);
    `leaves[i]` maps 'weight' (and 'scales', 'biases') to its rows."""

    def __init__(self, parts: List[Tuple[int, Dict[str, np.ndarray]]]):
        parts = sorted(parts, key=lambda p: p[0])
        self.starts = np.array([s for s, _ in parts], dtype=np.int64)
        self.rows = np.array([next(iter(l.values())).shape[0] for _, l in parts], dtype=np.int64)
        self.leaves = [l for _, l in parts]


class DiskRows(nn.Module):
    """An n-gram table's rows in its safetensors files (memory-mapped), in
    place of `RowShardedEmbedding`: the same lookup, the same `total_rows`
    and `keep_rows` (tensor parallel: rows it does not keep read as zeros)."""

    def __init__(self, total_rows: int, store: _Store, dtypes: Dict[str, str],
                 quantization: Optional[dict] = None):
        super().__init__()
        self.total_rows = total_rows
        self._store, self._dtypes, self._quantization = store, dtypes, quantization
        self._held = (0, total_rows)

    def keep_rows(self, lo: int, hi: int):
        self._held = (lo, hi)

    def _gather(self, flat: np.ndarray) -> Dict[str, np.ndarray]:
        """Each leaf's rows of ids `flat` (zeros where a row is not held)."""
        st = self._store
        out = {leaf: np.zeros((flat.size,) + arr.shape[1:], arr.dtype)
               for leaf, arr in st.leaves[0].items()}
        lo, hi = self._held
        part = np.searchsorted(st.starts, flat, side="right") - 1
        part[(flat < lo) | (flat >= hi)] = -1
        for i in np.unique(part):
            if i < 0:
                continue
            at = np.nonzero(part == i)[0]
            local = flat[at] - st.starts[i]
            inside = local < st.rows[i]  # (a row past the checkpoint's: zeros)
            at, local = at[inside], local[inside]
            for leaf, arr in st.leaves[i].items():
                out[leaf][at] = arr[local]
        return out

    def _array(self, leaf: str, rows: np.ndarray) -> mx.array:
        a = mx.array(rows)
        return a.view(mx.bfloat16) if self._dtypes[leaf] == "BF16" else a

    def __call__(self, ids: mx.array) -> mx.array:
        # the host reads the ids' values: they are evaluated here (not in a
        # compiled graph: MTPModel.host_lookups)
        flat = np.asarray(ids).astype(np.int64).reshape(-1)
        rows = {leaf: self._array(leaf, r) for leaf, r in self._gather(flat).items()}
        if self._quantization is None:
            e = rows["weight"]
        else:  # as nn.QuantizedEmbedding: the gathered rows dequantized
            e = mx.dequantize(rows["weight"], scales=rows["scales"], biases=rows.get("biases"),
                              **self._quantization)
        return e.reshape(*ids.shape, -1)


def open_tables(model, model_path: Path, headers=None, strict: bool = True) -> int:
    """Replace every PLE layer's table (`RowShardedEmbedding`, not evaluated:
    a lazy load) by its rows in the files, memory-mapped. Returns the bytes
    mapped. The quantization (group size, bits, mode) is the loaded module's."""
    headers = _tensors(model_path, strict) if headers is None else headers
    found: Dict[int, List[tuple]] = {}
    mapped = 0
    for f, header in headers:
        base, mm = None, None
        for name, info in header.items():
            t = None if name == "__metadata__" else table_tensor(name)
            if t is None:
                continue
            if info["dtype"] not in _NUMPY:
                raise CheckpointError(f"{f}: tensor {name}: n-gram tables on disk read "
                                      f"{', '.join(_NUMPY)}, not {info['dtype']}")
            if mm is None:
                base, mm = safetensors_data_start(f), _map(f)
            a, b = info["data_offsets"]
            arr = mm[base + a: base + b].view(_NUMPY[info["dtype"]]).reshape(info["shape"])
            found.setdefault(t[0], []).append((t[1], t[2], arr, info["dtype"], f, name))
            mapped += b - a
    for l, layer in enumerate(model.language_model.model.layers):
        if not layer.has_ple:
            continue
        ngram = layer.ple.ple_embedding
        table = ngram.ngram_embedding
        if isinstance(table, DiskRows):
            continue
        first = table[table.pieces()[0][0]]
        quantization = (dict(group_size=first.group_size, bits=first.bits, mode=first.mode)
                        if isinstance(first, nn.QuantizedEmbedding) else None)
        parts: Dict[int, Dict[str, np.ndarray]] = {}
        dtypes = {}
        for piece, leaf, arr, dtype, f, name in found.get(l, []):
            lo, hi = (0, table.total_rows) if piece is None else table.rows_of(piece)
            if arr.shape[0] != hi - lo:
                raise CheckpointError(f"{f}: tensor {name}: {arr.shape[0]} rows, the config's "
                                      f"split_ngram_parts gives {hi - lo}")
            parts.setdefault(lo, {})[leaf] = arr
            dtypes[leaf] = dtype
        leaves = {"weight"} | ({"scales", "biases"} if quantization else set())
        covered = sum(next(iter(p.values())).shape[0] for p in parts.values())
        if strict and (covered != table.total_rows or any(set(p) != leaves for p in parts.values())):
            raise CheckpointError(f"{model_path}: layer {l}'s n-gram table is incomplete in the "
                                  f"checkpoint ({covered} of {table.total_rows} rows)")
        if not parts:
            continue
        ngram.ngram_embedding = DiskRows(table.total_rows, _Store(list(parts.items())), dtypes,
                                         quantization)
    return mapped


def place_tables(model, model_path: Path, mode: str, headers, strict: bool, quiet: bool) -> str:
    """Where `mlx_mtp.load` keeps a `qwen4_exp` model's n-gram tables
    ('auto' decided from the checkpoint's size and this machine's memory),
    said in one line; on disk, the tables are mapped in place of the loaded
    (unevaluated) ones. Returns the mode chosen ('' for a model without tables)."""
    tables, total = weight_bytes(headers)
    if not tables:
        return ""
    chosen = choose(mode, total)
    if chosen == "disk":
        open_tables(model, model_path, headers, strict)
        model.host_lookups = True
    if not quiet:
        why = f"--ngram-tables {mode}" if mode != "auto" else (
            f"auto: {_gb(total)} of weights, {_gb(machine_memory())} of memory")
        where = "read from disk" if chosen == "disk" else "in memory"
        print(f"[mlx_mtp] n-gram tables ({_gb(tables)}): {where} ({why})", file=sys.stderr)
    return chosen
