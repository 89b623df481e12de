"""Every AFD feature name afd's Python asks for is one the afd manifests declare (``features:``), and every
declared feature has members: renaming a feature in YAML cannot silently turn a refusal off (``Status.refusal``
also raises for an undeclared name at run time)."""

from __future__ import annotations

from types import SimpleNamespace

from afd_patches.config import parse
from afd_patches.patches import engine_config, micro_batches
from harness.env import REPO
from patchkit import manifest


def _asked_by_python() -> set[str]:
    """The names afd's front end and attention worker ask for (a run asking for everything)."""
    args = SimpleNamespace(data_parallel_size=2, tensor_parallel_size=2)
    cfg = parse({"role": "attention", "connector_extra_config": {"backend": "gloo", "micro_batches": 2}})
    return {engine_config.CORE_FEATURE, *engine_config.features_asked(args, cfg),
            *micro_batches.SPLITTING_FEATURES.values()}


def test_every_feature_afd_asks_for_is_declared_and_has_members():
    for version, m in manifest.releases(REPO / "manifests" / "afd"):
        asked = _asked_by_python() | {f for f in (x.feature for x in m.models) if f}
        assert asked <= set(m.features), (version, sorted(asked - set(m.features)))
        members = {x.feature for x in (*m.entries, *m.requires, *m.models)}
        assert set(m.features) <= members, (version, sorted(set(m.features) - members))
