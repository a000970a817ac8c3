"""mlx-mtp: exact multi-token-prediction decoding for Qwen3.5/3.6 and Qwen3-Next on MLX.

The public names load on first use (PEP 562), so the command-line tools start
(and the converter installs its signal handlers) before MLX and transformers
load.
"""

import importlib
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

# No export shares a submodule's name: the import system binds a submodule to
# its name on the package when it is first imported, which would hide the
# function (`mlx_mtp.generate` the module is the CLI, run with -m).
_EXPORTS = {"load": "loader", "generate": "api", "generate_step": "api",
            "stream_generate": "api", "batch_generate": "api",
            "make_sampler": "sampling", "make_logits_processors": "sampling",
            "sharded_load": "distributed", "constrain": "constraint"}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
