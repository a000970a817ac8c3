"""mlx_mtp.convert: Hugging Face -> MLX with the MTP head kept, and --graft.

    python -m mlx_mtp.convert --hf-path Qwen/Qwen3.6-27B --mlx-path out -q --q-bits 4
    python -m mlx_mtp.convert --graft ./Qwen3.6-27B-4bit --hf-path Qwen/Qwen3.6-27B
"""

from .common import ConvertError
from .convert import convert
from .graft import graft

__all__ = ["convert", "graft", "ConvertError"]
