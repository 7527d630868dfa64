"""Repeatable measurements of meshnode, each against a baseline measured in the same run.

Run ``make bench`` (or ``python -m benchmarks [NAME ...] [--quick]``). Every
benchmark prints a table and writes JSON to ``benchmarks/results/``. Results
are medians over repeated runs, and the figure that matters is the ratio to the
baseline: absolute numbers depend on the (shared, 2-core) machine.
"""
