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
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from mlx_mtp.checkpoint import CheckpointError, safetensors_header, weight_files

# Files a conversion needs from a Hugging Face repository (the vision
# tower's weights come with the model's; its image processor's config too).
CONFIG_FILES = ["config.json", "generation_config.json", "preprocessor_config.json"]
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


def check_headers(files: Iterable[Path]) -> Dict[str, Tuple[Path, Dict[str, Any]]]:
    """Header of every tensor (name -> (file, entry)); corrupt files raise naming the file."""
    out: Dict[str, Tuple[Path, Dict[str, Any]]] = {}
    for f in files:
        for name, info in safetensors_header(Path(f)).items():
            if name != "__metadata__":
                out[name] = (Path(f), info)
    return out


def tensor_shapes(headers: Dict[str, Tuple[Path, Dict[str, Any]]]) -> Dict[str, Tuple[int, ...]]:
    """name -> shape, from `check_headers` (what a family's `is_unconverted` reads)."""
    return {name: tuple(info["shape"]) for name, (_, info) in headers.items()}


def st_dtype_name(st_dtype: str) -> Optional[str]:
    return _ST_DTYPES.get(st_dtype)


# -- model folders --------------------------------------------------------------
def config_object(config: Any, where) -> Dict[str, Any]:
    """A config.json's contents, checked to be a JSON object whose
    text_config, when there is one, is a JSON object too."""
    if not isinstance(config, dict):
        raise ConvertError(f"{where} is not a JSON object (found {type(config).__name__})")
    if "text_config" in config and not isinstance(config["text_config"], dict):
        raise ConvertError(f"{where}: text_config is not a JSON object")
    return config


def read_model_config(folder: Path) -> Dict[str, Any]:
    """config.json of a model folder, checked to be a JSON object (text_config too),
    then mlx_mtp's own checks (model_type). One-line errors naming the file."""
    from mlx_mtp.loader import read_config

    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConvertError(f"{folder} has no config.json: not a model folder")
    config_object(read_json(cfg_file), cfg_file)
    try:
        return read_config(folder)
    except (CheckpointError, ValueError) as e:
        raise ConvertError(f"{cfg_file}: {e}") from None


def read_index(folder: Path) -> Optional[Dict[str, Any]]:
    """model.safetensors.index.json of a folder (None when there is none), checked:
    a JSON object whose weight_map maps tensor names to file names."""
    path = Path(folder) / INDEX_FILE
    return read_index_file(path) if path.exists() else None


def read_index_file(path: Path) -> Dict[str, Any]:
    path = Path(path)
    index = read_json(path)
    if not isinstance(index, dict):
        raise ConvertError(f"{path} is not a JSON object (found {type(index).__name__})")
    wm = index.get("weight_map")
    if not isinstance(wm, dict):
        raise ConvertError(f"{path} has no weight_map" if wm is None else f"{path}: weight_map is not a JSON object")
    for k, v in wm.items():
        if not isinstance(v, str) or not v:
            raise ConvertError(f"{path}: weight_map entry {k!r} names no file: {v!r}")
    return index


def model_weight_files(folder: Path) -> List[Path]:
    """The safetensors files of a checkpoint (index checked first), all of them existing."""
    read_index(folder)
    try:
        return weight_files(Path(folder))
    except FileNotFoundError as e:
        raise ConvertError(str(e)) from None


# -- output folders -----------------------------------------------------------
def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def not_replaceable(out: Path) -> Optional[str]:
    """Why `--force` may not replace the existing folder `out` (None: it may).

    It may when the folder is empty or holds a model: a config.json plus
    *.safetensors weights. Never the file-system root, the home folder or a
    folder holding the current working folder."""
    out = Path(out)
    try:
        entries = list(out.iterdir())
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    cwd = Path.cwd().resolve() if os.path.isdir(os.getcwd()) else None
    if out.parent == out:
        return "it is the file-system root"
    if out == Path.home().resolve():
        return "it is the home folder"
    if cwd is not None and (cwd == out or _is_within(cwd, out)):
        return "it is (or holds) the current working folder"
    if not entries:
        return None
    if not (out / "config.json").is_file():
        return "it has no config.json, so it does not hold a model"
    if not any(p.name.endswith(".safetensors") and p.is_file() for p in entries):
        return "it has config.json but no *.safetensors weights, so it does not hold a model"
    return None


