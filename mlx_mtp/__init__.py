"""mlx-mtp: exact multi-token-prediction decoding for Qwen3.5/3.6 on MLX."""

import os
import warnings

__version__ = "0.1.0"

# `python -m mlx_mtp.generate` runs the module that this package also imports
# for its `generate` function; runpy's warning about that is harmless.
warnings.filterwarnings("ignore", message=r"'mlx_mtp\.\w+' found in sys.modules", category=RuntimeWarning)

# In a source checkout metal/ and convert/ sit beside this folder (the layout
# shows the pipeline); an installed wheel puts them inside it (pyproject
# package-dir). Let a plain checkout on sys.path find them too.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "metal")) and os.path.isfile(
    os.path.join(_root, "metal", "__init__.py")
):
    __path__.append(_root)  # noqa: F821

from .load import load  # noqa: E402
from .generate import generate, generate_step, stream_generate  # noqa: E402
from .sampling import make_sampler  # noqa: E402

__all__ = ["load", "generate", "generate_step", "stream_generate", "make_sampler", "__version__"]
