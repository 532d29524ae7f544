"""Host bindings (installed as ``mrl_plugins.adapters``): ``mrl_plugins.adapters.trl``."""
