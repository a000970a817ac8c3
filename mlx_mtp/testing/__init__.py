"""Test and benchmark scaffolding: tiny checkpoints in the released layout
(`synthetic`), drafters with known behaviour (`drafters`), and a tiny trained
model that copies from its context (`COPY_MODEL_DIR`)."""

from pathlib import Path

# A 4-layer Qwen3.5-architecture model with its MTP head, trained by
# train/copy_model.py to repeat spans of its context (SEARCH/REPLACE edits of a
# file): the text context drafts are for. Not the README's demo (mlx_mtp/demo).
COPY_MODEL_DIR = Path(__file__).parent / "copy_model"
