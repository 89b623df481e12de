"""Review tools for people: ``patchkit check``, ``retarget``, ``diff``, ``docs`` and ``deps``. They read a vLLM
source tree through ``patchkit.static`` (the static tree model the runtime's verdict uses too) and are never
imported by a vLLM process's plugin hook."""
