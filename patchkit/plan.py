"""The plan's data (entries, models, the compiled plan), the running vLLM it is judged against,
and the errors of making and applying a plan.

The data classes are what ``patchkit.manifest`` builds from validated YAML and
what ``patchkit.runtime.cache`` stores as JSON, so the plugin hook in every vLLM process
needs this module but not the YAML and JSON Schema machinery, nor
``patchkit.manifest.select`` (choosing and ordering, done when the cache misses).
Guards that can differ between processes of one installation (platform,
environment) are decided here by ``runtime_verdict``; feature probes
(``has_attr``, ``has_param``) need the target in hand and are decided when the
entry is applied.

Errors: every failure a user can cause ends in a ``PatchkitError``. ``ManifestError``
always names a file, a line and a field, and prints as ``file:line: field: message``
so editors and CI annotate the right place; ``PatchError`` names the manifest entry
that failed and why. They live here, with the data, because the hook needs both and
each module on its path costs every vLLM process about 0.1 ms.
"""

from __future__ import annotations

import os
import platform as _platform_module
from collections.abc import Callable
from typing import Any, ClassVar

WORKERS_ENTRY_ID = "workers"
MISSING = object()  # the one sentinel: "no such attribute / nothing was there"


# -- errors --------------------------------------------------------------------------------------

class PatchkitError(Exception):
    """Base of every error patchkit raises on purpose."""


MAX_PROBLEMS = 50


class ManifestError(PatchkitError):
    """A manifest (or a file given as one) is not valid.

    Carries the first ``MAX_PROBLEMS`` problems found (``problems``: ``patchkit.manifest.problems.Problem``,
    each printing as ``file:line: field: message``) and how many more there were (``more``); the message
    says "... and N more problems"."""

    def __init__(self, problems: list[Any], more: int = 0) -> None:
        self.problems = list(problems[:MAX_PROBLEMS])
        self.more = more + max(0, len(problems) - MAX_PROBLEMS)
        tail = [f"... and {self.more} more problems"] if self.more else []
        super().__init__("\n".join([*(str(p) for p in self.problems), *tail]))


class PatchError(PatchkitError):
    """Applying a plan failed; names the entry. Every entry of the run was rolled back."""

    def __init__(self, entry_id: str, reason: str) -> None:
        self.entry_id = entry_id
        self.reason = reason
        super().__init__(f"patch entry {entry_id!r} failed: {reason}")


class UnsupportedRelease(PatchkitError):
    """No manifest supports the running vLLM release."""


# -- records -------------------------------------------------------------------------------------

class Record:
    """An immutable record with named fields, for the data the plugin hook reads in every process.

    ``dataclasses`` would generate these methods with ``exec`` when each class is
    defined, a cost every vLLM process pays; this base needs none. Subclasses list
    their fields, in order, in ``_fields`` (and ``__slots__ = _fields``), and their
    defaults in ``_defaults``. Records off the hook's path are frozen dataclasses."""

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = self._fields
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
        values = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names or key in values:
                raise TypeError(f"{type(self).__name__}: unexpected or repeated argument {key!r}")
            values[key] = value
        for name in names:
            if name in values:
                value = values[name]
            elif name in self._defaults:
                value = self._defaults[name]
            else:
                raise TypeError(f"{type(self).__name__}: missing argument {name!r}")
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _asdict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._asdict() == other._asdict()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(tuple(repr(getattr(self, n)) for n in self._fields))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self._fields)})"


class Entry(Record):
    """One monkey-patch (ops replace / wrap / set), the worker override (op workers), or a
    requirement (op require: a vLLM symbol the plugin relies on, never applied; ``pin`` says
    how much of its fingerprint counts, ``indirect`` that the plugin's code does not name it)."""

    _fields = ("id", "target", "op", "source", "with_", "value", "has_value", "fingerprint", "after", "when",
               "rebind", "on_drift", "required", "why", "upstream", "retire_when", "workers", "pin", "indirect")
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {
        "with_": None, "value": None, "has_value": False, "fingerprint": None, "after": (), "when": {},
        "rebind": "auto", "on_drift": "fail", "required": True, "why": "", "upstream": None, "retire_when": {},
        "workers": None,  # op == "workers": {"role_of": ref, "overrides": [...]}
        "pin": "full", "indirect": False,  # op == "require" only
    }
    id: str
    target: str
    op: str
    source: str  # "file:line" where the entry starts (with extends: the file that introduced it)
    with_: str | None
    value: Any
    has_value: bool
    fingerprint: str | None
    after: tuple[str, ...]
    when: dict[str, Any]
    rebind: str | tuple[str, ...]
    on_drift: str
    required: bool
    why: str
    upstream: str | None
    retire_when: dict[str, Any]
    workers: dict[str, Any] | None
    pin: str
    indirect: bool

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


class ModelRegistration(Record):
    _fields = ("arch", "class_ref", "source", "when")
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {"when": {}}
    arch: str
    class_ref: str
    source: str
    when: dict[str, Any]


