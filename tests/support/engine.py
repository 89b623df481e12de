"""One vLLM engine of an AFD pair (or a plain one), run as its own process — and the helpers to run several.

As a script: ``python scripts/afd_engine.py SPEC.json``. SPEC keys: ``mode``
(plain | attention | ffn), ``model``, ``arch`` (AFD architecture), ``afd`` (the
``additional_config["afd"]`` mapping), ``prompts`` (token-id lists),
``max_tokens``, ``logprobs``, ``out`` (result JSON path), ``ffn_wait_s``;
optional ``multiprocessing`` (vLLM's own process split; default off: one process),
``ready_flag`` (a file created once the engine is up), ``generate``
(default true; false for an idle attention rank), ``done_flag`` (a file created
once generation is done) and ``wait_for`` (files that must exist before this
rank closes its connector, e.g. to keep an idle rank up while a busy one works). Writes ``{"tokens", "logprobs",
"stats", "seconds"}``.

As a module (tests, demo, benchmarks): ``run_engines(specs, workdir)`` starts one
process per spec, FFN first, each in its own session under a hard time limit,
and returns their results; ``start``/``kill`` for finer control.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ARCH = {"llama": "AFDLlamaForCausalLM", "qwen3": "AFDQwen3ForCausalLM", "qwen3_moe": "AFDQwen3MoeForCausalLM",
        "deepseek_v2": "AFDDeepseekV2ForCausalLM"}
ENGINE_TIMEOUT_S = 300.0


class EngineFailed(RuntimeError):
    """An engine process exited non-zero or overran its time limit; carries its log tail."""


Engine = tuple[subprocess.Popen[bytes], Path, Path]  # (process, its log, its result file)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(workdir: Path, multiprocessing: bool = False) -> dict[str, str]:
    """Offline, cache inside ``workdir``; one process per engine unless ``multiprocessing``
    (vLLM's default: front end, engine core and worker processes)."""
    env = dict(os.environ)
    env.update(
        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1", VLLM_CACHE_ROOT=str(workdir / "vllm-cache"), VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    if not multiprocessing:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def tail(log: Path, n: int = 4000) -> str:
    """The last ``n`` characters of ``log`` (``"(no log)"`` before the process wrote one)."""
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def start(spec: dict[str, Any], workdir: Path) -> Engine:
    """Start one engine process for ``spec`` in its own session; (process, log, result path)."""
    spec_path = workdir / f"spec-{spec['name']}.json"
    spec["out"] = str(workdir / f"out-{spec['name']}.json")
    spec.setdefault("ffn_wait_s", ENGINE_TIMEOUT_S)
    spec_path.write_text(json.dumps(spec))
    log = workdir / f"log-{spec['name']}.txt"
    env = engine_env(workdir, spec.get("multiprocessing", False))
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, __file__, str(spec_path)], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, Path(spec["out"])


def kill(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each still-running process's whole session."""
    for proc in procs:
        if proc.poll() is None:
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
    """Run one engine process per spec (in order, ``stagger_s`` apart); all must finish in ``timeout_s``."""
    procs: list[Engine] = []
    try:
        for i, spec in enumerate(specs):
            procs.append(start(spec, workdir))
            if stagger_s and i + 1 < len(specs):
                time.sleep(stagger_s)
        deadline = time.monotonic() + timeout_s
        for proc, log, _ in procs:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"engine timed out after {timeout_s}s; log tail:\n{tail(log)}") from None
            if proc.returncode != 0:
                raise EngineFailed(f"engine exited {proc.returncode}; log tail:\n{tail(log)}")
        return [json.loads(out.read_text()) for _, _, out in procs]
    finally:
        kill(proc for proc, _, _ in procs)


def _engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=8,
    )
    if spec["mode"] != "plain":
        kwargs["hf_overrides"] = {"architectures": [spec["arch"]]}
        kwargs["additional_config"] = {"afd": spec["afd"]}
    return kwargs


def _generate(llm: Any, spec: dict[str, Any]) -> tuple[list[list[int]], list[list[dict[str, float]]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], logprobs=spec["logprobs"],
                            ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM

    result: dict[str, Any] = {"seconds": {}}
    t0 = time.monotonic()
    llm = LLM(**_engine_kwargs(spec))
    result["seconds"]["start"] = time.monotonic() - t0
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
            result["tokens"], result["logprobs"] = _generate(llm, spec)
            result["seconds"]["generate"] = time.monotonic() - t1
        if spec.get("done_flag"):
            Path(spec["done_flag"]).write_text("done")
        deadline = time.monotonic() + spec.get("ffn_wait_s", 120.0)
        while not all(Path(p).exists() for p in spec.get("wait_for", [])):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not all of {spec['wait_for']} appeared")
            time.sleep(0.2)
        result["seconds"]["until_close"] = time.monotonic() - t1
        if mode == "attention":
            result["stats"] = llm.collective_rpc("afd_stats")
            llm.collective_rpc("afd_close")
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
