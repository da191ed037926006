"""``python -m mambatrt.cli``: the ``mambatrt`` command."""

import sys

from . import main

sys.exit(main())