class Manifest(Record):
    """One validated manifest. ``requires`` (the vLLM symbols the plugin relies on) is judged only by
    the review tools and ``Status.requirements``, never by the hook, so the plan cache leaves it out:
    a ``Manifest`` read from the cache has ``requires == ()``; ``patchkit.manifest.load(file)`` has them."""

    _fields = ("file", "plugin", "packages", "vllm_version", "vllm_commit", "fallback", "entries", "models",
               "digest", "chain", "requires")
    __slots__ = _fields
    _defaults: ClassVar[dict[str, Any]] = {"requires": ()}
    file: str
    plugin: str
    packages: tuple[str, ...]
    vllm_version: str | None  # None: a base manifest (no ``vllm:``), never selected
    vllm_commit: str | None
    fallback: bool
    entries: tuple[Entry, ...]
    models: tuple[ModelRegistration, ...]
    digest: str  # over the content of every file of ``chain``
    chain: tuple[tuple[str, str], ...]  # (file, sha256 of its content): the extends chain, root base first
    requires: tuple[Entry, ...]  # op "require", in file order

    @property
    def is_base(self) -> bool:
        """A base manifest (no ``vllm:`` pin): other files extend it; it is never selected."""
        return self.vllm_version is None

    def to_json(self) -> dict[str, Any]:
        """The JSON form the plan cache stores: without ``requires`` (see the class docstring)."""
        data = self._asdict()
        del data["requires"]
        data["entries"] = [e._asdict() for e in self.entries]
        data["models"] = [m._asdict() for m in self.models]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        def entry(e: dict[str, Any]) -> Entry:
            e = dict(e)
            e["after"] = tuple(e["after"])
            if isinstance(e["rebind"], list):
                e["rebind"] = tuple(e["rebind"])
            return Entry(**e)

        models = tuple(ModelRegistration(**m) for m in data["models"])
        return cls(**{**data, "packages": tuple(data["packages"]), "entries": tuple(map(entry, data["entries"])),
                      "models": models, "chain": tuple((str(f), str(h)) for f, h in data["chain"])})


class Compiled(Record):
    """What the hook needs: the selected manifest (or why there is none) and the plan order."""

    _fields = ("manifest", "order", "static", "supported", "error", "digest")
    __slots__ = _fields
    manifest: Manifest | None
    order: list[str]  # entry ids
    static: dict[str, str | None]  # entry id (or "model:<arch>") -> why a static guard fails, or None
    supported: str  # the releases the plugin's pinned manifests name, for messages
    error: str | None  # why no manifest was selected
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest.to_json() if self.manifest else None,
            "order": self.order, "static": self.static, "supported": self.supported,
            "error": self.error, "digest": self.digest,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Compiled:
        manifest = Manifest.from_json(data["manifest"]) if data["manifest"] else None
        return cls(manifest, data["order"], data["static"], data["supported"], data["error"], data["digest"])


class Runtime:
    """Facts about the running process that guards and selection look at.

    The platform is probed lazily: only a plan with a platform guard asks for it.
    """

    __slots__ = ("_platform", "platform_probe", "python", "vllm_commit", "vllm_version")

    def __init__(self, vllm_version: str | None, vllm_commit: str | None, python: str | None = None,
                 platform_probe: Callable[[], str | None] | None = None, _platform: str | None = None) -> None:
        self.vllm_version = vllm_version
        self.vllm_commit = vllm_commit
        self.python = python or _platform_module.python_version()
        self.platform_probe = platform_probe
        self._platform = _platform

    def __repr__(self) -> str:
        return f"Runtime(vllm={self.vllm_version}, commit={self.vllm_commit}, python={self.python})"

    @property
    def platform(self) -> str | None:
        if self._platform is None and self.platform_probe is not None:
            self._platform = self.platform_probe()
            self.platform_probe = None
        return self._platform

    @classmethod
    def detect(cls) -> Runtime:
        """Read the running vLLM (imports ``vllm``, which a plugin hook has already done)."""
        try:
            import vllm
        except ImportError:
            return cls(None, None)
        try:
            from vllm import _version as version_module

            commit = getattr(version_module, "__commit_id__", None)
        except ImportError:
            commit = None
        version = getattr(vllm, "__version__", None)
        commit = normalize_commit(commit) if isinstance(commit, str) else None
        return cls(version if isinstance(version, str) else None, commit, platform_probe=_vllm_platform)


def normalize_commit(value: str) -> str | None:
    """``'gced6857af'`` (git-describe style, as CUDA wheels report it) → ``'ced6857af'``;
    None unless 7–40 hex digits remain."""
    text = value.strip().lower()
    if text.startswith("g") and _is_commit(text[1:]):
        text = text[1:]
    return text if _is_commit(text) else None


def _is_commit(text: str) -> bool:
    return 7 <= len(text) <= 40 and all(c in "0123456789abcdef" for c in text)


def _vllm_platform() -> str | None:
    """Name of vLLM's current platform (cpu, cuda, rocm, ...), without forcing new imports early."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type or "").lower() or None
    except Exception:  # noqa: BLE001 - a broken platform probe must not break the process
        return None


def override_key(entry_id: str, index: int) -> str:
    """Where ``Compiled.static`` keeps the static verdict of a workers entry's override ``index``."""
    return f"{entry_id}:{index}"


def runtime_verdict(when: dict[str, Any], runtime: Runtime) -> str | None:
    """Guards that can differ between processes of one installation (platform, env)."""
    if "platform" in when and runtime.platform not in when["platform"]:
        return f"platform {runtime.platform} not in {when['platform']}"
    for name, wanted in when.get("env", {}).items():
        value = os.environ.get(name)
        if value != wanted:
            # Never the variable's value: reasons go into logs and PATCHKIT_REPORT_DIR files.
            found = "unset" if value is None else "set to another value"
            return f"env {name} is {found}, guard wants {'it unset' if wanted is None else repr(wanted)}"
    return None
