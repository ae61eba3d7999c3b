"""Benchmarks that report every figure as a fraction of a ceiling measured on the same machine."""
