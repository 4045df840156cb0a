"""Benchmarks: `python -m memjax.bench <suite>`; see memjax/bench/harness.py for the harness API."""
