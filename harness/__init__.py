"""What the tests, the demo and the benchmarks share to run a real vLLM; nothing here is a test.

- ``env``: ``REPO``, the one environment of real-vLLM subprocesses (``vllm_env``), ``free_port``.
- ``engine``: the one vLLM driver (``run_engines``, ``generate``, ``start``/``kill``); run as
  ``python -m harness.engine SPEC.json`` from the repository root.
- ``tiny_model``, ``tiny_tokenizer``: random-weight checkpoints and a word-level tokenizer.
- ``construction_bytes``: bytes allocated while vLLM builds a model, per AFD role.
- ``fork_server``: the test session's engines forked from one process that imported vLLM once.
- ``plain_cache``: plain vLLM's results cached by content (checkpoint, release, settings, CPU ISA).
- ``starts``: every vLLM process tree the tests start (engine, API server, front end), counted in one place.
- ``config_probe``: vLLM's front-end config step (``create_engine_config()``) for many cases in one process.
- ``crowd``: 240 loopback addresses connecting at full rate to an AFD port (a test's and a benchmark's).

Not part of the wheel (``pyproject.toml`` ships ``patchkit`` and ``afd_patches`` only); importable
from the repository root, as the tests, ``scripts/demo.py`` and ``python -m benchmarks.NAME`` run.
"""
