"""Reading a checkpoint folder's files: config.json, safetensors headers and
weight files, and the text config inside a config. Shared by the loader, the
draft folders and the converter; imports nothing of mlx_mtp, so each of them
can use it (docs/design.md, "Layout")."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, Optional

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or corrupt."""


def read_config_file(folder: Path) -> Dict[str, Any]:
    """A folder's config.json as a dict; one line naming the file otherwise."""
    cfg_file = Path(folder) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} is missing")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object, not {type(config).__name__}")
    return config


def text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The text model's config: `text_config` when the config nests one (as
    mlx_lm's qwen3_5 ModelArgs reads it), else the config itself."""
    return config.get("text_config", config)


def safetensors_header(file: Path) -> Dict[str, Any]:
    """Parse and sanity-check a safetensors header; raises naming file and tensor."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{file}: truncated safetensors file (header runs past the end)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{file}: corrupt safetensors header") from None
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            count = 1
            for d in info["shape"]:
                count *= d
            want = count * _DTYPE_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name}: corrupt header entry") from None
        if end > data:
            raise CheckpointError(
                f"{file}: tensor {name} is truncated (needs bytes up to {end}, file has {data})"
            )
        if info["dtype"] in _DTYPE_BYTES and end - start != want:
            raise CheckpointError(f"{file}: tensor {name}: size does not match its shape")
    return header


def safetensors_data_start(file: Path) -> int:
    """Where a safetensors file's data begins: its header's `data_offsets`
    count from here (8 bytes of header length, then the header). safetensors
    0.8's `safe_open` gives no offsets, so they are read from the header."""
    with open(file, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


WEIGHT_INDEX = "model.safetensors.index.json"


def read_weight_map(model_path: Path) -> Optional[Dict[str, str]]:
    """A checkpoint index's tensor name -> file map; None without an index."""
    index = model_path / WEIGHT_INDEX
    if not index.exists():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not all(isinstance(f, str) for f in weight_map.values()):
            raise TypeError
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index} is not valid JSON: {e}") from None
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index} has no weight_map object") from None
    return weight_map


def weight_files(model_path: Path, pattern: str = "model*.safetensors",
                 must_exist: bool = True) -> list:
    """The safetensors files of a checkpoint (its index's, else those matching
    `pattern`), all of them checked to exist (or those present, when not
    `must_exist`: a pipeline stage downloads only its own)."""
    weight_map = read_weight_map(model_path)
    if weight_map is not None:
        shards = sorted(set(weight_map.values()))
        if not must_exist:
            shards = [s for s in shards if (model_path / s).exists()]
        for s in shards:
            if not (model_path / s).exists():
                raise FileNotFoundError(f"{model_path / s} (listed in {WEIGHT_INDEX}) is missing")
        return [model_path / s for s in shards]
    files = sorted(model_path.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {pattern} files in {model_path}")
    return files
