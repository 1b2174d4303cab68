"""Benchmarks: ``python -m bench`` (the main job) and ``pytest bench --benchmark-only``.

``bench/harness.py`` documents the spec interface; ``bench/specs/<op>.py`` holds one spec per op.
"""
