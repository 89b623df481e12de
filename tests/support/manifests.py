"""The manifest header the synthetic-package tests share.

Each test file declares its throwaway packages (a victim to patch and a plugin package
holding the replacements) through the ``sandbox`` fixture of ``tests/conftest.py``, and
starts its manifests with ``header(plugin, package)``: four lines, format 1, pinned to the
vLLM version the ``runtime`` fixture reports. Entries follow from line 5 on.
"""

from __future__ import annotations

RUNTIME_VERSION = "0.32.0"  # what the ``runtime`` fixture says is running


def header(plugin: str, package: str, version: str = f"=={RUNTIME_VERSION}") -> str:
    """``format``, ``plugin``, ``packages: [package]`` and ``vllm: {version}``, one per line."""
    return f'format: 1\nplugin: {plugin}\npackages: [{package}]\nvllm: {{version: "{version}"}}\n'