def check_destination(out: Path, source: Optional[Path], force: bool) -> Path:
    out = Path(out).expanduser().resolve()
    if source is not None:
        src = source.resolve()
        if out == src or _is_within(src, out) or _is_within(out, src):
            raise ConvertError(
                f"output {out} overlaps the source {src}; the source is never modified, choose another --mlx-path"
            )
    remove_stale_temps(out, keep=[source] if source is not None else [])
    check_replace(out, force)
    return out


def check_replace(out: Path, force: bool) -> None:
    if not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise ConvertError(f"output {out} exists and is not a folder")
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise ConvertError(f"output {out} cannot be read: {e.strerror or e}") from None
    if not empty and not force:
        raise ConvertError(f"output {out} exists and is not empty; pass --force to replace it")
    why = not_replaceable(out)
    if why:
        what = "replace" if not empty else "use"
        raise ConvertError(f"refusing to {what} {out}: {why}; nothing was changed (choose another --mlx-path)")


# Temporary folders beside an output: .NAME.tmp-PID-XXXXXXXX (staging), .NAME.graft-PID-XXXXXXXX
# (graft staging), .NAME.old-PID-XXXXXXXX (an old folder set aside while publishing). Names
# without the PID are those of earlier versions.
TEMP_TAGS = ("tmp", "graft", "old")


def _temp_re(name: str):
    import re

    return re.compile(r"\.%s\.(%s)-(?:(\d+)-)?[a-z0-9_]{8}\Z" % (re.escape(name), "|".join(TEMP_TAGS)))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is not writing it: every run makes a new one
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def remove_stale_temps(out: Path, keep: Iterable[Path] = ()) -> List[str]:
    """Remove the temporary folders that a killed run of `out` left beside it.

    Only folders named exactly as this package names them, whose process (the
    PID in the name) is gone; one line says what was removed."""
    from . import interrupts

    out = Path(out)
    pat = _temp_re(out.name)
    keep = {Path(k).resolve() for k in keep}
    removed, busy = [], []
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return []
    for e in sorted(entries, key=lambda e: e.name):
        m = pat.match(e.name)
        if not m or e.is_symlink() or not e.is_dir(follow_symlinks=False):
            continue
        p = Path(e.path)
        if p.resolve() in keep or any(_is_within(k, p.resolve()) for k in keep):
            continue
        if m.group(2) and _pid_alive(int(m.group(2))):
            busy.append(e.name)
            continue
        if m.group(1) == "old" and not (out.exists() or out.is_symlink()):
            # killed between the two renames of a publish without atomic exchange:
            # this is the folder that was being replaced; put it back.
            try:
                os.rename(p, out)
                log(f"restored {out} from {e.name} (left by a run killed while replacing it)")
                continue
            except OSError:
                pass
        with interrupts.deferred():
            shutil.rmtree(p, ignore_errors=True)
        (busy if p.exists() else removed).append(e.name)
    if removed:
        log(f"removed leftover temporary folder(s) of an interrupted run in {out.parent}: {', '.join(removed)}")
    if busy:
        warn(f"temporary folder(s) in {out.parent} belong to a run still going, or cannot be removed; "
             f"left alone: {', '.join(busy)}")
    return removed


def _mkdtemp(out: Path, tag: str) -> Path:
    from . import interrupts

    with interrupts.deferred():  # registered before a signal can strike
        p = Path(tempfile.mkdtemp(prefix=f".{out.name}.{tag}-{os.getpid()}-", dir=out.parent))
        interrupts.add_temp(p)
    return p


