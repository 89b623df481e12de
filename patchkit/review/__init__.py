"""Review tools that read a vLLM source tree without importing it: the static tree model
(``review.static``), ``patchkit check``, ``retarget``, ``diff``, ``docs``, ``deps`` and the
requirement verdicts. Never imported by a vLLM process's plugin hook."""
