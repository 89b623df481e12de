"""``python -m patchkit.cli``: the ``patchkit`` command."""

import sys

from patchkit.cli import main

sys.exit(main())
