"""mrl-plugins."""
