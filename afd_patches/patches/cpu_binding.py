"""Roles on their own cores: a wrapper of vLLM's ``OMPProcessManager.__init__``.

vLLM's CPU executor (in the engine-core process) builds ``OMPProcessManager(vllm_config)``
once, before it starts the workers; the manager reads ``VLLM_CPU_OMP_THREADS_BIND`` there and
each worker is then started with ``OMP_NUM_THREADS``/``OMP_PLACES`` (or the GOMP/IOMP
equivalents) for its CPU list. Under vLLM's default (``auto``) every engine started on its own
binds its worker to the same first core, so the attention and FFN workers of an AFD pair on one
host share one core.

``omp_manager_init`` (wraps ``OMPProcessManager.__init__``) decides, for an engine whose
``additional_config["afd"]`` is set (as the front end stored it, normalized), which CPU lists
its workers get, first match wins:

1. ``cpu_cores`` in the AFD config (vLLM's syntax, checked in the front end);
2. ``VLLM_CPU_OMP_THREADS_BIND`` when set to anything but ``auto`` (``nobind`` included): vLLM's
   own handling, unchanged;
3. when ``host`` is a loopback address (so every engine of the group runs on this host) and the
   engine has no data parallelism: the default share derived from role and rank
   (``afd_patches.cores.derive``) of the CPUs vLLM finds allowed here
   (``cpu_resource_utils.get_allowed_cpu_list``: lscpu's cores and NUMA nodes, filtered by
   ``sched_getaffinity``);
4. otherwise vLLM's ``auto``, unchanged.

In cases 1 and 3 the chosen lists are put in ``VLLM_CPU_OMP_THREADS_BIND`` for the duration of
vLLM's ``__init__`` only (the previous value, or its absence, is restored, also when it raises),
so vLLM's own parser, ``|`` per-worker split and OpenMP settings do the work. One INFO line names
the role, rank, the cores vLLM will bind (read back from the manager) and where they came from.
Engines without AFD run vLLM's ``__init__`` unchanged.

Limits: vLLM reads the variable through ``vllm.envs``, live until the engine core enables its
env cache (after the executor is built); were it cached already, vLLM would bind what it read and
the line says so as a warning. Only the multiprocessing executor builds the manager: a
one-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with the ``uni`` executor) is not
placed. Nothing is placed on platforms other than CPU (vLLM's ``__init__`` returns first there).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from afd_patches import CONFIG_KEY, LOGGER

logger = logging.getLogger(LOGGER)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@contextlib.contextmanager
def _env_set(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block; the previous value (or its absence) after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _allowed_cpus() -> list[Any]:
    """The CPUs this process may run on, as ``afd_patches.cores.Cpu`` (vLLM's lscpu reading; where that fails,
    ``sched_getaffinity`` with every CPU its own core on node 0)."""
    from afd_patches.cores import Cpu

    try:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

        found = [Cpu(c.id, c.physical_core, max(c.numa_node, 0)) for c in get_allowed_cpu_list()]
    except Exception:  # lscpu missing or unreadable: vLLM's auto binding would fail there too
        logger.debug("AFD: vLLM's CPU list is unavailable; using sched_getaffinity", exc_info=True)
        found = []
    return found or [Cpu(i, i) for i in sorted(os.sched_getaffinity(0))]


def choose(afd: Any, vllm_config: Any) -> tuple[str | None, str]:
    """(the ``VLLM_CPU_OMP_THREADS_BIND`` value to build the manager under, or None for vLLM's own reading;
    where the choice came from, in words). ``afd``: this engine's ``AfdConfig``."""
    from afd_patches import cores
    from afd_patches.connectors import auth

    parallel = vllm_config.parallel_config
    if afd.cpu_cores is not None:
        parts = len(cores.parse_core_lists(afd.cpu_cores))
        expected = parallel.local_world_size * max(parallel.data_parallel_size_local, 1)
        if parts != expected:  # vLLM would stop on an assert in the engine core
            from afd_patches import AfdConfigError

            raise AfdConfigError(f'additional_config["afd"]["cpu_cores"]: {afd.cpu_cores!r} has {parts} CPU '
                                 f"list(s) for {expected} worker(s) of this engine; separate one list per worker "
                                 "with '|'")
        return afd.cpu_cores, "cpu_cores of the AFD config"
    env = os.environ.get(BIND_ENV, "auto")
    if env != "auto":
        return None, f"{BIND_ENV}={env}"
    try:
        local = auth.is_loopback(auth.resolve(afd.host))
    except (OSError, UnicodeError):
        local = False
    if not local:
        return None, f"vLLM's {BIND_ENV}=auto: AFD host {afd.host} is not loopback, so the group may span hosts"
    if parallel.data_parallel_size > 1:
        return None, f"vLLM's {BIND_ENV}=auto: the engine is data parallel"
    cpus = _allowed_cpus()
    # A dense model's DP engines are independent (data_parallel_size reset to 1), but vLLM still picks this
    # engine's lists at its local DP rank: give the lists of the attention ranks before it on this node too.
    local = min(int(getattr(parallel, "data_parallel_rank_local", 0) or 0), afd.rank)
    lists = [ids for r in range(afd.rank - local, afd.rank + 1)
             for ids in cores.derive(cpus, afd.role, r, afd.num_attention_ranks, afd.num_ffn_ranks,
                                     workers=parallel.local_world_size)]
    engines = afd.num_attention_ranks + afd.num_ffn_ranks
    return cores.format_core_lists(lists), (
        f"derived: {len(cpus)} allowed CPU(s) shared among the {engines} engines of the "
        f"{afd.num_attention_ranks}A{afd.num_ffn_ranks}F group on this host, FFN ranks first; "
        f"set cpu_cores or {BIND_ENV} to override")


