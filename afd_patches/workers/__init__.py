"""AFD role workers: vLLM workers for the attention role and the FFN role.

``cpu`` subclasses vLLM's CPU worker, ``cuda`` its GPU worker; both put the role mixins first:
``attention`` (``AttentionRoleMixin``) and ``ffn`` (``FfnRoleMixin``), on ``role`` (``RoleBase``, what both
share). ``connection`` builds their connectors, ``regroup`` keeps each side's group across outages and
``tp_group`` makes a TP group one AFD rank. The manifest's ``workers`` section picks the class by role and
platform, and only when the user left ``worker_cls`` at ``auto``.
"""
