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
from dataclasses import FrozenInstanceError, dataclass, field, fields
from typing import Any, ClassVar

from patchkit.verdict import Verdict

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


class PlanRefused(PatchError):
    """The verdict on the manifest refuses the plugin (``patchkit.verdict.Verdict.refusal``): nothing was
    applied; the message is the verdict's words, the same in every process."""

    def __init__(self, words: str) -> None:
        self.entry_id, self.reason = "verdict", words
        PatchkitError.__init__(self, words)


class UnsupportedRelease(PatchkitError):
    """No manifest supports the running vLLM release."""


# -- entries -------------------------------------------------------------------------------------
#
class _Record:
    """What the plan's dataclasses share instead of having ``@dataclass`` generate it for each class:
    fields written once (by ``__init__``) and never again, field-wise ``==`` and a ``repr``.

    The same behaviour as ``@dataclass(frozen=True)``'s: assigning or deleting a field of a built
    object raises ``FrozenInstanceError``; objects of one class with equal fields are equal; they are
    not hashable (a frozen dataclass's hash failed on the dict fields anyway). Why not let
    ``@dataclass`` generate these: on CPython 3.11 every generated method is one ``exec`` of about
    0.3 ms, and every vLLM process imports this module in the plugin hook; with only ``__init__``
    generated, defining the classes costs about a third (``benchmarks/hook_cost``).
    """

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, name):
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self))  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)  # type: ignore[arg-type]
        return f"{type(self).__name__}({shown})"


# One typed entry per kind of declaration, all slotted write-once dataclasses (``kw_only``: a field never
# depends on its position). Entries that change vLLM (``Change`` and its subclasses) share one apply
# path in ``patchkit.runtime.targets``: ``Patch`` ``replace``/``set`` put an object in place; every
# other change is a wrap whose factory the entry's kind supplies (``wrap``: the ``with`` callable;
# ``ScopedRebind``: binds names for the call; ``WorkerOverride``: picks the role's worker class).
# ``Requirement`` is never applied, only judged. The plan cache stores them as JSON with ``kind``.

@dataclass(slots=True, kw_only=True, eq=False, repr=False)
class Entry(_Record):
    """What every entry has: an id, a ``module:qualname`` target, where it was declared
    (``source``: ``file:line``, through ``extends``), a pinned fingerprint and the drift policy, and the
    review note of that fingerprint, if any."""

    kind: ClassVar[str] = ""
    id: str
    target: str
    source: str = ""
    fingerprint: str | None = None
    on_drift: str = "fail"
    why: str = ""
    reviewed: str | None = None  # a maintainer's review note (the manifest's ``reviewed``); nothing runs on it
    feature: str | None = None  # the plugin feature this entry belongs to (None: the plugin itself)

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["kind"] = self.kind
        return data


@dataclass(slots=True, kw_only=True, eq=False, repr=False)
class Change(Entry):
    """An entry that changes vLLM: ordered (``after``), guarded (``when``), required or optional,
    rolled back and reverted as one; ``rebind`` is its from-import alias policy."""

    after: tuple[str, ...] = ()
    when: dict[str, Any] = field(default_factory=dict)
    required: bool = True
    rebind: str | tuple[str, ...] = "auto"
    upstream: str | None = None
    retire_when: dict[str, Any] = field(default_factory=dict)
    call_paths: str = "warn"  # patchkit check only: "fail" fails the entry on a call path to an unpatched sibling

    @property
    def op(self) -> str:
        return self.kind

    def refs(self) -> tuple[str, ...]:
        """The ``module:qualname`` objects of the plugin this entry imports (checked against ``packages``)."""
        return ()


@dataclass(slots=True, kw_only=True, eq=False, repr=False)
class Patch(Change):
    """``op`` ``replace`` (the ``with`` object), ``wrap`` (``with`` is the wrapper factory) or ``set``
    (``value``, plain data, or the ``with`` object; ``has_value`` says which)."""

    kind: ClassVar[str] = "patch"
    # a field here, a property on the other changes; field() keeps it required (without it, @dataclass
    # would take the inherited property as its default)
    op: str = field()  # type: ignore[misc]
    with_: str | None = None
    value: Any = None
    has_value: bool = False

    def refs(self) -> tuple[str, ...]:
        return (self.with_,) if self.with_ else ()


@dataclass(slots=True, kw_only=True, eq=False, repr=False)
class ScopedRebind(Change):
    """Op ``scoped-rebind``: a wrap of the target that, for one call and while ``active_if(*args, **kwargs)``
    is true, binds each name of ``bind`` in module ``namespace`` to its replacement (docs/manifests.md)."""

    kind: ClassVar[str] = "scoped-rebind"
    namespace: str
    bind: tuple[tuple[str, str], ...]  # (name in namespace, replacement ref), in file order
    active_if: str

    def refs(self) -> tuple[str, ...]:
        return (self.active_if, *(ref for _, ref in self.bind))


@dataclass(slots=True, kw_only=True, eq=False, repr=False)
class WorkerOverride(Change):
    """The ``workers`` section: a wrap of ``at`` (the target) that picks the role's worker class when the
    user left ``worker_cls`` at ``auto``; ``overrides`` are ``{role, class, when?}`` mappings."""

    kind: ClassVar[str] = "workers"
    role_of: str
    overrides: tuple[dict[str, Any], ...]

    def refs(self) -> tuple[str, ...]:
        return (self.role_of, *(o["class"] for o in self.overrides))


@dataclass(slots=True, kw_only=True, eq=False, repr=False)
class Requirement(Entry):
    """A vLLM symbol the plugin relies on without changing it: never applied; ``pin`` says how much of
    its fingerprint counts, ``indirect`` that the plugin's code does not name it."""

    kind: ClassVar[str] = "require"
    pin: str = "full"
    indirect: bool = False
    required: ClassVar[bool] = True  # judged like a required change by the review tools

    @property
    def op(self) -> str:
        return self.kind


