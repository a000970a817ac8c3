"""Shared pieces of `mlx_mtp.convert`: sources, staging folders, head precision."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from mlx_mtp.load import CheckpointError, safetensors_header

# Files a text-only conversion needs from a Hugging Face repository. The
# vision tower's preprocessor files and anything else are never downloaded.
CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
]
TOKENIZER_GLOBS = ["*.jinja", "*.tiktoken"]
WEIGHT_PATTERNS = ["model*.safetensors", "model.safetensors.index.json"]
ALLOW_PATTERNS = CONFIG_FILES + TOKENIZER_FILES + TOKENIZER_GLOBS + WEIGHT_PATTERNS

INDEX_FILE = "model.safetensors.index.json"
HEAD_PREFIX = "mtp."

# Head precision when --mtp-bits is not given and the trunk is quantized.
# 8 bits: see convert/README.md ("Head precision") for the measurement.
DEFAULT_MTP_BITS_QUANTIZED = 8
MTP_BITS_CHOICES = (16, 8, 6, 5, 4)

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class ConvertError(RuntimeError):
    """A conversion that cannot proceed; the message is one line for the user."""


def log(msg: str) -> None:
    print(f"[mlx_mtp.convert] {msg}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    print(f"[mlx_mtp.convert] WARNING: {msg}", file=sys.stderr, flush=True)


# -- sources ------------------------------------------------------------------
def is_hub_id(path_or_repo: Union[str, Path]) -> bool:
    s = str(path_or_repo)
    return not Path(s).expanduser().exists() and not s.startswith((".", "/", "~")) and s.count("/") == 1


def local_source(path_or_repo: Union[str, Path]) -> Optional[Path]:
    """The local folder, None for a hub id; raises when neither."""
    p = Path(str(path_or_repo)).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConvertError(f"{p} is not a model folder")
        return p.resolve()
    if is_hub_id(path_or_repo):
        return None
    raise ConvertError(f"source {path_or_repo} does not exist (neither a folder nor a hub repo id)")


def download_source(repo: str, revision: Optional[str] = None) -> Path:
    """Snapshot of only the files a text conversion needs."""
    from huggingface_hub import snapshot_download

    log(f"downloading {repo} (config, tokenizer and weight files only)")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # network, auth, missing repo: one line
        raise ConvertError(f"could not download {repo}: {type(e).__name__}: {e}") from None


def read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConvertError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path} is not valid JSON: {e}") from None


def text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    return config.get("text_config", config)


def check_headers(files: Iterable[Path]) -> Dict[str, Tuple[Path, Dict[str, Any]]]:
    """Header of every tensor (name -> (file, entry)); corrupt files raise naming the file."""
    out: Dict[str, Tuple[Path, Dict[str, Any]]] = {}
    for f in files:
        for name, info in safetensors_header(Path(f)).items():
            if name != "__metadata__":
                out[name] = (Path(f), info)
    return out


def is_unconverted(headers: Dict[str, Tuple[Path, Dict[str, Any]]]) -> bool:
    """True for the HF layout (conv1d [C, 1, K], zero-centred norms not yet shifted).

    The same rule mlx_lm's qwen3_5 sanitize and mlx_mtp's use to decide whether to
    shift the norms by +1: after conversion conv1d is stored [C, K, 1]."""
    for name, (_, info) in headers.items():
        if "conv1d.weight" in name:
            return info["shape"][-1] != 1
    return True


def st_dtype_name(st_dtype: str) -> Optional[str]:
    return _ST_DTYPES.get(st_dtype)


# -- output folders -----------------------------------------------------------
def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_destination(out: Path, source: Optional[Path], force: bool) -> Path:
    out = Path(out).expanduser().resolve()
    if source is not None:
        src = source.resolve()
        if out == src or _is_within(src, out) or _is_within(out, src):
            raise ConvertError(
                f"output {out} overlaps the source {src}; the source is never modified, choose another --mlx-path"
            )
    if out.exists():
        if not out.is_dir():
            raise ConvertError(f"output {out} exists and is not a folder")
        if any(out.iterdir()) and not force:
            raise ConvertError(f"output {out} exists and is not empty; pass --force to replace it")
    return out


def make_staging(out: Path, tag: str = "tmp") -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.parent.glob(f".{out.name}.*-*") if p.is_dir())
    if stale:
        warn(f"leftover folder(s) of an interrupted run in {out.parent}: {', '.join(stale)} (safe to delete)")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{tag}-", dir=out.parent))
    if out.is_dir():  # keep an existing folder's permissions
        os.chmod(staging, out.stat().st_mode & 0o7777)
    else:  # mkdtemp's 0700 -> what mkdir would give under the umask
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)
    return staging


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 / macOS renamex_np). False if unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
            rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), ctypes.c_uint(0x2))  # RENAME_SWAP
        elif sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
            AT_FDCWD = -100
            rc = libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), ctypes.c_uint(0x2))
        else:
            return False
    except (OSError, AttributeError):
        return False
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise OSError(err, os.strerror(err), str(a))
    return True


def publish(staging: Path, out: Path) -> None:
    """Move a finished staging folder to `out`, replacing what is there.

    An existing folder is swapped atomically where the OS allows it (otherwise
    renamed aside first, then removed), so readers see either the old or the new
    folder, never a half-written one."""
    if not out.exists():
        os.rename(staging, out)
        return
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
        os.rename(staging, out)
        return
    if _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old folder
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def copy_tokenizer_files(src: Path, dst: Path) -> List[str]:
    copied = []
    names = set(TOKENIZER_FILES) | {"generation_config.json"}
    for g in TOKENIZER_GLOBS:
        names |= {p.name for p in src.glob(g)}
    for name in sorted(names):
        p = src / name
        if p.is_file():
            shutil.copyfile(p, dst / name)
            copied.append(name)
    return copied


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


# -- head precision -----------------------------------------------------------
def head_quant_params(path: str, module, bits: int, group_size: int, mode: str = "affine"):
    """Quantization of one head module (`path` without the `mtp.` prefix).

    False keeps it in floating point. Mirrors mlx_lm: only modules with
    `to_quantized` whose input dim divides the group size; MoE router gates
    (`mlp.gate`, `shared_expert_gate`) at 8 bits at least, as mlx_lm's
    qwen3_5 quant_predicate does for the trunk."""
    if bits >= 16 or not hasattr(module, "to_quantized"):
        return False
    if module.weight.shape[-1] % group_size != 0:
        return False
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return {"group_size": 64, "bits": max(8, bits), "mode": "affine"} if module.weight.shape[-1] % 64 == 0 else False
    return {"group_size": group_size, "bits": bits, "mode": mode}


def describe_quant(q: Optional[Dict[str, Any]], float_dtype: str) -> str:
    if not q:
        return float_dtype
    mode = q.get("mode", "affine")
    return f"{q['bits']}-bit (group {q['group_size']}{'' if mode == 'affine' else ', ' + mode})"
