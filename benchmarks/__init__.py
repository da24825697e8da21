"""Benchmarks and one-off probes: each module is a script (`python -m benchmarks.NAME`) that
prints ratios against a baseline from the same run with the machine load; figures and
conclusions are recorded in benchmarks/RESULTS.md. The shipped capacity tools (load
generator, planner) live in serving/capacity/.

May import every package; nothing imports it (tests/test_layers.py).
"""
