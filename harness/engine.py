"""The one vLLM driver of the tests, the demo and the benchmarks: an engine per process.

Every run, plain or AFD, builds ``LLM(**engine_kwargs(spec))``: ``enforce_eager=True`` unless
the spec's ``compiled`` is true (then vLLM's default compilation: on CPU dynamo + inductor),
``max_model_len=256``, ``skip_tokenizer_init=True`` (token-id prompts), the checkpoint's dtype
(``checkpoint_dtype``: float32, bfloat16 for the Gated-DeltaNet hybrids; SPEC ``dtype`` overrides), seed 0, a
64 MiB KV cache, ``max_num_seqs=8``, vLLM's reference CPU MLA backend for a float32 MLA checkpoint (the AMX one
takes bf16 weights only); sampling is greedy (temperature 0, ``ignore_eos``) with
top-``logprobs`` logprobs, reported as vLLM returns them (no rounding).

As a module run in its own process: ``python -m harness.engine SPEC.json`` (``cwd`` the
repository root). SPEC keys: ``mode`` (plain | attention | ffn), ``model``, ``prompts``
(token-id lists), ``max_tokens``, ``logprobs``, ``out`` (result JSON path); for the AFD
roles ``arch`` (the AFD architecture) and ``afd`` (the ``additional_config["afd"]`` mapping);
for a plain run optionally ``additional_config`` and ``hf_overrides`` as given (a run that
asks for AFD the wrong way). Optional: ``compiled`` (default false: eager), ``multiprocessing`` (vLLM's own process
split: front end, engine core, worker; default off: one process; on, the prompts go one request at a time),
``env`` (extra environment variables),
``max_num_batched_tokens`` (vLLM's; small values make mixed prefill/decode steps), ``tensor_parallel_size`` and
``enable_expert_parallel`` (vLLM's; a TP engine's ``collective_rpc`` results list its TP ranks in order),
``ffn_wait_s``, ``ready_flag`` (a file created once the engine is up), ``generate`` (default true; false for an idle
attention rank), ``again_after_s`` (idle that long after generating, then generate the same prompts again into
``again``), ``rounds`` (lists of files: once each list exists, the same prompts again, into ``rounds``),
``generated_flag`` (a file created once the first generation is done), ``done_flag`` (a file created once generation
is done) and ``wait_for`` (files that must exist before this rank closes its connector, e.g. to keep an idle rank up
while a busy one works), ``runner`` (``mrv2``: vLLM's Model Runner V2, run under Triton's interpreter with the
test-only stand-in CPU backend of ``harness.triton_cpu``; default: the runner vLLM picks, V1 on this CPU build),
``afd_manifest_dir`` (a folder of afd manifests the plugin's hook reads instead of the checkout's, e.g. one holding
a retargeted file; one-process engines only, as only this process's ``afd_patches.manifest_dir`` is replaced).
Writes ``{"tokens", "logprobs", "stats", "seconds", "worker_cls", "model_runner"}`` (the kind and class of the
worker's model runner; one-process engines only, ``multiprocessing`` off). Each engine process
runs in ``harness.env.vllm_env`` with
thread binding off (``VLLM_CPU_OMP_THREADS_BIND=nobind``) and ``cwd`` the repository root.

From the tests: ``run_engines(specs, workdir)`` starts one process per spec, in order (FFN
first), each in its own session under a hard time limit, and returns their results or raises
``EngineFailed``; ``generate(model, workdir, ...)`` runs one engine and returns its exit code,
result and output without raising (for runs that are meant to fail); ``start``/``kill`` for
finer control.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import fork_server, plain_cache, starts, triton_cpu
from harness.engine_args import engine_kwargs
from harness.env import vllm_env
from harness.tiny_model import FAMILIES

ARCH = {family: f"AFD{cls}ForCausalLM" for family, (cls, _) in FAMILIES.items()}  # family -> AFD architecture
PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 4], [250, 251, 252, 253, 254, 255, 256, 7]]
ENGINE_TIMEOUT_S = 300.0
# What ``runner: mrv2`` adds to an engine's environment (harness.triton_cpu): MRV2 on, its Triton kernels interpreted.
MRV2_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", triton_cpu.ENV: "1"}

if os.environ.get(triton_cpu.ENV) == "1":  # before vLLM is imported: here, and in the processes vLLM spawns from here
    triton_cpu.install()


class EngineFailed(RuntimeError):
    """An engine process exited non-zero or overran its time limit; carries its log tail."""


Process = fork_server.Process
Engine = tuple[Process, Path, Path]  # (process, its log, its result file)


@dataclass(slots=True, frozen=True)
class Generation:
    """One engine run's exit code, its result (None when it wrote none) and its whole output."""

    returncode: int
    result: dict[str, Any] | None
    output: str


