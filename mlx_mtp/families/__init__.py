"""Model families: one file each (see mlx_mtp/model.py for what a family says)."""

from . import qwen3_5

MODEL_CLASSES = {**qwen3_5.MODEL_CLASSES}
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASSES)