@dataclass(slots=True, kw_only=True, eq=False, repr=False)
class ModelRegistration(_Record):
    """A model architecture registered with vLLM's ``ModelRegistry`` as a ``module:Class`` string."""

    arch: str
    class_ref: str
    source: str = ""
    when: dict[str, Any] = field(default_factory=dict)
    feature: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_CHANGES: dict[str, type[Change]] = {c.kind: c for c in (Patch, ScopedRebind, WorkerOverride)}


def change_from_json(data: dict[str, Any]) -> Change:
    """The inverse of ``Change.to_json`` (TypeError/KeyError/ValueError on a wrong shape)."""
    data = dict(data)
    cls = _CHANGES[data.pop("kind")]
    data["after"] = tuple(data["after"])
    if isinstance(data.get("rebind"), list):
        data["rebind"] = tuple(data["rebind"])
    if cls is ScopedRebind:
        data["bind"] = tuple((str(n), str(r)) for n, r in data["bind"])
    if cls is WorkerOverride:
        data["overrides"] = tuple(data["overrides"])
    return cls(**data)


@dataclass(slots=True, kw_only=True, eq=False, repr=False)
class Manifest(_Record):
    """One validated manifest. ``requires`` (the vLLM symbols the plugin relies on) is judged only by
    the review tools and ``Status.requirements``, never by the hook, so the plan cache leaves it out:
    a ``Manifest`` read from the cache has ``requires == ()``; ``patchkit.manifest.load(file)`` has them."""

    file: str
    plugin: str
    packages: tuple[str, ...]
    vllm_version: str | None  # None: a base manifest (no ``vllm:``), never selected
    vllm_commit: str | None
    fallback: bool
    entries: tuple[Change, ...]
    models: tuple[ModelRegistration, ...]
    digest: str  # over the content of every file of ``chain``
    chain: tuple[tuple[str, str], ...]  # (file, sha256 of its content): the extends chain, root base first
    requires: tuple[Requirement, ...] = ()  # in file order
    features: dict[str, str] = field(default_factory=dict)  # declared feature -> how to run without it
    required_features: tuple[str, ...] = ()  # features whose refusal fails ``patchkit check``

    @property
    def is_base(self) -> bool:
        """A base manifest (no ``vllm:`` pin): other files extend it; it is never selected."""
        return self.vllm_version is None

    def to_json(self) -> dict[str, Any]:
        """The JSON form the plan cache stores: without ``requires`` (see the class docstring)."""
        return {"file": self.file, "plugin": self.plugin, "packages": list(self.packages),
                "vllm_version": self.vllm_version, "vllm_commit": self.vllm_commit, "fallback": self.fallback,
                "entries": [e.to_json() for e in self.entries], "models": [m.to_json() for m in self.models],
                "digest": self.digest, "chain": [list(c) for c in self.chain], "features": dict(self.features),
                "required_features": list(self.required_features)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(**{**data, "packages": tuple(data["packages"]),
                      "entries": tuple(map(change_from_json, data["entries"])),
                      "models": tuple(ModelRegistration(**m) for m in data["models"]),
                      "chain": tuple((str(f), str(h)) for f, h in data["chain"]),
                      "required_features": tuple(data["required_features"])})


@dataclass(slots=True, eq=False, repr=False)
class Compiled(_Record):
    """What the hook needs: the selected manifest (or why there is none), the plan order, and the verdict on
    the manifest against the vLLM tree the process imports (``patchkit.verdict``; None where no tree was
    judged: a runtime without one, as in patchkit's own tests)."""

    manifest: Manifest | None
    order: list[str]  # entry ids
    static: dict[str, str | None]  # entry id (or "model:<arch>") -> why a static guard fails, or None
    supported: str  # the releases the plugin's pinned manifests name, for messages
    error: str | None  # why no manifest was selected
    digest: str
    verdict: Verdict | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest.to_json() if self.manifest else None,
            "order": self.order, "static": self.static, "supported": self.supported,
            "error": self.error, "digest": self.digest,
            "verdict": self.verdict.to_json() if self.verdict else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Compiled:
        manifest = Manifest.from_json(data["manifest"]) if data["manifest"] else None
        verdict = Verdict.from_json(data["verdict"]) if data["verdict"] else None
        return cls(manifest, data["order"], data["static"], data["supported"], data["error"], data["digest"],
                   verdict)


class Runtime:
    """Facts about the running process that guards and selection look at.

    The platform is probed lazily: only a plan with a platform guard asks for it.
    """

    __slots__ = ("_platform", "platform_probe", "python", "tree", "vllm_commit", "vllm_version")

    def __init__(self, vllm_version: str | None, vllm_commit: str | None, python: str | None = None,
                 platform_probe: Callable[[], str | None] | None = None, _platform: str | None = None,
                 tree: str | None = None) -> None:
        self.vllm_version = vllm_version
        self.vllm_commit = vllm_commit
        self.python = python or _platform_module.python_version()
        self.platform_probe = platform_probe
        self._platform = _platform
        self.tree = tree  # the vLLM package folder the verdict judges (part of the plan key); None: no verdict

    def __repr__(self) -> str:
        return f"Runtime(vllm={self.vllm_version}, commit={self.vllm_commit}, python={self.python}, tree={self.tree})"

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
        folder = os.path.dirname(getattr(vllm, "__file__", None) or "") or None  # the one this process imports
        return cls(version if isinstance(version, str) else None, commit, platform_probe=_vllm_platform,
                   tree=folder)


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
