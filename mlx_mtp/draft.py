"""MTP heads stored apart from their trunk: a drafter folder, attached at load
(`mlx_mtp.load(trunk, draft=FOLDER)`, `--draft-model FOLDER`).

Folders read (docs/design.md, "Families" / "Draft folders"):

- mlx-vlm's split drafter of the trunk's family (the family's
  `mlx_vlm_drafter`: `qwen3_5_mtp` for Qwen3.5/3.6 and Qwen3-Next,
  `qwen4_exp_mtp` for qwen4_exp), as `mlx_vlm.split_mtp` writes it:
  config.json holds `text_config` (the source model's), `block_size`,
  `tie_word_embeddings` and, when quantized, `quantization`;
  `model.safetensors` holds the head's tensors without the `mtp.` prefix,
  experts as `switch_mlp` (older qwen3_5_mtp versions: as the source had
  them). Whether its norms are shifted is the family's
  `mlx_vlm_drafter_norms_shifted`: the qwen3_5_mtp splitter adds 1 to an HF
  source's, the qwen4_exp_mtp one (mlx-vlm 0.7.10) keeps them zero-centred
  (mlx-vlm's Qwen4ExpRMSNorm applies 1 + w).
- a folder of `mtp.*` safetensors beside the source's config.json: an HF
  release's head shard with its config, an mlx_mtp conversion, or a whole
  checkpoint with a head (only the shards holding `mtp.*` are read).

A folder without an MTP head (a separate draft model, as mlx_lm's
`--draft-model` takes) is refused: the MTP head is the drafter here.

The head must fit the trunk (`check_head_fits_trunk`, shared with
`convert --graft`: the family's `head_match_keys`), and whether its norms are
zero-centred (HF) or shifted (MLX) is read from the folder (`norms_shifted`),
never assumed.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .checkpoint import read_config_file, safetensors_header, text_config, weight_files
from .families import MODEL_CLASSES, family_of
from .model import check_head_config, check_head_weights, declared_mtp_layers, head_layers_in

HEAD_PREFIX = "mtp."
# mlx-vlm's drafter model_type -> a family whose head it holds (MTPModel.mlx_vlm_drafter)
MLX_VLM_DRAFTERS = {cls.mlx_vlm_drafter: cls for cls, _ in MODEL_CLASSES.values()
                    if cls.mlx_vlm_drafter}

_HF_EXPERTS = re.compile(r"\.experts\.(\d+\.(gate|up|down)_proj|gate_up_proj|down_proj)")


class DraftError(ValueError):
    """A drafter folder that cannot be attached; the message is one line."""


def _kind(config: Dict[str, Any]) -> str:
    """The architecture a config describes (`qwen3_5`, `qwen3_5_moe`,
    `qwen3_next`), whether nested (`*_text`), flat, or an mlx-vlm drafter's."""
    kind = text_config(config).get("model_type") or config.get("model_type") or "?"
    return kind[: -len("_text")] if kind.endswith("_text") else kind


def check_head_fits_trunk(trunk_config: Dict, head_config: Dict, trunk_name, head_name) -> None:
    """Raise ValueError ("trunk mismatch: ...") unless the head's source
    config describes the same architecture and sizes as the trunk's (the
    trunk family's `head_match_keys`)."""
    a, b = _kind(trunk_config), _kind(head_config)
    if a != b:
        raise ValueError(f"trunk mismatch: model_type {a!r} in {trunk_name} vs {b!r} in {head_name}")
    t, s = text_config(trunk_config), text_config(head_config)
    for k in family_of(trunk_config.get("model_type")).head_match_keys:
        if t.get(k, 0) != s.get(k, 0):
            raise ValueError(
                f"trunk mismatch: {k} {t.get(k)} in {trunk_name} vs {s.get(k)} in {head_name}")


@dataclass
class DraftHead:
    """A head read from a folder: `mtp.*`-named tensors and what they need."""

    path: Path
    config: Dict[str, Any]  # the source model's config (the trunk it belongs to)
    weights: Dict[str, Any]
    layers: int
    norms_shifted: bool
    norms_evidence: str
    quantization: Optional[Dict[str, Any]]


def _weight_files(folder: Path) -> Tuple[Dict[str, Path], Dict[Path, Dict]]:
    """(tensor name -> file, file -> header) of a folder's safetensors (a
    drafter's files may have any name)."""
    files = weight_files(folder, "*.safetensors")
    headers = {f: safetensors_header(f) for f in files}
    where = {n: f for f, h in headers.items() for n in h if n != "__metadata__"}
    return where, headers


