"""Benchmarks: heterogeneity emulator, baselines, result tables."""
