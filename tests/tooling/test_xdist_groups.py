"""harness.xdist_groups in a real pytest-xdist run: modules that declare one XDIST_GROUP share a worker."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from harness.env import REPO
from harness.xdist_groups import declared

GROUPED = [f"test_g{i}.py" for i in range(4)]
ALONE = [f"test_a{i}.py" for i in range(4)]


def test_grouped_modules_run_on_one_worker_and_the_other_worker_is_not_idle(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from harness.xdist_groups import make_scheduler as pytest_xdist_make_scheduler  # noqa: F401\n")
    where = tmp_path / "where.txt"
    for name in GROUPED + ALONE:
        group = 'XDIST_GROUP = "shared"\n' if name in GROUPED else ""
        body = f"open({str(where)!r}, 'a').write({name!r} + ' ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')"
        (tmp_path / name).write_text(f"import os\n{group}\ndef test_where():\n    {body}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadfile", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in where.read_text().splitlines():
        name, worker = line.split()
        workers["grouped" if name in GROUPED else "alone"].add(worker)
    assert len(workers["grouped"]) == 1, workers  # plain loadfile would spread four files over both workers
    # The others go wherever a worker is free (the one without the group may run them all), so only "the other
    # worker ran something" is certain: xdist hands the group, its largest unit, to one worker, the next to the other.
    assert workers["alone"] - workers["grouped"], workers


def test_declared_reads_a_literal_without_importing(tmp_path: Path) -> None:
    module = tmp_path / "test_m.py"
    module.write_text('raise SystemExit("imported")\nENGINE_BUDGET = 7\nXDIST_GROUP = "g"\n')
    assert declared(module, "ENGINE_BUDGET", 0) == 7 and declared(module, "XDIST_GROUP", None) == "g"
    assert declared(module, "MISSING", "d") == "d" and declared(tmp_path / "nope.py", "ENGINE_BUDGET", 0) == 0


def test_every_test_module_declares_its_group_and_budget_as_literals() -> None:
    """The controller reads ``XDIST_GROUP`` and ``ENGINE_BUDGET`` from the sources (``declared``); an expression
    there (``5 + 4``) once ended a whole session's summary with a traceback and exit 1, no test named."""
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        for name in ("XDIST_GROUP", "ENGINE_BUDGET"):
            declared(path, name, None)  # raises naming the file and line


def test_an_expression_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text("import os\nENGINE_BUDGET = 5 + 4\n")
    try:
        declared(module, "ENGINE_BUDGET", 0)
    except ValueError as e:
        assert f"{module}:2: ENGINE_BUDGET must be a literal" in str(e) and "5 + 4" in str(e)
    else:
        raise AssertionError("an expression was read as a literal")
