"""Helpers for tests, examples and benchmarks (multi-rank launch over Gloo)."""

from dbo_compile.testing.multirank import run_multirank

__all__ = ["run_multirank"]
