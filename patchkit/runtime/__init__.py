"""What runs in every vLLM process: the plan cache, import hooks, target resolution, the engine that
applies, rolls back and reverts entries, alias rebinding, reports, and vLLM model/worker registration.

Modules here import only the shared basics (``patchkit.plan``, ``fingerprint``)
and each other; never the manifest loader, the review tools or the CLI.

Warm-path rules. The plugin hook runs in every vLLM process, where each module it
loads costs more than most of the work it does. So: with a warm plan cache and no
target module imported yet, ``patchkit.activate`` loads only ``patchkit``,
``plan``, ``runtime``, ``runtime.cache``, ``runtime.engine`` and ``runtime.hooks`` (the
post-import callbacks); everything else (``targets``, ``wrappers``, ``scoped``,
``rebind``, ``vllm``, ``fingerprint``, ``report``) is imported inside the function
that first needs it, and nothing imports YAML, JSON Schema or ``packaging``.
The layers are import-linter contracts in ``pyproject.toml`` (``lint-imports``);
``tests/patchkit/test_layers.py`` runs them and asserts this list.
"""
