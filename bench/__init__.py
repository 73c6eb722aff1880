"""Benchmarks: our code measured against llama.cpp's own tools, on the same model and threads.

Run one with ``python -m bench.NAME`` (or ``make bench-NAME``); results land in ``bench/results/``.
"""
