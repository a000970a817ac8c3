"""`python -m mlx_mtp.server`: runs `cli.main`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
