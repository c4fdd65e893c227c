"""Benchmarks: our job and its peer in the same run, reported as ratios."""