def tail(log: Path, n: int = 4000) -> str:
    """The last ``n`` characters of ``log`` (``"(no log)"`` before the process wrote one)."""
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def start(spec: dict[str, Any], workdir: Path) -> Engine:
    """Start one engine process for ``spec`` in its own session (counted: ``harness.starts``); (process, log,
    result path)."""
    spec_path = workdir / f"spec-{spec['name']}.json"
    spec["out"] = str(workdir / f"out-{spec['name']}.json")
    Path(spec["out"]).unlink(missing_ok=True)
    spec.setdefault("ffn_wait_s", ENGINE_TIMEOUT_S)
    spec_path.write_text(json.dumps(spec))
    log = workdir / f"log-{spec['name']}.txt"
    # No thread binding: engines started side by side would all be bound to the same core, and a
    # one-process engine (the default here) would bind its front end along with its worker.
    runners = {"mrv2": MRV2_ENV, None: {}}
    if spec.get("runner") not in runners:
        raise ValueError(f"unknown runner {spec.get('runner')!r}: mrv2 or none")
    extra = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", **runners[spec.get("runner")], **spec.get("env", {})}
    if not spec.get("multiprocessing", False):
        extra.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    proc = starts.spawn("engine", [sys.executable, "-m", "harness.engine", str(spec_path)], log, vllm_env(**extra),
                        what=f"{spec['mode']} {spec['name']}")
    return proc, log, Path(spec["out"])


def kill(procs: Iterable[Process]) -> None:
    """SIGKILL each still-running process's whole session (one that ends meanwhile is left to its end: a forked
    process's exit code comes over its server's socket, after its session may already be gone)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def group_members(pgid: int) -> list[str]:
    """Live (non-zombie) processes of process group ``pgid``, as ``"pid name status"``; [] when none."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    import psutil  # a vLLM dependency

    members = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(f"{p.pid} {p.info['name']} {p.info['status']}")
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def run_engines(specs: list[dict[str, Any]], workdir: Path, timeout_s: float = ENGINE_TIMEOUT_S,
                stagger_s: float = 0.0) -> list[dict[str, Any]]:
    """Run one engine process per spec (in order, ``stagger_s`` apart); all must finish in ``timeout_s``. Where
    ``harness.plain_cache`` is on, a plain spec's stored result is taken instead of a run (``"cached": true``) and
    a plain run's result is stored."""
    keys = [plain_cache.key(spec) if spec["mode"] == "plain" and plain_cache.enabled() else None for spec in specs]
    cached = [plain_cache.load(spec, k) if k else None for spec, k in zip(specs, keys, strict=True)]
    to_run = [spec for spec, hit in zip(specs, cached, strict=True) if hit is None]
    procs: list[Engine] = []
    try:
        for i, spec in enumerate(to_run):
            procs.append(start(spec, workdir))
            if stagger_s and i + 1 < len(to_run):
                time.sleep(stagger_s)
        deadline = time.monotonic() + timeout_s
        for proc, log, _ in procs:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"engine timed out after {timeout_s}s; log tail:\n{tail(log)}") from None
            if proc.returncode != 0:
                raise EngineFailed(f"engine exited {proc.returncode}; log tail:\n{tail(log)}")
        ran = iter(json.loads(out.read_text()) for _, _, out in procs)
        results = [hit if hit is not None else next(ran) for hit in cached]
    finally:
        kill(proc for proc, _, _ in procs)
    for spec, k, hit, result in zip(specs, keys, cached, results, strict=True):
        if k and hit is None:
            plain_cache.store(spec, result, k)
    return results


