"""Hugging Face (or MLX) checkpoint -> MLX folder with the MTP head kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Union

from mlx_mtp.checkpoint import text_config

from . import interrupts
from .common import (
    DEFAULT_MTP_BITS_QUANTIZED,
    HEAD_PREFIX,
    INDEX_FILE,
    MTP_BITS_CHOICES,
    ConvertError,
    check_destination,
    check_headers,
    copy_tokenizer_files,
    describe_quant,
    download_source,
    folder_size,
    head_quant,
    head_quant_params,
    human_size,
    local_source,
    check_replace,
    log,
    model_weight_files,
    publish,
    read_model_config,
    staging_folder,
    tensor_shapes,
    warn,
)

DTYPES = ("float16", "bfloat16", "float32")


def _source_dtype(config: Dict[str, Any]) -> Optional[str]:
    """The dtype mlx_lm.convert would pick: torch_dtype / dtype, top level or text_config."""
    tc = text_config(config)
    for d in (config.get("torch_dtype"), config.get("dtype"), tc.get("torch_dtype"), tc.get("dtype")):
        if d in DTYPES:
            return d
    return None


def _head_quant(model) -> Optional[Dict[str, Any]]:
    """Precision of the loaded/quantized head (None: none, or floating point)."""
    return head_quant(model.mtp) if getattr(model, "has_mtp", False) else None


def _float_dtype(model) -> str:
    """The trunk's floating-point dtype, read from the family's `float_dtype_tensor`."""
    from mlx.utils import tree_flatten

    return str(dict(tree_flatten(model.parameters()))[model.float_dtype_tensor].dtype).split(".")[-1]


def _write_weights(staging: Path, model, desc: str = "writing") -> Dict[str, Any]:
    """Sharded safetensors in mlx_lm's layout; the head in a shard of its own.

    Sharding, file names, metadata and index follow mlx_lm.utils.save_model; the
    head's tensors get the last shard so that `--graft --force` can replace it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import get_total_parameters, make_shards
    from tqdm import tqdm

    weights = dict(tree_flatten(model.parameters()))
    trunk = {k: v for k, v in weights.items() if not k.startswith(HEAD_PREFIX)}
    head = {k: v for k, v in weights.items() if k.startswith(HEAD_PREFIX)}
    n_tensors, n_head = len(weights), len(head)
    shards = make_shards(trunk) + ([head] if head else [])
    n = len(shards)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if n > 1 else "model.safetensors"
    total = sum(v.nbytes for v in weights.values())
    index = {
        "metadata": {"total_size": total, "total_parameters": get_total_parameters(model)},
        "weight_map": {},
    }
    # As mlx_lm's save_model(donate_model=True): only the shards hold the arrays,
    # so each shard's memory is released once it is written.
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    weights.clear()
    del trunk, head
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc) as bar:
        for i in range(n):
            shard, shards[i] = shards[i], None
            name = fmt.format(i + 1, n)
            mx.save_safetensors(str(staging / name), shard, metadata={"format": "mlx"})
            for k in shard:
                index["weight_map"][k] = name
            bar.update(sum(v.nbytes for v in shard.values()))
            del shard
            if i == 0:
                interrupts.pause_point("mid-write")
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=4))
    return {"tensors": n_tensors, "head_tensors": n_head, "shards": n}


def _copy_tower(src: Path, staging: Path) -> int:
    """A vision tower's tensors as released (`model.visual.*`: vision.py
    loads that layout; not quantized) into a shard of their own, listed in
    the index, and its image processor's config, where the config says the
    model takes images. Returns the tensor count."""
    import mlx.core as mx

    from mlx_mtp.checkpoint import read_config_file
    from mlx_mtp.vision import VisionSpec, vision_tensor_names

    try:
        VisionSpec.from_config(read_config_file(src))
    except ValueError:  # (a config without the image tokens: the tower is dropped)
        return 0
    tensors = {}
    for path, names in vision_tensor_names(src).items():
        arrays = mx.load(path)
        tensors.update({k: arrays[k] for k in names})
    if not tensors:
        return 0
    name = "model-vision.safetensors"
    mx.save_safetensors(str(staging / name), tensors, metadata={"format": "mlx"})
    index = json.loads((staging / INDEX_FILE).read_text())
    index["weight_map"] = dict(sorted({**index["weight_map"],
                                       **{k: name for k in tensors}}.items()))
    index["metadata"]["total_size"] += sum(v.nbytes for v in tensors.values())
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=4))
    if (src / "preprocessor_config.json").is_file():
        shutil.copyfile(src / "preprocessor_config.json", staging / "preprocessor_config.json")
    return len(tensors)


