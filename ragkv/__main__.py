"""`python -m ragkv`: the `ragkv` command."""

import sys

from .entrypoints.cli import main

# Guarded: tensor parallelism's worker processes (spawned) import the main module again.
if __name__ == "__main__":
    sys.exit(main())
