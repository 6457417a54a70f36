"""``python -m kvtc``: the command line (see :mod:`kvtc.cli`)."""

import sys

from .cli import main

sys.exit(main())