def make_staging(out: Path, tag: str = "tmp", keep: Iterable[Path] = ()) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out, keep)
    staging = _mkdtemp(out, tag)
    if out.is_dir():  # keep an existing folder's permissions
        os.chmod(staging, out.stat().st_mode & 0o7777)
    else:  # mkdtemp's 0700 -> what mkdir would give under the umask
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)
    return staging


@contextmanager
def staging_folder(out: Path, tag: str = "tmp", keep: Iterable[Path] = ()) -> Iterator[Path]:
    """A staging folder beside `out`, removed if the body does not publish it."""
    from . import interrupts

    staging = None
    try:
        staging = make_staging(out, tag, keep)
        yield staging
    except BaseException:
        if staging is not None:
            interrupts.remove_temp(staging)
        raise


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


def publish(staging: Path, out: Path, may_replace: Optional[Callable[[Path], None]] = None) -> None:
    """Move a finished staging folder to `out`, replacing what is there.

    `may_replace(out)` raises ConvertError when an existing `out` may not be
    replaced; it runs here again, just before the swap, because the folder may
    have changed since the run started (default: only an empty folder may be).
    An existing folder is swapped atomically where the OS allows it (otherwise
    renamed aside first, then removed), so readers see either the old or the new
    folder, never a half-written one. Signals are held off from the last check
    to the end; one that arrived before the rename stops it (no output)."""
    from . import interrupts

    with interrupts.deferred():
        if out.exists() or out.is_symlink():
            (may_replace or (lambda o: check_replace(o, force=False)))(out)
        interrupts.check()  # the last moment a signal can still mean "no output"
        if not out.exists():
            os.rename(staging, out)
            interrupts.mark_published(out)
            interrupts.remove_temp(staging)  # (gone: unregisters it)
            return
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
            os.rename(staging, out)
            interrupts.mark_published(out)
            interrupts.remove_temp(staging)
            return
        if _exchange(staging, out):
            interrupts.mark_published(out)
            interrupts.remove_temp(staging)  # staging now holds the old folder
            return
        # Not registered as a temporary until the swap is done: until then it is the user's folder.
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        old.rmdir()
        os.rename(out, old)
        try:
            os.rename(staging, out)
        except BaseException:
            os.rename(old, out)
            raise
        interrupts.mark_published(out)
        interrupts.add_temp(old)
        interrupts.remove_temp(staging)
        interrupts.remove_temp(old)


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
def is_router(path: str) -> bool:
    """An MoE router gate (`mlp.gate`, `shared_expert_gate`), which the
    families' quant_predicates (mlx_lm's qwen3_5 / qwen3_next, qwen4_exp's)
    keep at 8 bits."""
    return path.endswith(("mlp.gate", "shared_expert_gate"))


def head_quant_params(path: str, module, bits: int, group_size: int, mode: str = "affine"):
    """Quantization of one head module (`path` without the `mtp.` prefix).

    False keeps it in floating point. Mirrors mlx_lm: only modules with
    `to_quantized` whose input dim divides the group size; MoE router gates
    (`is_router`) at 8 bits at least, as the families' quant_predicates do
    for the trunk."""
    if bits >= 16 or not hasattr(module, "to_quantized"):
        return False
    if module.weight.shape[-1] % group_size != 0:
        return False
    if is_router(path):
        return {"group_size": 64, "bits": max(8, bits), "mode": "affine"} if module.weight.shape[-1] % 64 == 0 else False
    return {"group_size": group_size, "bits": bits, "mode": mode}


def head_quant(head) -> Optional[Dict[str, Any]]:
    """Precision of a built head module (None: floating point): the quant
    params of its quantized linear layers, routers aside (`is_router`)."""
    import mlx.nn as nn

    for path, m in head.named_modules():
        if isinstance(m, nn.QuantizedLinear) and not is_router(path):
            return {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
    return None


def describe_quant(q: Optional[Dict[str, Any]], float_dtype: str) -> str:
    if not q:
        return float_dtype
    mode = q.get("mode", "affine")
    return f"{q['bits']}-bit (group {q['group_size']}{'' if mode == 'affine' else ', ' + mode})"
