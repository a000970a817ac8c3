"""mlx-mtp: exact multi-token-prediction decoding for Qwen3.5/3.6 on MLX."""

import warnings

__version__ = "0.1.0"

# `python -m mlx_mtp.generate` runs the module that this package also imports
# for its `generate` function; runpy's warning about that is harmless.
warnings.filterwarnings("ignore", message=r"'mlx_mtp\.\w+' found in sys.modules", category=RuntimeWarning)

from .load import load  # noqa: E402
from .generate import generate, stream_generate  # noqa: E402

__all__ = ["load", "generate", "stream_generate", "__version__"]
