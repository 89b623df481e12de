"""AFD's own changes to vLLM: the functions the manifests (``manifests/afd/*.yaml``) name by import path.

Each module holds the patch functions of one concern (CLI flags, engine-config checks, outage handling,
compilation, CPU binding, micro-batches, data parallelism, jit warm-up); patchkit applies them as the
manifest says; the AFD workers also call a few of them (micro-batch planning, data-parallel settings).
"""
