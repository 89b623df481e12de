"""afd_patches' layers, as import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``, ``afd-*``).

Connector layers, lowest first (``afd_patches.connectors``): the contract and the plain data (``base``,
``auth``, beside ``afd_patches.topology`` and ``afd_patches.metrics``); the header, the
transport interface and where sockets are (``wire``, ``transport``, ``arrivals``, ``addresses``); the protocol's
lines and the group's MAC'd store (``handshake``, ``store``); the authenticated session (``session``); the
transports, the host's admission and the store's sealing (``tcp``, ``torch_group``, ``admission``,
``sealing``); what builds on them (``liveness``, ``rendezvous``, ``schedule``, ``spec``); ``formation`` and
``membership``; ``endpoints``; the connector (``torch_dist``). A module may import its own layer or a lower one,
every connector module has a layer, nothing in ``connectors`` imports the workers, the models or the patch
functions, and no package or module of afd_patches imports in a circle (the connector's type-only mention of
``AfdConfig`` aside).
Every import counts, also a lazy one or one under ``TYPE_CHECKING``. tests/patchkit/test_layers.py runs
``lint-imports`` on the tree; this file breaks each afd contract once in a copy and checks it is named.
"""

from __future__ import annotations

from pathlib import Path

from tests.patchkit.test_layers import lint_broken_copy

VIOLATIONS = {
    # a lower connector layer reaching up, lazily
    "afd_patches/connectors/wire.py": "\n\ndef _upward():\n    from afd_patches.connectors import formation\n",
    # the connector reaching a role
    "afd_patches/connectors/auth.py": "\nfrom afd_patches.workers import ffn\n",
    # topology reaching a higher connector layer
    "afd_patches/topology.py": "\nfrom afd_patches.connectors import schedule\n",
    # a connector module without a layer
    "afd_patches/connectors/stray.py": "",
    # a cycle between two packages
    "afd_patches/trace.py": "\nfrom afd_patches.models import microbatch\n",
}


def test_a_violation_of_each_afd_contract_breaks_it(tmp_path: Path) -> None:
    result = lint_broken_copy(tmp_path, VIOLATIONS)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "Contracts: 4 kept, 4 broken." in out, out
    assert "afd_patches.connectors.wire -> afd_patches.connectors.formation" in out, out
    assert "afd_patches.connectors.auth -> afd_patches.workers.ffn" in out, out
    assert "afd_patches.topology -> afd_patches.connectors.schedule" in out, out
    assert "afd_patches.connectors.stray" in out, out
    assert "No cycles are allowed in afd_patches." in out, out
