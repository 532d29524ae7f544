"""Bundled YAML configurations (installed as ``mrl_plugins.configs``)."""
