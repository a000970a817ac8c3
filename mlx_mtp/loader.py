"""Load a Qwen3.5/3.6, Qwen3-Next or Qwen3.8-Flash-Next checkpoint (HF or MLX layout) with its MTP head."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

import mlx.core as mx

from .checkpoint import (CheckpointError, read_config_file,  # noqa: F401 (CheckpointError: re-exported)
                         safetensors_header, weight_files)
from .draft import attach_head, read_draft
from .families import MODEL_CLASSES, family_of
from .ngram_tables import MODES, place_tables
from .quantized import use_shared_reads

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .model import MTPModel

DEMO_MODEL_DIR = Path(__file__).parent / "demo"

DOWNLOAD_PATTERNS = [
    "*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken",
]

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


def read_config(model_path: Path) -> Dict[str, Any]:
    """A model folder's config; its model_type must be a supported family."""
    config = read_config_file(model_path)
    family_of(config.get("model_type"))  # one line naming the supported types
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def head_context(config: Dict[str, Any], model_path: Path) -> Optional[int]:
    """The context the head was trained on, when its config records it
    (`mlx_mtp.head_context`, tokens): prompts longer than that are followed
    by the head over their last that many tokens only."""
    value = (config.get("mlx_mtp") or {}).get("head_context")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CheckpointError(f"{model_path / 'config.json'}: mlx_mtp.head_context must be a "
                              f"positive number of tokens, not {value!r}")
    return value


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
    ngram_tables: str = "auto",
) -> Union[Tuple["MTPModel", "TokenizerWrapper"],
           Tuple["MTPModel", "TokenizerWrapper", Dict[str, Any]]]:
    """Load model (trunk + MTP head) and tokenizer (and the config with
    return_config=True). Without a path, the demo model.

    The model is mlx_lm's own class for the trunk, so it also works unchanged
    with mlx_lm.generate. A checkpoint without `mtp.*` loads for plain decoding
    (one notice on stderr). `draft`: a folder holding an MTP head for this
    trunk (mlx-vlm's split drafter, or `mtp.*` safetensors with their
    config; see mlx_mtp/draft.py), drafted with instead of the checkpoint's own.
    `ngram_tables` ('auto', 'disk', 'memory'): where a `qwen4_exp` model's
    n-gram tables stay (mlx_mtp/ngram_tables.py); 'auto' keeps them in memory
    while the checkpoint fits this machine's memory comfortably. One line says
    which was chosen.
    """
    from .mlx_lm_compat import load_model, load_tokenizer

    model_path = resolve_model_path(path_or_hf_repo, revision)
    config = read_config(model_path)
    if model_config:
        config.update(model_config)
    headers = [(f, safetensors_header(f)) for f in weight_files(model_path, must_exist=strict)]
    if ngram_tables not in MODES:
        raise ValueError(f"ngram_tables must be one of {', '.join(MODES)}, not {ngram_tables!r}")
    check_tokenizer_files(model_path)
    head = None
    if draft is not None:
        head = read_draft(draft, config, model_path)

    # lazily: n-gram tables read from disk are never evaluated (never read whole)
    model, config = load_model(
        model_path,
        lazy=True,
        strict=strict,
        model_config=model_config,
        get_model_classes=lambda config: MODEL_CLASSES[config["model_type"]],
    )
    place_tables(model, model_path, ngram_tables, headers, strict, quiet)
    if not lazy:
        mx.eval(model.parameters())
    model.model_path = str(model_path)
    model.head_context = head_context(config, model_path)
    if head is not None:
        attach_head(model, head, lazy=lazy, quiet=quiet)
    use_shared_reads(model)  # on a GPU a verify reads each quantized weight once
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
