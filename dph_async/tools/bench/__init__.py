"""Benchmarks: commands, not tests (docs/benchmarks.md)."""
