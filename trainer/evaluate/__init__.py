"""Standalone evaluation of agents on named benchmarks (``copc eval --benchmarks ...``)."""
