"""Add the MTP head of a Hugging Face checkpoint to an existing MLX conversion.

Reads only the source's config, index and the shard files that hold `mtp.*`;
the target's trunk files are never rewritten: a sibling folder is built from
hard links to them plus the new head shard, config and index, then swapped in.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from mlx_mtp.checkpoint import text_config

from . import interrupts
from .common import (
    DEFAULT_MTP_BITS_QUANTIZED,
    HEAD_PREFIX,
    INDEX_FILE,
    MTP_BITS_CHOICES,
    ConvertError,
    check_headers,
    config_object,
    describe_quant,
    head_quant,
    head_quant_params,
    human_size,
    local_source,
    log,
    model_weight_files,
    publish,
    read_index,
    read_index_file,
    read_json,
    read_model_config,
    st_dtype_name,
    staging_folder,
    tensor_shapes,
)

HEAD_FILE = "model-mtp.safetensors"


def _source_files(hf_path: Union[str, Path], revision: Optional[str]) -> Tuple[Dict[str, Any], Dict[str, str], callable, bool]:
    """(config, weight_map or {}, fetch(shard) -> local Path, hub?)."""
    src = local_source(hf_path)
    if src is not None:
        if not (src / "config.json").is_file():
            raise ConvertError(f"{src} has no config.json: not a model folder")
        config = config_object(read_json(src / "config.json"), src / "config.json")
        index = read_index(src)
        weight_map = index["weight_map"] if index else {}

        def fetch(name: str) -> Path:
            p = src / name
            if not p.exists():
                raise ConvertError(f"{p} is missing")
            return p

        if not weight_map:  # no index: the header(s) of the file(s) say where mtp.* is
            files = sorted(src.glob("model*.safetensors"))
            if not files:
                raise ConvertError(f"no model*.safetensors files in {src}")
            weight_map = {k: f.name for k, (f, _) in check_headers(files).items()}
        return config, weight_map, fetch, False

    from huggingface_hub import hf_hub_download

    repo = str(hf_path)

    def fetch(name: str) -> Path:
        try:
            return Path(hf_hub_download(repo, name, revision=revision))
        except Exception as e:
            raise ConvertError(f"could not download {name} from {repo}: {type(e).__name__}: {e}") from None

    config = config_object(read_json(fetch("config.json")), f"{repo}/config.json")
    try:
        index_path = Path(hf_hub_download(repo, INDEX_FILE, revision=revision))
        weight_map = read_index_file(index_path)["weight_map"]
    except ConvertError:
        raise
    except Exception as e:
        if type(e).__name__ not in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
            raise ConvertError(f"could not download {INDEX_FILE} from {repo}: {type(e).__name__}: {e}") from None
        path = fetch("model.safetensors")  # single-file repo: the only shard holds the head
        weight_map = {k: "model.safetensors" for k in check_headers([path])}
    return config, weight_map, fetch, True


def _tree_state(folder: Path) -> Dict[str, Tuple]:
    """relative path -> (inode, size, mtime_ns, kind) of every entry under `folder`."""
    out: Dict[str, Tuple] = {}

    def walk(d: Path, rel: str):
        for e in os.scandir(d):
            st = e.stat(follow_symlinks=False)
            r = rel + e.name
            out[r] = (st.st_ino, st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                      st.st_mtime_ns if not stat.S_ISDIR(st.st_mode) else 0, stat.S_IFMT(st.st_mode))
            if stat.S_ISDIR(st.st_mode):
                walk(Path(e.path), r + "/")

    walk(folder, "")
    return out


def _check_unchanged(target: Path, before: Dict[str, Tuple]) -> None:
    """The swap drops the old folder: refuse if anything in it changed since the start
    (a file added or rewritten meanwhile would be lost)."""
    try:
        now = _tree_state(target)
    except OSError as e:
        raise ConvertError(f"{target} cannot be read any more: {e}; nothing was changed") from None
    changed = sorted(set(now) ^ set(before)) or sorted(k for k in now if now[k] != before[k])
    if changed:
        raise ConvertError(
            f"{target} changed while grafting ({changed[0]}); nothing was changed, run the graft again"
        )


def _check_match(target_cfg: Dict, source_cfg: Dict, target: Path, source: str):
    """The checks a drafter folder gets at load (mlx_mtp/draft.py)."""
    from mlx_mtp.draft import check_head_fits_trunk
    from mlx_mtp.model import MTPWeightError, check_head_config

    try:
        check_head_fits_trunk(target_cfg, source_cfg, target, source)
        check_head_config(text_config(source_cfg))
    except (ValueError, MTPWeightError) as e:
        raise ConvertError(str(e)) from None


def _link_tree(src: Path, dst: Path, skip: set):
    """Hard-link (or copy where links fail) every entry of src into dst."""
    for entry in os.scandir(src):
        if entry.name in skip:
            continue
        s, d = Path(entry.path), dst / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(s), d)
        elif entry.is_dir():
            d.mkdir()
            _link_tree(s, d, set())
        else:
            try:
                os.link(s, d)
            except OSError:
                shutil.copy2(s, d)


def graft(
    mlx_dir: Union[str, Path],
    hf_path: Union[str, Path],
    mtp_bits: Optional[int] = None,
    q_group_size: Optional[int] = None,
    dtype: Optional[str] = None,
    force: bool = False,
    revision: Optional[str] = None,
) -> Dict[str, Any]:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map
    from tqdm import tqdm

    from mlx_mtp import __version__
    from mlx_mtp.families import family_of
    from mlx_mtp.model import check_head_weights, declared_mtp_layers, head_layers_in

    if mtp_bits is not None and mtp_bits not in MTP_BITS_CHOICES:
        raise ConvertError(f"--mtp-bits must be one of {', '.join(map(str, MTP_BITS_CHOICES))}")
    target = Path(mlx_dir).expanduser()
    if not target.is_dir():
        hint = (f"; download it first: hf download {mlx_dir} --local-dir ./{str(mlx_dir).split('/')[-1]}"
                if str(mlx_dir).count("/") == 1 and not str(mlx_dir).startswith((".", "/", "~")) else "")
        raise ConvertError(f"--graft {mlx_dir}: not a local MLX folder{hint}")
    target = target.resolve()
    src_local = local_source(hf_path)
    if src_local is not None and src_local == target:
        raise ConvertError("--graft and --hf-path name the same folder")

    # -- target: config, its own headers (never its data) ------------------------
    state = _tree_state(target)  # to prove at the swap that nothing changed meanwhile
    tcfg = read_model_config(target)
    t_files = model_weight_files(target)
    t_headers = check_headers(t_files)
    family = family_of(tcfg.get("model_type"))
    if family.is_unconverted(tensor_shapes(t_headers)):
        raise ConvertError(
            f"{target} is in Hugging Face layout, not an MLX conversion; "
            "use `python -m mlx_mtp.convert --hf-path ... --mlx-path ...` instead"
        )
    old_head = {k for k in t_headers if k.startswith(HEAD_PREFIX)}
    drop_files: set = set()
    if old_head:
        if not force:
            raise ConvertError(f"{target} already has an MTP head ({len(old_head)} tensors); pass --force to replace it")
        by_file: Dict[Path, List[str]] = {}
        for k, (f, _) in t_headers.items():
            by_file.setdefault(f, []).append(k)
        for f, keys in by_file.items():
            n_head = sum(k.startswith(HEAD_PREFIX) for k in keys)
            if n_head and n_head != len(keys):
                raise ConvertError(
                    f"{f.name} mixes trunk and head tensors; cannot replace the head in place, reconvert instead"
                )
            if n_head:
                drop_files.add(f.name)

    # -- source: config + index, then only the head's shards -----------------------
    scfg, weight_map, fetch, hub = _source_files(hf_path, revision)
    _check_match(tcfg, scfg, target, str(hf_path))
    head_keys = sorted(k for k in weight_map if k.startswith(HEAD_PREFIX))
    if not head_keys:
        raise ConvertError(f"{hf_path} has no mtp.* tensors: there is no MTP head to graft")
    layers = declared_mtp_layers(text_config(scfg))
    if layers is None:  # the config names no count: the tensors say
        layers = head_layers_in(head_keys)
    if layers == 0:
        raise ConvertError(f"{hf_path} has mtp.* tensors but its config declares no MTP layers")
    shards = sorted({weight_map[k] for k in head_keys})
    log(f"reading the MTP head from {len(shards)} of {len(set(weight_map.values()))} source shard(s): {', '.join(shards)}")
    paths = [fetch(s) for s in shards]
    check_headers(paths)
    weights = {}
    for p in paths:
        loaded = mx.load(str(p))
        weights.update({k: v for k, v in loaded.items() if k.startswith(HEAD_PREFIX)})
        del loaded
    missing = [k for k in head_keys if k not in weights]
    if missing:
        raise ConvertError(f"{missing[0]} is listed in the source index but not in its shard")
    if any(k.endswith(".scales") for k in weights):
        raise ConvertError(f"the head in {hf_path} is already quantized; graft from the unquantized checkpoint")
    # An unconverted source holds zero-centred norms, a conversion shifted ones
    # (the family's rule, from the index's names: the trunk's shards are not read).
    shift = family.is_unconverted(dict.fromkeys(weight_map))
    interrupts.pause_point("loaded")

    # -- build and quantize the head ------------------------------------------------
    head = family.make_head(family.args_from_config(tcfg), layers)
    weights = family.sanitize_head(weights, layers, shift)
    try:
        check_head_weights(head, weights)
        head.load_weights([(k[len(HEAD_PREFIX):], v) for k, v in weights.items()], strict=True)
    except ValueError as e:
        raise ConvertError(f"the MTP head in {hf_path} does not fit {target}: {e}") from None

    if dtype is None and family.float_dtype_tensor in t_headers:  # the target's float dtype
        dtype = st_dtype_name(t_headers[family.float_dtype_tensor][1]["dtype"])
    dtype = dtype or "bfloat16"
    target_dt = getattr(mx, dtype)
    head.update(tree_map(lambda v: v.astype(target_dt) if mx.issubdtype(v.dtype, mx.floating) else v, head.parameters()))

    tq = tcfg.get("quantization")
    if mtp_bits is None:
        mtp_bits = DEFAULT_MTP_BITS_QUANTIZED if tq else 16
    group_size = q_group_size or (tq or {}).get("group_size") or 64
    recorded: Dict[str, Any] = {}

    def predicate(path, module):
        params = head_quant_params(path, module, mtp_bits, group_size)
        if params:
            recorded[HEAD_PREFIX + path] = params
        return params

    if mtp_bits < 16:
        nn.quantize(head, group_size, mtp_bits, class_predicate=predicate)
    head_tensors = {HEAD_PREFIX + k: v for k, v in tree_flatten(head.parameters())}

    # -- new config and index ---------------------------------------------------------
    cfg = read_json(target / "config.json")  # as written, not as read_config normalised it
    where = text_config(cfg)
    if not declared_mtp_layers(where):
        where[family.mtp_layers_key] = layers
    for key in ("quantization", "quantization_config"):
        if isinstance(cfg.get(key), dict):
            for k in [k for k in cfg[key] if k.startswith(HEAD_PREFIX)]:
                del cfg[key][k]
    if recorded:
        if "quantization" not in cfg:
            cfg["quantization"] = {"group_size": group_size, "bits": mtp_bits, "mode": "affine"}
        cfg["quantization"].update(recorded)
        cfg["quantization_config"] = cfg["quantization"]
    cfg["mlx_mtp"] = {
        "version": __version__,
        "mtp": True,
        "mtp_bits": mtp_bits,
        "mtp_group_size": group_size if recorded else None,
        "norms_shifted": True,
        "grafted_from": str(hf_path),
    }

    index = read_index(target)
    if index is None:
        index = {"metadata": {}, "weight_map": {k: f.name for k, (f, _) in t_headers.items()}}
    wm = {k: v for k, v in index.get("weight_map", {}).items() if v not in drop_files and not k.startswith(HEAD_PREFIX)}
    wm.update({k: HEAD_FILE for k in head_tensors})
    index["weight_map"] = dict(sorted(wm.items()))
    meta = index.setdefault("metadata", {})
    trunk_bytes = sum(i["data_offsets"][1] - i["data_offsets"][0] for k, (f, i) in t_headers.items()
                      if f.name not in drop_files)
    meta["total_size"] = trunk_bytes + sum(v.nbytes for v in head_tensors.values())
    if "total_parameters" in meta and not old_head:
        from mlx_lm.utils import get_total_parameters

        meta["total_parameters"] += get_total_parameters(head)

    # -- staging folder of links + new files, then swap ---------------------------------
    # Removed on any exception or signal until swapped in; the swap first checks
    # that the target is as it was when the graft started.
    with staging_folder(target, "graft", keep=[src_local] if src_local else []) as staging:
        interrupts.pause_point("staging")
        _link_tree(target, staging, skip={"config.json", INDEX_FILE, HEAD_FILE} | drop_files)
        total = sum(v.nbytes for v in head_tensors.values())
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing head") as bar:
            mx.save_safetensors(str(staging / HEAD_FILE), head_tensors, metadata={"format": "mlx"})
            bar.update(total)
        interrupts.pause_point("mid-write")
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=4))
        (staging / "config.json").write_text(json.dumps(cfg, indent=4))
        interrupts.pause_point("before-publish")
        publish(staging, target, may_replace=lambda t: _check_unchanged(t, state))
    interrupts.pause_point("after-publish")

    head_q = head_quant(head)
    return {
        "output": str(target),
        "head_tensors": len(head_tensors),
        "source_shards_read": shards,
        "trunk": describe_quant(tq, dtype),
        "head": describe_quant(head_q, dtype),
        "head_bytes": (target / HEAD_FILE).stat().st_size,
        "norms": "shifted once (HF source)" if shift else "already shifted in source (kept)",
    }


def print_summary(s: Dict[str, Any]) -> None:
    print(f"Grafted an MTP head into {s['output']}")
    print(f"  head tensors   {s['head_tensors']} (from source shard(s) {', '.join(s['source_shards_read'])})")
    print(f"  trunk          {s['trunk']} (files untouched)")
    print(f"  MTP head       {s['head']}, {human_size(s['head_bytes'])} in {HEAD_FILE}")
    print(f"  norms          {s['norms']}")
