"""`python -m ragkv`: the `ragkv` command."""

import sys

from .entrypoints.cli import main

sys.exit(main())
