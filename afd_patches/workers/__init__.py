"""AFD role workers: vLLM workers for the attention role and the FFN role.

``cpu`` subclasses vLLM's CPU worker, ``cuda`` its GPU worker; both share the
role behaviour in ``common``. The manifest's ``workers`` section picks the class
by role and platform, and only when the user left ``worker_cls`` at ``auto``.
"""
