"""Command-line helpers of the benchmarks: a flag that the chosen mode does not read is
refused, never silently ignored (issue 29: ``bench_moe.py --emulate-ep 8 --comm-sms 24``
ran without the carve-out it was asked for)."""

from __future__ import annotations

import argparse
from typing import Iterable, Sequence

__all__ = ["given_flags", "refuse_unread"]


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The destinations (``args`` attribute names) that ``argv`` sets explicitly, whatever
    the value (a default given on the command line counts): ``argv`` is parsed again into a
    namespace where every destination already holds a marker, which argparse then keeps for
    the flags not given."""
    unset = object()
    dests = vars(parser.parse_args(argv))
    again = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    return {k for k, v in vars(again).items() if v is not unset}


def _dest(flag: str, args: argparse.Namespace) -> str:
    name = flag.lstrip("-").replace("-", "_")
    if name in vars(args):
        return name
    if name.startswith("no_") and name[3:] in vars(args):  # a store_false "--no-X"
        return name[3:]
    raise ValueError(f"{flag}: no such option")


def refuse_unread(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str],
                  unread: Iterable[str], mode: str) -> None:
    """Exit with a usage error (``parser.error``) naming the flags of ``unread`` (as
    written: ``"--no-check"``) that ``argv`` gave (``given``: :func:`given_flags`) but
    ``mode`` does not read.

    Raises:
        ValueError: a flag of ``unread`` is no option of ``args``.
    """
    bad = [flag for flag in unread if _dest(flag, args) in given]
    if bad:
        it = "it" if len(bad) == 1 else "them"
        parser.error(f"{', '.join(bad)}: not read {mode} (the run would ignore {it}); drop "
                     f"{it} or change the mode")
