"""How ``patchkit check`` prints its result (``patchkit.review.check``'s JSON document) for a terminal (``text``)
and for a pull request (``markdown``). Pure formatting: it reads the document, judges nothing."""

from __future__ import annotations

from typing import Any


def _cached_text(summary: dict[str, Any]) -> str:
    n = summary["cached"]
    return f" ({n} of {summary['entries']} entries unchanged since the last check: from the cache)" if n else ""


def _pin_line(doc: dict[str, Any]) -> str:
    v = doc["vllm"]
    selected = {True: "selects it", False: "does NOT select it", None: "cannot tell (version unknown)"}
    return (f"vLLM {v['version'] or 'unknown version'} from {v['source']}; manifest pin vllm{doc['manifest_vllm']} "
            f"{selected[v['selected_by_manifest']]}")


def _retire_text(retire: dict[str, Any] | None) -> str | None:
    if retire is None:
        return None
    met = {True: "MET: delete this entry", False: "not met", None: "unknown (tree version unknown)"}[retire["met"]]
    return f"retire_when vllm{retire['vllm']}: {met}"


def text(doc: dict[str, Any]) -> str:
    out = [f"patchkit check {doc['manifest']}", _pin_line(doc)]
    if doc["base"]:
        out.append(f"base: vLLM {doc['base']['version'] or 'unknown version'} from {doc['base']['source']}")
    for e in doc["entries"]:
        flag = ("FAIL" if e["fails"] else "feature-off" if e["refuses_feature"]
                else "ok" if e["verdict"] == "ok" else "warn")
        out.append("")
        feature = f", feature {e['feature']}" if e["feature"] else ""
        subject = (f"requires {e['target']} (pin {e['pin']}{feature})" if e["op"] == "require"
                   else f"{e['id']}: {e['target']}")
        out.append(f"[{flag}] {subject} -> {e['verdict']}")
        fp = e["fingerprint"]
        out.append(f"    fingerprint pinned {fp['pinned'] or '-'} found {fp['found'] or '-'}")
        if e["definition"]:
            out.append(f"    at {e['definition']['file']}:{e['definition']['line']}")
        for c in e["candidates"]:
            out.append(f"    candidate: {c}")
        out.extend(f"    note: {n}" for n in e["notes"])
        if e["alias_sites"]:
            out.append(f"    alias sites: {len(e['alias_sites'])} ({e['uncovered_sites']} not covered)")
            for s in e["alias_sites"]:
                mark = "covered  " if s["covered"] else "UNCOVERED"
                out.append(f"      {mark} {s['file']}:{s['line']} {s['kind']} {s['bound']} from {s['source']}"
                           f" - {s['note']}")
        if e["overrides"]:
            out.append(f"    overridden in {len(e['overrides'])} subclasses (a patch of the base never runs there):")
            for o in e["overrides"]:
                sup = "calls super" if o["calls_super"] else "does not call super"
                out.append(f"      {o['ref']} ({o['file']}:{o['line']}, {sup})")
        out.extend(f"    {line}" for line in _call_path_lines(e))
        out.extend(f"    {line}" for line in _signature_lines(e))
        retire = _retire_text(e["retire"])
        if retire:
            out.append(f"    {retire}")
        if e["diff"]:
            out.append("    diff (base -> new):")
            out.extend("      " + line for line in e["diff"].rstrip("\n").split("\n"))
    for p in doc["problems"]:
        out.append(f"problem: {p}")
    s = doc["summary"]
    verdicts = ", ".join(f"{n} {v}" for v, n in sorted(s["verdicts"].items())) or "no entries"
    out.append("")
    out.extend(f"feature {name} refused on this tree (the plugin runs without it): {', '.join(ids)}"
               for name, ids in s["features_refused"].items())
    out.append(f"{s['entries']} entries ({s['requirements']} requirements): {verdicts}; "
               f"{s['uncovered_sites']} uncovered alias sites; {s['unpatched_siblings']} unpatched call-path "
               f"siblings; callables that do not fit: {', '.join(s['misfits']) or 'none'}; "
               f"failing: {', '.join(s['failing']) or 'none'} (exit {doc['exit_code']})")
    out.append(f"parsed {s['parsed']} of {s['modules']} modules in {s['seconds']:.2f} s{_cached_text(s)}")
    return "\n".join(out) + "\n"


def _call_path_lines(e: dict[str, Any]) -> list[str]:
    """The text lines of one entry's call paths: each caller that chooses, and whether the sibling is patched."""
    if not e["call_paths"]:
        return []
    out = [f"call paths: {len(e['call_paths'])} ({e['unpatched_siblings']} to a sibling no entry patches)"]
    for p in e["call_paths"]:
        mark = "patched  " if p["sibling_patched"] else "UNPATCHED"
        out.append(f"  {mark} {p['sibling']} at {p['file']}:{p['line']} in {p['caller']} ({p['kind']}, "
                   f"{p['via']}): sibling when {p['sibling_condition']}; this target when {p['condition']}")
    return out


