"""check.py's checks: each starts a ``Pair`` of processes, reads their messages and reports one ``CHECK`` line per
verdict (``report``); ``RESULTS`` holds the verdicts for check.py's ``GPU_CHECK PASS``/``FAIL`` line."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from processes import Pair

SLACK_S = 5.0


RESULTS: list[bool] = []


def report(name: str, ok: bool, **fields: Any) -> None:
    RESULTS.append(ok)
    print("CHECK " + json.dumps({"check": name, "ok": ok, **fields}, default=str), flush=True)


def check_same_gpu(opts: dict[str, Any]) -> None:
    """One GPU, NCCL: the handshake refuses; then, forced past it, what NCCL says."""
    nccl = {**opts, "backend": "nccl", "devices": {"ffn": "cuda:0", "attention": "cuda:0"}, "plan": "sizes"}
    pair = Pair(nccl)
    res = pair.wait_for("attention", 90)
    ffn = pair.wait_for("ffn", 30)
    pair.end()
    ok = bool(res and "both use GPU" in res.get("message", "") and ffn and "both use GPU" in ffn.get("message", ""))
    report("same_gpu_refused", ok, attention=res, ffn=ffn)
    pair = Pair({**nccl, "force_distinct": True})
    first = pair.wait_any(["attention", "size"], 60)
    res = first[1] if first else None
    ffn = pair.wait_for("ffn", 10)
    exit_codes = {"ffn": pair.ffn.exitcode, "attention": pair.attn.exitcode}  # None: still running
    pair.end()
    message = (res or {}).get("message", "") + (ffn or {}).get("message", "")
    formed = bool(first and first[0] == "size")
    ok = formed or ("NCCL reported an error" in message)
    report("nccl_same_gpu_forced", ok, group_formed=formed, attention=res, ffn=ffn, exit_codes=exit_codes,
           note="NCCL accepted two ranks on one GPU" if formed else "NCCL refused; see the messages (or the "
                "exit codes, if NCCL's watchdog ended a process first)")


def report_per_size(pair: Pair, opts: dict[str, Any], message: str, check: str) -> bool:
    """One ``check`` line per token count from the attention side's ``message`` results (bitwise equal to
    the local MLP); False, after reporting both processes' state, when one does not come."""
    for tokens in opts["tokens"]:
        res = pair.wait_for(message, 240)
        if res is None:
            report(check, False, tokens=tokens, attention=pair.wait_for("attention", 1), ffn=pair.wait_for("ffn", 1))
            return False
        report(check, res["bitwise_equal"], **res)
    return True


def check_exchange(opts: dict[str, Any]) -> None:
    with Pair({**opts, "plan": "sizes"}) as pair:
        if not report_per_size(pair, opts, "size", "exchange"):
            return
        idle = pair.wait_for("attention-idle", 30)
        time.sleep(1.0)  # the serve thread is now blocked waiting for the idle attention rank
        pair.to_ffn.put("close")
        closed = pair.wait_for("ffn-closed", 60)
        bound = 2.0 + SLACK_S
        ok = bool(idle is not None and closed and not closed["thread_alive"] and closed["close_s"] < bound
                  and closed["thread_s"] < bound)
        report("close_while_blocked", ok, bound_s=bound, **(closed or {}))
        pair.to_attn.put("done")


def check_piecewise(opts: dict[str, Any]) -> None:
    with Pair({**opts, "plan": "piecewise"}) as pair:
        if not report_per_size(pair, opts, "piecewise", "piecewise"):
            return
        pair.wait_for("attention-idle", 30)
        pair.to_attn.put("done")


def ffn_count(pair: Pair, at_least: int) -> int | None:
    """Messages the FFN's serve loop served so far; asked again for up to a second while below ``at_least`` (it
    counts a message after sending its answer, so the last answer can arrive before the count moves)."""
    count = None
    for _ in range(6):
        pair.to_ffn.put("count")
        got = pair.wait_for("ffn-count", 30)
        count = got["batches"] if got else None
        if count is None or count >= at_least:
            return count
        time.sleep(0.2)
    return count


def check_microbatch(opts: dict[str, Any]) -> None:
    with Pair({**opts, "plan": "microbatch"}) as pair:
        served = 0
        for n, streams in opts["variants"]:
            got = pair.wait_any(["microbatch", "attention"], 240)
            if got is None or got[0] != "microbatch":
                report("microbatch", False, micro_batches=n, cuda_streams=streams,
                       attention=got[1] if got else None, ffn=pair.wait_for("ffn", 1))
                return
            res = got[1]
            expected = res["steps"] * res["exchanges_per_step"]
            count = ffn_count(pair, served + expected)
            exchanges = None if count is None else count - served
            served = count or served
            # a difference the kernels make on fewer rows, without AFD, is theirs: then equal to the same split
            equal = res["bitwise_equal_unsplit"] or (res["bitwise_equal_local_same_split"]
                                                     and not res["kernels_row_independent"])
            ok = bool(equal and res["timed_steps_equal"] and exchanges == expected and res["contexts_ok"]
                      and res["schedule_ok"] and res["overlaps"] == 0 and res["threads_distinct"])
            per_step = None if exchanges is None else exchanges / res["steps"]
            report("microbatch", ok, ffn_exchanges_per_step=per_step,
                   nccl_micro_batches_forced=bool(opts.get("force_micro_batches_on_nccl")), **res)
            pair.to_attn.put("next")
        pair.wait_for("attention-idle", 30)
        pair.to_attn.put("done")


def check_idle(opts: dict[str, Any]) -> None:
    with Pair({**opts, "plan": "idle"}) as pair:
        first = pair.wait_for("attention-idle", 120)
        if first is None:
            report("idle_no_watchdog_abort", False, attention=pair.wait_for("attention", 1),
                   ffn=pair.wait_for("ffn", 1))
            return
        time.sleep(opts["idle_s"])
        ffn_alive = pair.ffn.is_alive()
        pair.to_attn.put("go")
        after = pair.wait_for("after-idle", 60)
        report("idle_no_watchdog_abort", bool(ffn_alive and after and after["ok"]), idle_s=opts["idle_s"],
               timeout_s=opts["timeout_s"], ffn_alive=ffn_alive, after=after or pair.wait_for("attention", 1))
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(pair.attn.pid, signal.SIGKILL)
        res = pair.wait_for("ffn", opts["timeout_s"] + 3 * SLACK_S)
        elapsed = (res["at"] - t0) if res else None
        ok = bool(res and "lost attention rank 0" in res.get("message", "") and elapsed is not None
                  and elapsed < opts["timeout_s"] + SLACK_S)
        report("dead_peer_noticed_while_idle", ok, elapsed_s=elapsed, timeout_s=opts["timeout_s"], ffn=res)
