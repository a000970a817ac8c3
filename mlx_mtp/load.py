"""Load a Qwen3.5/3.6 or Qwen3-Next checkpoint (HF or MLX layout) with its MTP head."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

from .families import MODEL_CLASSES, family_of

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .model import MTPModel

DEMO_MODEL_DIR = Path(__file__).parent / "demo"

DOWNLOAD_PATTERNS = [
    "*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken",
]

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or corrupt."""


def demo_model_path() -> Optional[Path]:
    return DEMO_MODEL_DIR if (DEMO_MODEL_DIR / "config.json").exists() else None


def resolve_model_path(path_or_hf_repo: Optional[Union[str, Path]], revision=None) -> Path:
    if path_or_hf_repo is None:
        demo = demo_model_path()
        if demo is None:
            raise FileNotFoundError("no model given and the embedded demo model is not installed")
        return demo
    path = Path(path_or_hf_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a model folder")
        return path
    if str(path_or_hf_repo).startswith((".", "/", "~")) or str(path_or_hf_repo).count("/") != 1:
        raise FileNotFoundError(f"model folder {path_or_hf_repo} does not exist")
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(str(path_or_hf_repo), revision=revision, allow_patterns=DOWNLOAD_PATTERNS)
    )


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


def read_config(model_path: Path) -> Dict[str, Any]:
    """A model folder's config; its model_type must be a supported family."""
    config = read_config_file(model_path)
    family_of(config.get("model_type"))  # one line naming the supported types
    return config


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
        index = model_path / WEIGHT_INDEX
        shards = sorted(set(weight_map.values()))
        if not must_exist:
            shards = [s for s in shards if (model_path / s).exists()]
        for s in shards:
            if not (model_path / s).exists():
                raise FileNotFoundError(f"{model_path / s} (listed in {index.name}) is missing")
        return [model_path / s for s in shards]
    files = sorted(model_path.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {pattern} files in {model_path}")
    return files


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def check_tokenizer_files(model_path: Path):
    if not any((model_path / f).exists() for f in TOKENIZER_FILES) and not any(
            model_path.glob("*.tiktoken")):
        raise FileNotFoundError(f"{model_path} has no tokenizer files (one of "
                                f"{', '.join(TOKENIZER_FILES)})")


def load(
    path_or_hf_repo: Optional[Union[str, Path]] = None,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: Optional[str] = None,
    quiet: bool = False,
    draft: Optional[Union[str, Path]] = None,
    strict: bool = True,
) -> Union[Tuple["MTPModel", "TokenizerWrapper"],
           Tuple["MTPModel", "TokenizerWrapper", Dict[str, Any]]]:
    """Load model (trunk + MTP head) and tokenizer (and the config with
    return_config=True). Without a path, the demo model.

    The model is mlx_lm's own class for the trunk, so it also works unchanged
    with mlx_lm.generate. A checkpoint without `mtp.*` loads for plain decoding
    (one notice on stderr). `draft`: a folder holding an MTP head for this
    trunk (mlx-vlm's split drafter, or `mtp.*` safetensors with their
    config; see mlx_mtp/draft.py), drafted with instead of the checkpoint's own.
    """
    from .mlx_lm_compat import load_model, load_tokenizer

    model_path = resolve_model_path(path_or_hf_repo, revision)
    config = read_config(model_path)
    if model_config:
        config.update(model_config)
    for f in weight_files(model_path, must_exist=strict):
        safetensors_header(f)
    check_tokenizer_files(model_path)
    head = None
    if draft is not None:
        from .draft import read_draft

        head = read_draft(draft, config, model_path)

    model, config = load_model(
        model_path,
        lazy=lazy,
        strict=strict,
        model_config=model_config,
        get_model_classes=lambda config: MODEL_CLASSES[config["model_type"]],
    )
    model.model_path = str(model_path)
    if head is not None:
        from .draft import attach_head

        attach_head(model, head, lazy=lazy, quiet=quiet)
    if not model.has_mtp and not quiet:
        reason = (
            "has no mtp.* tensors"
            if getattr(model, "mtp_missing", False)
            else f"declares no MTP layers ({model.mtp_layers_key})"
        )
        print(
            f"[mlx_mtp] {model_path} {reason}: decoding without MTP. To add a head to an "
            "MLX conversion, run: python -m mlx_mtp.convert --graft "
            f"{model_path} --hf-path <original HF repo> (or draft from a head folder: "
            "--draft-model / draft=)",
            file=sys.stderr,
        )
    tokenizer = load_tokenizer(
        model_path, tokenizer_config, eos_token_ids=config.get("eos_token_id", None)
    )
    if return_config:
        return model, tokenizer, config
    return model, tokenizer
