"""Helpers for tests, examples and benchmarks (multi-rank launch over Gloo, host-read counts)."""

from dbo_compile.testing.host_reads import HostReads, count_host_reads
from dbo_compile.testing.multirank import run_multirank, run_multirank_each

__all__ = ["HostReads", "count_host_reads", "run_multirank", "run_multirank_each"]