def generate(model: Path, workdir: Path, *, name: str = "plain", prompts: list[list[int]] | None = None,
             max_tokens: int = 8, logprobs: int = 5, additional_config: dict[str, Any] | None = None,
             hf_overrides: dict[str, Any] | None = None, multiprocessing: bool = True,
             timeout_s: float = 420.0, **env: str) -> Generation:
    """One plain-mode engine on ``model`` (vLLM's multiprocessing on by default), never raising.

    ``additional_config``/``hf_overrides`` are passed to ``LLM`` as given; ``env`` adds
    environment variables (e.g. ``PATCHKIT_REPORT_DIR``, ``VLLM_PLUGINS=""``). A run past
    ``timeout_s`` is killed and reported with return code -9.
    """
    spec: dict[str, Any] = {"name": name, "mode": "plain", "model": str(model), "prompts": prompts or PROMPTS,
                            "max_tokens": max_tokens, "logprobs": logprobs, "multiprocessing": multiprocessing,
                            "env": env}
    if additional_config is not None:
        spec["additional_config"] = additional_config
    if hf_overrides is not None:
        spec["hf_overrides"] = hf_overrides
    proc, log, out = start(spec, workdir)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass  # killed below: its return code says so
    finally:
        kill([proc])
    result = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
    return Generation(proc.returncode, result, tail(log, 1 << 30))


def _generate(llm: Any, spec: dict[str, Any]) -> tuple[list[list[int]], list[list[dict[str, float]]], list[str]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], logprobs=spec["logprobs"],
                            ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    if spec.get("multiprocessing", False):
        # vLLM's engine core (its own process) may start a step before the last request of a batch reached it,
        # and a step's batch changes float results (logprobs): one request at a time, so every run batches alike
        outs = [out for prompt in prompts for out in llm.generate(prompt, params, use_tqdm=False)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{str(t): lp.logprob for t, lp in sorted(step.items())} for step in o.outputs[0].logprobs or []]
                for o in outs]
    return tokens, logprobs, [str(o.outputs[0].finish_reason) for o in outs]


def _runner_name(worker: Any) -> str:
    """The worker's model runner, ``"v1 (module:Class)"`` or ``"v2 (...)"`` (in the worker, via ``collective_rpc``)."""
    from afd_patches.patches.micro_batches import runner_name

    return runner_name(worker.model_runner)


def _round(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's prompts generated once more: ``tokens``, ``logprobs``, ``finish_reasons``."""
    return dict(zip(("tokens", "logprobs", "finish_reasons"), _generate(llm, spec), strict=True))


def _wait_for_files(paths: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(Path(p).exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all of {paths} appeared")
        time.sleep(0.2)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("afd_manifest_dir"):
        if spec.get("multiprocessing", False):
            raise ValueError("afd_manifest_dir: one-process engines only (a worker process would read the checkout's)")
        import afd_patches

        folder = Path(spec["afd_manifest_dir"])
        afd_patches.manifest_dir = lambda: folder  # register_afd looks it up when vLLM calls the hook
    from vllm import LLM

    from harness.tiny_model import register_configs

    register_configs()
    result: dict[str, Any] = {"seconds": {}}
    t0 = time.monotonic()
    llm = LLM(**engine_kwargs(spec))
    result["seconds"]["start"] = time.monotonic() - t0
    result["worker_cls"] = str(llm.llm_engine.vllm_config.parallel_config.worker_cls)
    if not spec.get("multiprocessing", False):  # a function crosses to a worker process only as a pickle
        result["model_runner"] = llm.collective_rpc(_runner_name)[0]
    if spec.get("ready_flag"):
        Path(spec["ready_flag"]).write_text("ready")
    mode = spec["mode"]
    if mode == "ffn":
        t1 = time.monotonic()
        result["stats"] = llm.collective_rpc("afd_wait", args=(spec.get("ffn_wait_s", 120.0),))
        result["seconds"]["serve"] = time.monotonic() - t1
    else:
        t1 = time.monotonic()
        if spec.get("generate", True):
            result["tokens"], result["logprobs"], result["finish_reasons"] = _generate(llm, spec)
            result["seconds"]["generate"] = time.monotonic() - t1
            if spec.get("generated_flag"):
                Path(spec["generated_flag"]).write_text("done")
            if spec.get("again_after_s"):  # idle, then the same prompts once more
                time.sleep(spec["again_after_s"])
                result["again"] = _round(llm, spec)
            for files in spec.get("rounds", []):  # the same prompts once more as each list of files exists
                _wait_for_files(files, spec.get("ffn_wait_s", 120.0))
                result.setdefault("rounds", []).append(_round(llm, spec))
        if spec.get("done_flag"):
            Path(spec["done_flag"]).write_text("done")
        _wait_for_files(spec.get("wait_for", []), spec.get("ffn_wait_s", 120.0))
        result["seconds"]["until_close"] = time.monotonic() - t1
        if mode == "attention":
            result["stats"] = llm.collective_rpc("afd_stats")
            llm.collective_rpc("afd_close")
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