def _signature_lines(e: dict[str, Any]) -> list[str]:
    """What the text and Markdown outputs say of one entry's callables: one line per callable that
    fits or was not compared; for one that does not fit, where the entry is, both signatures and
    each parameter's problem."""
    out = []
    for f in e["signatures"]:
        if f["fits"]:
            out.append(f"{f['role']} {f['callable']} fits the target")
        elif f["fits"] is None:
            out.append(f"{f['role']} {f['callable']}: {f['note']}")
        else:
            out.append(f"SIGNATURE MISMATCH at {e['source']} (entry {e['id']}): {f['role']} {f['callable']} "
                       "does not accept every call of the target")
            out.append(f"  target:   {f['target_signature']}")
            out.append(f"  callable: {f['callable_signature']}")
            out.extend(f"  {p['parameter']}: {p['message']}" for p in f["problems"])
    return out


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    out = [f"## patchkit check: `{doc['manifest']}`", "", _pin_line(doc) + "", ""]
    if doc["base"]:
        out += [f"Base: vLLM {doc['base']['version'] or 'unknown version'} from `{doc['base']['source']}`", ""]
    out += ["| entry | target | verdict | fails | uncovered aliases | overriding subclasses | unpatched siblings | "
            "retire |", "|---|---|---|---|---|---|---|---|"]
    for e in doc["entries"]:
        retire = _retire_text(e["retire"]) or ""
        fails = "**yes**" if e["fails"] else f"refuses `{e['refuses_feature']}`" if e["refuses_feature"] else "no"
        out.append(f"| `{e['id']}` | `{e['target']}` | {e['verdict']} | {fails} | "
                   f"{e['uncovered_sites']} | {len(e['overrides'])} | {e['unpatched_siblings']} | {_md(retire)} |")
    for e in doc["entries"]:
        out += ["", f"### `{e['id']}` — {e['verdict']}", "",
                f"- target `{e['target']}` (op {e['op']}, on_drift {e['on_drift']}, "
                f"{'required' if e['required'] else 'optional'})",
                f"- fingerprint pinned `{e['fingerprint']['pinned'] or '-'}`, "
                f"found `{e['fingerprint']['found'] or '-'}`"]
        if e["definition"]:
            out.append(f"- defined at `{e['definition']['file']}:{e['definition']['line']}`")
        out += [f"- candidate `{c}`" for c in e["candidates"]]
        out += [f"- note: {_md(n)}" for n in e["notes"]]
        if any(f["fits"] is False for f in e["signatures"]):
            out += ["", "```", *_signature_lines(e), "```"]
        else:
            out += [f"- {_md(line)}" for line in _signature_lines(e)]
        if e["alias_sites"]:
            out += ["", "| site | kind | binds | from | covered | why |", "|---|---|---|---|---|---|"]
            out += [f"| `{_md(a['file'])}:{a['line']}` | {a['kind']} | `{a['bound']}` | `{a['source']}` | "
                    f"{'yes' if a['covered'] else '**no**'} | {_md(a['note'])} |" for a in e["alias_sites"]]
        if e["overrides"]:
            out += ["", "Subclasses that override it (a patch of the base class does not reach them):", ""]
            out += [f"- `{o['ref']}` (`{o['file']}:{o['line']}`, "
                    f"{'calls super' if o['calls_super'] else 'does not call super'})" for o in e["overrides"]]
        if e["call_paths"]:
            out += ["", "| caller | kind | sibling | patched | sibling when | target when |",
                    "|---|---|---|---|---|---|"]
            out += [f"| `{_md(p['caller'])}` (`{_md(p['file'])}:{p['line']}`) | {p['kind']}, {p['via']} | "
                    f"`{p['sibling']}` | {'yes' if p['sibling_patched'] else '**no**'} | "
                    f"`{_md(p['sibling_condition'])}` | `{_md(p['condition'])}` |" for p in e["call_paths"]]
        if e["diff"]:
            out += ["", "```diff", e["diff"].rstrip("\n"), "```"]
    if doc["problems"]:
        out += ["", "Problems:", ""] + [f"- {_md(p)}" for p in doc["problems"]]
    verdicts = ", ".join(f"{n} {v}" for v, n in sorted(s["verdicts"].items())) or "no entries"
    out += ["", f"**{s['entries']} entries** ({s['requirements']} requirements): "
            f"{verdicts}; {s['uncovered_sites']} uncovered alias sites; {s['unpatched_siblings']} unpatched "
            f"call-path siblings; callables that do not fit: "
            f"{', '.join(f'`{f}`' for f in s['misfits']) or 'none'}; failing: "
            f"{', '.join(f'`{f}`' for f in s['failing']) or 'none'} (exit {doc['exit_code']}). "
            f"Parsed {s['parsed']} of {s['modules']} modules in {s['seconds']:.2f} s{_cached_text(s)}."]
    out += [f"Feature `{name}` refused on this tree (the plugin runs without it): "
            f"{', '.join(f'`{i}`' for i in ids)}." for name, ids in s["features_refused"].items()]
    return "\n".join(out) + "\n"
