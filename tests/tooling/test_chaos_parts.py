"""The chaos benchmark's parts that need no vLLM: how samples are judged against requests, the goals, and that the
namespace lab removes all it made (root needed for that one: it fails, never skips, without)."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

from benchmarks.chaos import Phase, figures, met
from benchmarks.chaos_load import Outcome, Sample, gauge_judgement, truth
from benchmarks.netns import NETNS_ETC, Lab


def _outcomes() -> list[Outcome]:
    """Server ``a``: exact answers until 10 s, failures named from 10 s to 14 s, exact again from 15 s."""
    out = [Outcome("a", t - 1.0, t, "exact") for t in (8.0, 9.0, 10.0)]
    out += [Outcome("a", t - 0.1, t, "named", "AFD ...") for t in (11.0, 12.0, 13.0, 14.0)]
    out += [Outcome("a", t - 1.0, t, "exact") for t in (15.5, 16.5)]
    return out


def test_truth_follows_the_requests_near_a_sample() -> None:
    outcomes = _outcomes()
    assert truth(outcomes, "a", 8.5) is True
    assert truth(outcomes, "a", 12.5) is False
    assert truth(outcomes, "a", 30.0) is None  # nothing near: unknown
    assert truth(outcomes, "b", 8.5) is None  # another server's requests say nothing


def test_a_gauge_that_stays_up_through_failures_is_wrong_for_that_long() -> None:
    outcomes = _outcomes()
    samples = [Sample(8.0 + 0.5 * i, "a", 1.0, False, True) for i in range(18)]  # 8.0 .. 16.5, always up
    longest, stale = gauge_judgement(samples, outcomes, 0.0, 100.0)
    assert 2.5 <= longest <= 4.0 and stale == 0.0
    right = [Sample(s.t, "a", 0.0 if 11.0 <= s.t <= 14.5 else 1.0, False, True) for s in samples]
    assert gauge_judgement(right, outcomes, 0.0, 100.0)[0] == 0.0


def test_a_held_step_that_answers_nothing_for_a_while_is_no_contradiction() -> None:
    """A step held 26 s (hold_s): the gauge is 0 while no request ends; nothing contradicts it, and the half
    second around each end (a request answered just before the loss, the gauge up again after the re-formation)
    does not stretch over the silence."""
    outcomes = [Outcome("a", t - 1.0, t, "exact") for t in (8.0, 9.0, 9.8)]
    outcomes += [Outcome("a", 9.5, 36.2, "exact"), Outcome("a", 36.0, 37.0, "exact")]
    samples = [Sample(8.0 + 0.5 * i, "a", 0.0 if 10.0 <= 8.0 + 0.5 * i <= 36.5 else 1.0, False, True)
               for i in range(62)]
    longest, _ = gauge_judgement(samples, outcomes, 0.0, 100.0)
    assert longest <= 1.5, longest


def test_stale_and_unreachable_samples_are_not_judged() -> None:
    outcomes = _outcomes()
    samples = [Sample(11.0 + 0.5 * i, "a", None, True, True) for i in range(6)]
    samples += [Sample(8.0, "a", None, False, False)]  # unreachable (a frozen server): no verdict
    assert gauge_judgement(samples, outcomes, 0.0, 100.0) == (0.0, 3.0)
    absent = [Sample(11.0 + 0.5 * i, "a", None, False, True) for i in range(6)]  # absent, not marked stale
    assert gauge_judgement(absent, outcomes, 0.0, 100.0)[0] > 2.0


def test_goals() -> None:
    good = Phase("x", 0.0, 1.0, 3.9, counts=Counter(exact=5, named=3, cut=2), gauge_wrong_s=2.0)
    assert met(good, 2.0)
    assert not met(Phase("x", 0.0, 1.0, 4.1, counts=Counter(exact=5)), 2.0)  # recovery > 2 x timeout_s
    assert not met(Phase("x", 0.0, 1.0, None, counts=Counter(exact=5)), 2.0)  # never recovered
    assert not met(Phase("x", 0.0, 1.0, 1.0, counts=Counter(exact=5, lost=1)), 2.0)
    assert not met(Phase("x", 0.0, 1.0, 1.0, counts=Counter(exact=5), gauge_wrong_s=2.5), 2.0)


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_the_lab_removes_all_it_made() -> None:
    etc_existed = NETNS_ETC.exists()
    lab = Lab()
    try:
        lab.open()
        address = lab.add("one")
        lab.hosts("one", {"ffn.afd.test": address})
        mount = lab.tmpfs("1m")
        assert lab.ns("one") in _netns() and Path("/proc/mounts").read_text().count(str(mount)) == 1
        seen = subprocess.run(lab.command("one", ["getent", "hosts", "ffn.afd.test"]), capture_output=True,
                              text=True, check=False).stdout
        assert address in seen, seen
    finally:
        lab.close()
    assert lab.ns("one") not in _netns()
    assert str(mount) not in Path("/proc/mounts").read_text() and not mount.exists()
    assert not (NETNS_ETC / lab.ns("one")).exists() and NETNS_ETC.exists() == etc_existed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert lab.tag not in links


def test_a_hold_run_counts_every_failed_request_and_names_the_fault() -> None:
    steady = Phase("steady", 0.0, 1.0, 0.5, counts=Counter(exact=10))
    kill = Phase("kill_ffn", 5.0, 33.0, 0.2, counts=Counter(exact=30, named=2), fault_s=27.7, longest_s=26.1)
    (held,) = [f for f in figures("llama", [steady, kill], 2.0, hold_s=120.0) if f.key == "llama_held_failed"]
    assert held.value == 2 and held.readme == 5 and "kill_ffn 28s" in held.what and "26.1s" in held.detail
    assert not [f for f in figures("llama", [steady, kill], 2.0) if f.key.endswith("held_failed")]
