"""Test package of mrl-plugins (a package so tests can share ``tests.marks`` and ``tests.fakes``)."""
