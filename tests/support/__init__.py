"""Code only the tests share; nothing here is a test (the vLLM driver and the tiny checkpoints
the demo and benchmarks use too live in ``harness/``).

- ``afd_probe``: hostile clients of the AFD rendezvous; ``drift_injection``: a drifted vLLM copy.
- ``import_scan``: the reference import scan the static review's text scan is compared with.
- ``manifests``: the manifest header synthetic-package tests share.
"""
