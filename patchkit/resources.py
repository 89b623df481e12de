"""Where the shipped data lives: ``schemas/`` and ``manifests/``.

In a source checkout (or an editable install) they are the top-level folders of
the repository; in a wheel they are copied into the packages
(``patchkit/_schemas``, ``afd_patches/_manifests``). Both layouts are looked up
here and nowhere else.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).parent


def data_dir(package_dir: Path, packaged_name: str, repo_name: str) -> Path:
    """``package_dir/packaged_name`` when installed from a wheel, else ``<repo>/repo_name``."""
    packaged = package_dir / packaged_name
    if packaged.is_dir():
        return packaged
    return package_dir.parent / repo_name


def schema_path(name: str) -> Path:
    """Path of a shipped JSON Schema, e.g. ``manifest.schema.json``."""
    return data_dir(_PACKAGE_DIR, "_schemas", "schemas") / name
