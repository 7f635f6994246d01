"""Helpers for tests, examples and benchmarks (multi-rank launch over Gloo, host-read counts;
the benchmarks' MoE model and stand-in kernels, :mod:`.moe`; their command lines,
:mod:`.bench_cli`; the emulated link's model, :mod:`.link_model`), so that the tests import
no benchmark script."""

from dbo_compile.testing.host_reads import HostReads, count_host_reads
from dbo_compile.testing.multirank import run_multirank, run_multirank_each

__all__ = ["HostReads", "count_host_reads", "run_multirank", "run_multirank_each"]
