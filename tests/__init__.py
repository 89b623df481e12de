"""The test suite, a package so that tests, the demo and the benchmarks share ``tests.support``.

Run from the repository root: ``pytest`` (it puts the root on ``sys.path``), ``python -m
tests.support.NAME``, ``python -m benchmarks.NAME``. Layout: ``patchkit/`` (synthetic packages,
the static review), ``afd/`` (config, models, connector and rendezvous between real
processes), ``integration/`` (real vLLM, marker ``vllm``), ``tooling/`` (noxfile), ``support/``.
"""
