"""Benchmarks that span stages (``mrl bench engine``); run from the CLI, never imported by a stage."""
