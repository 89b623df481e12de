"""``python -m patchkit.cli``: the ``patchkit`` command."""

from patchkit.cli import run

run()