def norms_shifted(config: Dict, names: List[str], all_names: List[str],
                  formats: set, family) -> Tuple[bool, str]:
    """Whether a head's RMSNorm weights are already shifted (+1, MLX) or still
    zero-centred (HF), from the folder's own evidence, strongest first;
    DraftError when nothing tells."""
    recorded = (config.get("mlx_mtp") or {}).get("norms_shifted")
    if recorded is not None:
        return bool(recorded), "recorded by mlx_mtp (config mlx_mtp.norms_shifted)"
    drafter = MLX_VLM_DRAFTERS.get(config.get("model_type"))
    if drafter is not None:
        shifted = drafter.mlx_vlm_drafter_norms_shifted
        return shifted, (f"mlx-vlm split drafter {drafter.mlx_vlm_drafter} (its splitter "
                         + ("shifts them)" if shifted else "keeps them zero-centred)"))
    trunk = [n for n in all_names if not n.startswith(HEAD_PREFIX)]
    if trunk and family is not None:
        hf = family.is_unconverted(dict.fromkeys(trunk))  # names: part of a trunk may be here
        return (not hf), ("HF" if hf else "MLX") + " tensor names of the trunk beside it"
    if config.get("quantization") or any(n.endswith(".scales") for n in names):
        return True, "MLX-quantized head"
    if any(".switch_mlp." in n for n in names):
        return True, "MLX expert layout (switch_mlp)"
    if any(_HF_EXPERTS.search(n) for n in names):
        return False, "HF expert layout"
    if formats == {"pt"}:
        return False, "safetensors written by PyTorch (HF)"
    if formats == {"mlx"}:
        return True, "safetensors written by MLX"
    raise DraftError(
        "cannot tell whether the MTP norms are zero-centred (HF) or shifted (MLX): no "
        "config record, expert layout or safetensors format says; add \"mlx_mtp\": "
        "{\"norms_shifted\": true|false} to its config.json")


def read_draft_folder(folder, trunk_family=None, trunk_config: Optional[Dict] = None,
                      trunk_name=None) -> DraftHead:
    """Read a drafter folder's head (only the shards holding it), after
    checking it against `trunk_config` when given."""
    import mlx.core as mx

    folder = Path(folder)
    config = read_config_file(folder)
    drafter = config.get("model_type") in MLX_VLM_DRAFTERS
    where, headers = _weight_files(folder)
    if drafter:  # mlx-vlm strips the prefix
        rename = {n: n if n.startswith(HEAD_PREFIX) else HEAD_PREFIX + n for n in where}
    else:
        rename = {n: n for n in where if n.startswith(HEAD_PREFIX)}
    if not rename:
        raise DraftError(
            f"{folder} holds no MTP head (no mtp.* tensors; model_type "
            f"{config.get('model_type')!r}): mlx_mtp drafts with the target's MTP head, not "
            "with a separate draft model; give a folder with the head's mtp.* tensors "
            "(e.g. mlx-vlm's split drafter, or the original checkpoint)")
    source = config["text_config"] if drafter and isinstance(config.get("text_config"), dict) else config
    if trunk_config is not None:
        check_head_fits_trunk(trunk_config, source, trunk_name, folder)
    source_text = text_config(source)
    check_head_config(source_text)
    names = sorted(rename.values())
    found = head_layers_in(names)
    declared = declared_mtp_layers(source_text)
    if declared is not None and declared != found:
        raise DraftError(f"{folder}: its config declares {declared} MTP layer(s) but its tensors "
                         f"hold {found}")
    family = trunk_family
    if family is None:
        entry = MODEL_CLASSES.get(config.get("model_type"))
        family = entry[0] if entry else None
    formats = {(h.get("__metadata__") or {}).get("format") for f, h in headers.items()
               if any(where[n] == f for n in rename)}
    shifted, evidence = norms_shifted(config, names, list(where), formats, family)
    weights: Dict[str, Any] = {}
    for f in sorted({where[n] for n in rename}):
        loaded = mx.load(str(f))
        weights.update({rename[n]: v for n, v in loaded.items() if n in rename})
        del loaded
    quant = config.get("quantization")
    if isinstance(quant, dict) and drafter:  # per-module entries are named like the tensors
        quant = {(HEAD_PREFIX + k if isinstance(v, dict) and not k.startswith(HEAD_PREFIX) else k): v
                 for k, v in quant.items()}
    return DraftHead(folder, source, weights, found, shifted, evidence,
                     quant if isinstance(quant, dict) else None)


def attach_head(model, head: DraftHead, lazy: bool = False, quiet: bool = False) -> None:
    """Build the model family's head from `head` and make it the model's."""
    import mlx.core as mx
    import mlx.nn as nn
    from .mlx_lm_compat import infer_quant_config

    family = type(model)
    weights = family.sanitize_head(dict(head.weights), head.layers, not head.norms_shifted)
    new = family.make_head(model.text_args, head.layers)
    quantization = head.quantization or {}
    if any(k.endswith(".scales") for k in weights):
        def predicate(path, module):
            name = HEAD_PREFIX + path
            if isinstance(quantization.get(name), dict):
                return quantization[name]
            if not hasattr(module, "to_quantized") or f"{name}.scales" not in weights:
                return False
            return infer_quant_config(name, module, weights)

        nn.quantize(new, group_size=quantization.get("group_size", 64),
                    bits=quantization.get("bits", 4), class_predicate=predicate)
    check_head_weights(new, weights)
    new.load_weights([(k[len(HEAD_PREFIX):], v) for k, v in weights.items()], strict=True)
    if not lazy:
        mx.eval(new.parameters())
    if model.has_mtp and not quiet:
        print(f"[mlx_mtp] {getattr(model, 'model_path', 'the model')} has its own MTP head; "
              f"drafting with the one in {head.path}", file=sys.stderr)
    model.set_head(0)
    model.mtp = new
    model.mtp_layers = head.layers


def read_draft(draft, trunk_config: Dict, trunk_name) -> DraftHead:
    """Read the drafter folder `draft` for the trunk of `trunk_config`
    (checked before any tensor is read)."""
    folder = Path(draft).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"draft folder {draft} does not exist")
    family = family_of(trunk_config.get("model_type"))
    return read_draft_folder(folder, family, trunk_config, trunk_name)
