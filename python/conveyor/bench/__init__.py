"""Benchmarks: `conveyor bench <name>`."""
