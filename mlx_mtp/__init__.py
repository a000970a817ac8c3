"""mlx-mtp: exact multi-token-prediction decoding for Qwen3.5/3.6 on MLX."""

__version__ = "0.1.0"

from .load import load  # noqa: E402
from .generate import generate, stream_generate  # noqa: E402

__all__ = ["load", "generate", "stream_generate", "__version__"]
