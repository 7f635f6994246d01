"""The CUDA-graph runner, where users have imported it so far (``from
dbo_compile.runtime.graphs import CudaGraphRunner``); it lives in
:mod:`dbo_compile.runtime.cudagraph_runner`."""

from dbo_compile.runtime.cudagraph_runner import BucketGraphs, CudaGraphRunner, GraphRunnerError

__all__ = ["BucketGraphs", "CudaGraphRunner", "GraphRunnerError"]
