"""Model families: one file each (see mlx_mtp/model.py for what a family says,
docs/design.md "Families"), what they share in common.py."""

from . import qwen3_5, qwen3_next, qwen4_exp

MODEL_CLASSES = {**qwen3_5.MODEL_CLASSES, **qwen3_next.MODEL_CLASSES,
                 **qwen4_exp.MODEL_CLASSES}
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASSES)


def family_of(model_type) -> type:
    """The model class of a supported `model_type`; a ValueError listing the
    supported ones otherwise (one line)."""
    if model_type not in MODEL_CLASSES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by mlx_mtp; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return MODEL_CLASSES[model_type][0]

