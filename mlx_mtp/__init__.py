"""mlx-mtp: exact multi-token-prediction decoding for Qwen3.5/3.6 and Qwen3-Next on MLX.

The public names load on first use, so the command-line tools start (and the
converter installs its signal handlers) before MLX and transformers load.
"""

import importlib
import os
import sys
import types
import warnings

__version__ = "0.1.0"

# `python -m mlx_mtp.generate` runs the module that this package also imports
# for its `generate` function; runpy's warning about that is harmless.
warnings.filterwarnings("ignore", message=r"'mlx_mtp\.\w+' found in sys.modules", category=RuntimeWarning)

# In a source checkout kernels/ and convert/ sit beside this folder (the layout
# shows the pipeline); an installed wheel puts them inside it (pyproject
# package-dir). Let a plain checkout on sys.path find them too.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "kernels")) and os.path.isfile(
    os.path.join(_root, "kernels", "__init__.py")
):
    __path__.append(_root)  # noqa: F821

_EXPORTS = {"load": "load", "generate": "generate", "generate_step": "generate",
            "stream_generate": "generate", "batch_generate": "generate",
            "make_sampler": "sampling", "make_logits_processors": "sampling",
            "sharded_load": "distributed"}
__all__ = [*_EXPORTS, "__version__"]


def _export(name: str, module: str) -> property:
    def get(self):
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)

    def set(self, value):
        # the import system binds a submodule of the same name (`generate`,
        # `load`) here when it is first imported: the function keeps the name,
        # as it would after `from .generate import generate`
        pass

    return property(get, set)


class _Package(types.ModuleType):
    locals().update({n: _export(n, m) for n, m in _EXPORTS.items()})

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_EXPORTS))


sys.modules[__name__].__class__ = _Package
