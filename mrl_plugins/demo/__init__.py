"""The demonstration jobs of ``mrl run`` and ``mrl compare`` (and the test suite): models and tokenizers built in
code, no hub (:mod:`~mrl_plugins.demo.models`: presets ``tiny``, ``small``, ``tiny-tools``, ``qwen2-360m``,
``qwen2-tiny``, a count-the-token reward) and the calculator tool task (:mod:`~mrl_plugins.demo.tool_task`). Nothing
in the stages or the TRL adapter uses them: a user's own trainer never touches this package."""
