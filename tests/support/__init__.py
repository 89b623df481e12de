"""Code the tests, the demo and the benchmarks share; nothing here is a test.

- ``env``: ``REPO``, the one environment of real-vLLM subprocesses (``vllm_env``), ``free_port``.
- ``engine``: the one vLLM driver (``run_engines``, ``generate``, ``start``/``kill``).
- ``tiny_model``, ``tiny_tokenizer``: random-weight checkpoints and a word-level tokenizer.
- ``construction_bytes``: bytes allocated while vLLM builds a model, per AFD role.
- ``afd_probe``: hostile clients of the AFD rendezvous; ``drift_injection``: a drifted vLLM copy.
- ``import_scan``: the reference import scan the static review's text scan is compared with.
- ``manifests``: the manifest header synthetic-package tests share.
"""
