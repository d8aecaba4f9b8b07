"""Helpers for tests and benchmarks: tiny random-weight models built with transformers' own classes."""
