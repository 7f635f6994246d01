"""Emit one single-threaded Python function that runs a schedule on two streams."""

from dbo_compile.codegen.wrapper import SplitProgram, generate

__all__ = ["SplitProgram", "generate"]
