"""`python -m mlx_mtp.generate` runs the CLI (`cli.py`).

Nothing else lives here, and nothing imports this module: importing it would
bind `mlx_mtp.generate` to the module, hiding the function of that name
(`api.generate`, a lazy export of the package).
"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
