"""afd-plugin: Attention-FFN Disaggregation for vLLM, applied from versioned manifests.

``register_afd`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process it starts (front end, engine core, workers), possibly more than
once; it hands the plugin's manifests to patchkit, which selects the one for the
running vLLM and applies it. It never raises: a problem is logged here and
surfaces as a clear error only in a run that asks for AFD.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_KEY = "afd"  # additional_config[CONFIG_KEY] present <=> AFD is on


def manifest_dir() -> Path:
    """The folder of afd's manifests (inside the wheel, or ``manifests/afd`` in a checkout)."""
    packaged = _PACKAGE_DIR / "_manifests"
    return packaged if packaged.is_dir() else _PACKAGE_DIR.parent / "manifests" / "afd"


def config_schema() -> Path:
    """``afd-config.schema.json`` (inside the wheel, or ``schemas/`` in a checkout)."""
    packaged = _PACKAGE_DIR / "_schemas"
    return (packaged if packaged.is_dir() else _PACKAGE_DIR.parent / "schemas") / "afd-config.schema.json"


def register_afd() -> None:
    """vLLM general-plugin hook: apply the manifest for the running vLLM (idempotent, never raises).

    vLLM calls general plugins without a ``try``; an exception here would kill
    the server even for runs that never asked for AFD. patchkit already turns
    every expected problem into a logged status; anything else is logged here.
    """
    import logging

    try:
        import patchkit

        patchkit.activate("afd", manifest_dir())
    except Exception:
        logging.getLogger("afd_patches").exception("afd-plugin: the patch plan could not be applied")