def _model_card(staging: Path, hf_path: str, hub: bool):
    base = f"base_model: {hf_path}\n" if hub else ""
    (staging / "README.md").write_text(
        "---\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n- mtp\n"
        f"{base}---\n\nConverted with `python -m mlx_mtp.convert`; the multi-token-prediction "
        "head (`mtp.*`) is kept. Load with `mlx_mtp.load` for MTP decoding, or with "
        "`mlx_lm.load` for plain decoding.\n"
    )


def convert(
    hf_path: Union[str, Path],
    mlx_path: Union[str, Path],
    quantize: bool = False,
    q_bits: Optional[int] = None,
    q_group_size: Optional[int] = None,
    dtype: Optional[str] = None,
    mtp_bits: Optional[int] = None,
    force: bool = False,
    revision: Optional[str] = None,
) -> Dict[str, Any]:
    """Convert `hf_path` (hub repo id or local folder, HF or MLX layout) into `mlx_path`.

    Returns the summary as a dict (also printed by the CLI)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import load_model, quantize_model

    from mlx_mtp import __version__
    from mlx_mtp.families import MODEL_CLASSES, family_of

    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}")
    if mtp_bits is not None and mtp_bits not in MTP_BITS_CHOICES:
        raise ConvertError(f"--mtp-bits must be one of {', '.join(map(str, MTP_BITS_CHOICES))}")
    if not quantize and (q_bits is not None or q_group_size is not None):
        raise ConvertError("--q-bits / --q-group-size need -q (quantize the trunk)")

    src = local_source(hf_path)
    hub = src is None
    out = check_destination(Path(mlx_path), src, force)
    if hub:
        src = download_source(str(hf_path), revision)

    config = read_model_config(src)  # a JSON object, model_type check, one-line errors
    qc = config.get("quantization_config") or text_config(config).get("quantization_config")
    if qc and "quantization" not in config:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise ConvertError(
            f"{src} is a pre-quantized checkpoint ({method}); convert from the bf16 release instead"
        )
    files = model_weight_files(src)  # index checked, every shard present
    headers = check_headers(files)
    family = family_of(config["model_type"])
    unconverted = family.is_unconverted(tensor_shapes(headers))
    has_head = any(k.startswith(HEAD_PREFIX) for k in headers)
    if unconverted:
        log(f"source {src} is in Hugging Face layout: norms are shifted (+1) once")
    else:
        log(f"source {src} is already in MLX layout: norms were shifted before, not shifting again")
    if not has_head:
        warn(
            f"{src} has no mtp.* tensors: the output will decode without MTP "
            "(add a head later with --graft)"
        )

    src_quant = config.get("quantization")
    if src_quant and quantize:
        raise ConvertError(
            f"{src} is already quantized ({describe_quant(src_quant, '')}); "
            "convert from the unquantized checkpoint, or leave out -q"
        )

    group_size = q_group_size or (src_quant or {}).get("group_size") or 64
    mtp_bits_given = mtp_bits is not None
    if mtp_bits is None:
        mtp_bits = DEFAULT_MTP_BITS_QUANTIZED if (quantize or src_quant) else 16

    log("loading (lazy)")
    try:
        model, config = load_model(
            src, lazy=True, get_model_classes=lambda config: MODEL_CLASSES[config["model_type"]]
        )
    except (ValueError, KeyError, TypeError) as e:  # TypeError: a config value of the wrong type
        what = f"{type(e).__name__}: " if isinstance(e, TypeError) else ""
        raise ConvertError(f"cannot load {src}: {what}{e}") from None
    interrupts.pause_point("loaded")

    if dtype is None:
        dtype = _source_dtype(config)
    if dtype is not None:
        target = getattr(mx, dtype)
        cast_predicate = getattr(model, "cast_predicate", lambda _: True)

        def set_dtype(k, v):
            if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
                return v.astype(target)
            return v

        model.update(tree_map_with_path(set_dtype, model.parameters()))

    if has_head and not model.has_mtp:
        warn(f"{src} has mtp.* tensors but its config declares no MTP layers: head dropped")
    if model.has_mtp and model.mtp_layers_declared is None:  # found from the tensors: record it
        text_config(config)[model.mtp_layers_key] = model.mtp_layers
    head_q_before = _head_quant(model)
    if head_q_before and not mtp_bits_given:
        mtp_bits = head_q_before["bits"]  # an already-quantized head stays as it is
    if head_q_before and mtp_bits != head_q_before["bits"]:
        raise ConvertError(
            f"the source's head is already quantized at {head_q_before['bits']} bits; "
            f"cannot change it to {mtp_bits}: convert from the unquantized checkpoint"
        )

    quant_head = model.has_mtp and mtp_bits < 16 and head_q_before is None
    if quantize or quant_head:
        trunk_predicate = getattr(model, "quant_predicate", None)

        def predicate(path, module):
            if path.startswith(HEAD_PREFIX):
                if not quant_head:
                    return False
                return head_quant_params(path[len(HEAD_PREFIX):], module, mtp_bits, group_size)
            if not quantize:
                return False
            return trunk_predicate(path, module) if trunk_predicate else True

        bits = q_bits if quantize else mtp_bits
        parts = ([f"trunk to {q_bits or 4} bits"] if quantize else []) + (
            [f"head to {mtp_bits} bits"] if quant_head else [])
        log("quantizing " + ", ".join(parts))
        model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)

    trunk_q = config.get("quantization") if (quantize or src_quant) else None
    head_q = _head_quant(model)
    float_dtype = _float_dtype(model)
    has_mtp = bool(model.has_mtp)
    head_context = (config.get("mlx_mtp") or {}).get("head_context")  # the head's, kept
    config["mlx_mtp"] = {
        "version": __version__,
        "mtp": has_mtp,
        "mtp_bits": (head_q["bits"] if head_q else 16) if has_mtp else None,
        "mtp_group_size": head_q["group_size"] if head_q else None,
        "norms_shifted": True,
        "source": str(hf_path) if hub else str(src),
        **({"head_context": head_context} if has_mtp and head_context else {}),
    }

    # Removed on any exception or signal until published; `publish` checks again
    # that an existing `out` may be replaced (it may have changed meanwhile).
    with staging_folder(out, keep=[src]) as staging:
        interrupts.pause_point("staging")
        stats = _write_weights(staging, model)  # donates the model's arrays
        del model
        stats["vision_tensors"] = _copy_tower(Path(src), staging)
        from mlx_lm.utils import save_config

        save_config(config, staging / "config.json",
                    keep_vision_config=bool(stats["vision_tensors"]))
        copied = copy_tokenizer_files(src, staging)
        if "tokenizer_config.json" not in copied and "tokenizer.json" not in copied:
            warn(f"{src} has no tokenizer files; add them to {out} before loading")
        _model_card(staging, str(hf_path), hub)
        interrupts.pause_point("before-publish")
        publish(staging, out, may_replace=lambda o: check_replace(o, force))
    interrupts.pause_point("after-publish")

    summary = {
        "output": str(out),
        "tensors": stats["tensors"],
        "head_tensors": stats["head_tensors"],
        "shards": stats["shards"],
        "trunk": describe_quant(trunk_q, float_dtype),
        "head": (describe_quant(head_q, float_dtype) if has_mtp else "none (no mtp.* in source)"),
        "size_bytes": folder_size(out),
        "norms": "shifted once" if unconverted else "already shifted in source (kept)",
        "vision": (f"{stats['vision_tensors']} tensors kept as released (images: "
                   "pip install 'mlx-mtp[vision]')" if stats["vision_tensors"] else "none"),
    }
    return summary


def print_summary(s: Dict[str, Any]) -> None:
    print(f"Wrote {s['output']}")
    print(f"  tensors     {s['tensors']} ({s['head_tensors']} in the MTP head) in {s['shards']} shard(s)")
    print(f"  trunk       {s['trunk']}")
    print(f"  MTP head    {s['head']}")
    print(f"  norms       {s['norms']}")
    print(f"  vision      {s['vision']}")
    print(f"  size        {human_size(s['size_bytes'])}")
