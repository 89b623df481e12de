"""afd-plugin: Attention-FFN Disaggregation for vLLM, applied from versioned manifests.

``register_afd`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process it starts (front end, engine core, workers), possibly more than
once; it hands the plugin's manifests to patchkit, which selects the one for the
running vLLM and applies it. It never raises: a problem is logged here and
surfaces as a clear error only in a run that asks for AFD.
"""

from __future__ import annotations

import os
from pathlib import Path

# Strings, not Paths, at import: this module is imported in every vLLM process.
_PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__))
__version__ = "0.1.0"  # the distribution's version (pyproject.toml)
CONFIG_KEY = "afd"  # additional_config[CONFIG_KEY] present <=> AFD is on
PACKAGES = ("afd_patches",)  # the only code afd's manifests may name (patchkit refuses a plan that names more)
# Every AFD logger: a child of vLLM's own "vllm" logger, the one vLLM configures (handler, format, level: INFO by
# default); a logger outside it has no handler in a vLLM process, and its INFO lines are lost.
LOGGER = "vllm.afd"


class AfdConfigError(ValueError):
    """A bad ``additional_config["afd"]`` (or ``--afd-*`` flag); the message names the key.

    Defined here, not in ``afd_patches.config``, so that the modules every vLLM process
    imports can name it without loading the config machinery."""


def _shipped(folder: str, checkout: tuple[str, ...]) -> Path:
    """``folder`` inside the wheel's package, else ``checkout`` relative to the repository."""
    packaged = os.path.join(_PACKAGE_DIR, folder)
    return Path(packaged if os.path.isdir(packaged) else os.path.join(os.path.dirname(_PACKAGE_DIR), *checkout))


def manifest_dir() -> Path:
    """The folder of afd's manifests (inside the wheel, or ``manifests/afd`` in a checkout)."""
    return _shipped("_manifests", ("manifests", "afd"))


def config_schema() -> Path:
    """``afd-config.schema.json`` (inside the wheel, or ``schemas/`` in a checkout)."""
    return _shipped("_schemas", ("schemas",)) / "afd-config.schema.json"


def register_afd() -> None:
    """vLLM general-plugin hook: apply the manifest for the running vLLM (idempotent, never raises).

    vLLM calls general plugins without a ``try``; an exception here would kill
    the server even for runs that never asked for AFD. patchkit already turns
    every expected problem into a logged status; anything else is logged here.
    """
    import logging

    try:
        import patchkit

        patchkit.activate("afd", manifest_dir(), plugin_version=__version__, packages=PACKAGES)
    except Exception:
        logging.getLogger(LOGGER).exception("afd-plugin: the patch plan could not be applied")
