"""Manifests: reading YAML with line numbers (``source``), validating against the JSON Schema and the
rules the schema cannot say (``validate``), and choosing and ordering the plan for a vLLM (``select``).

Cold: used when the plan cache misses, and by the review tools and the CLI, never on the hook's warm path.
``load``, ``parse``, ``resolved`` (a file with its ``extends`` chain merged), ``releases`` and
``registered_manifest_dirs`` are the layer's entry points.
"""

from patchkit.manifest.validate import load, parse, registered_manifest_dirs, releases, resolved

__all__ = ["load", "parse", "registered_manifest_dirs", "releases", "resolved"]
