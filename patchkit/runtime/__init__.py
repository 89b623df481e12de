"""What runs in every vLLM process: the plan cache, import hooks, target resolution, the engine that
applies, rolls back and reverts entries, alias rebinding, reports, and vLLM model/worker registration.

Modules here import only the shared basics (``patchkit.errors``, ``plan``, ``fingerprint``)
and each other; never the manifest loader, the review tools or the CLI (``tests/patchkit/test_layers.py``).
"""