def omp_manager_init(original: Callable[..., Any], manager: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
    """Wrapper of ``OMPProcessManager.__init__(manager, config)``: build it under the CPU lists ``choose``
    picks for an AFD engine and log them (module docstring); vLLM's ``__init__`` itself otherwise."""
    raw = (getattr(config, "additional_config", None) or {}).get(CONFIG_KEY)
    if not isinstance(raw, dict):
        return original(manager, config, *args, **kwargs)
    from afd_patches.config import restore

    afd = restore(raw)  # stored normalized (to_dict) by the front end's validate_afd_config
    if afd.role == "attention":  # under vLLM data parallelism: this engine's rank is its DP rank
        from afd_patches.patches import data_parallel

        afd = data_parallel.attention_config(config, afd)
    mask, source = choose(afd, config)
    if mask is None:
        result = original(manager, config, *args, **kwargs)
    else:
        with _env_set(BIND_ENV, mask):
            result = original(manager, config, *args, **kwargs)
    _report(manager, afd, mask, source)
    return result


def _report(manager: Any, afd: Any, mask: str | None, source: str) -> None:
    """The one INFO line: role, rank, the CPU lists vLLM will bind its workers to, and their source."""
    if not hasattr(manager, "cpu_lists"):  # not the CPU platform: vLLM returned before reading anything
        return
    from afd_patches import cores

    if manager.skip_setup:
        bound = "not bound (nobind)"
    else:
        bound = f"on cores {cores.format_core_lists(manager.cpu_lists)}"
    asked = {cpu for ids in cores.parse_core_lists(mask) for cpu in ids} if mask is not None else set()
    if mask is not None and (manager.skip_setup or not {c for ids in manager.cpu_lists for c in ids} <= asked):
        logger.warning("AFD: %s rank %d: asked vLLM for cores %s (%s) but it binds %s (was %s read before?)",
                       afd.role, afd.rank, mask, source, bound, BIND_ENV)
        return
    logger.info("AFD: %s rank %d worker(s) %s (%s)", afd.role, afd.rank, bound, source)
