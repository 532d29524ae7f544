"""``mrl`` command-line tools."""
