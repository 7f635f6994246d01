"""One group of Gloo ranks for the multi-rank tests of a module (issue 30: the suite's time).

Each multi-rank test used to fork its own ranks, and every rank paid again for its first
compile in a process and for the imports its body needs (transformers: seconds of CPU per
rank). Here the bodies of a module's tests run one after another on one group
(:func:`~dbo_compile.testing.run_multirank_each`: each from a reset Dynamo, an empty artifact
list and the rank's starting RNG state, as alone), launched at the first test that asks, for
the tests of the module that this session selected (``-k`` runs only what it selects). Each
test still gets its own body's results and makes its own assertions; a body that failed fails
its test with its ranks' tracebacks, and the tests whose bodies it kept from running.

Example::

    RANKS = SharedRanks(2, timeout_s=300, calls={
        "test_a[x]": (_body, ("x",)),
        "test_b": (_other_body, (3,)),
    })

    def test_a(request, kind):
        results = RANKS.results(request, _body, kind)   # per-rank results, rank order

Under pytest-xdist a module's tests share a group where they stay on one worker (``--dist
loadfile`` or ``loadscope``); with another distribution each test launches its own body alone
(a worker cannot know which of the module's tests it will be given).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from dbo_compile.backend import reset_artifacts
from dbo_compile.errors import MultirankError
from dbo_compile.testing import run_multirank_each


#: pytest-xdist's ``--dist`` modes that run a module's tests on one worker ("no": no xdist)
_MODULE_ON_ONE_WORKER = ("no", "loadfile", "loadscope")


class SharedRanks:
    """The bodies of one module's multi-rank tests, keyed by test name (``request.node.name``)."""

    def __init__(self, world_size: int, timeout_s: float,
                 calls: dict[str, tuple[Callable[..., Any], Sequence[Any]]]):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.calls = {name: (fn, tuple(args)) for name, (fn, args) in calls.items()}
        self._outcomes: dict[str, list[Any] | MultirankError] = {}

    def results(self, request, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """The per-rank results of ``fn(rank, world_size, *args)`` for the calling test.

        Raises:
            KeyError: the test has no entry in ``calls``, or its entry is not ``(fn, args)``
                (the table and the test disagree).
            MultirankError: the body raised on a rank, hung, or did not run.
        """
        name = request.node.name
        if self.calls.get(name) != (fn, tuple(args)):
            raise KeyError(f"{name}: calls has {self.calls.get(name)!r}, the test runs "
                           f"{(fn, tuple(args))!r}")
        if name not in self._outcomes:
            selected = set()
            if getattr(request.config.option, "dist", "no") in _MODULE_ON_ONE_WORKER:
                selected = {item.name for item in request.session.items
                            if getattr(item, "module", None) is request.module}
            todo = {n: c for n, c in self.calls.items()
                    if (n in selected or n == name) and n not in self._outcomes}
            self._outcomes.update(run_multirank_each(todo, self.world_size, self.timeout_s,
                                                     reset=reset_artifacts))
        out = self._outcomes[name]
        if isinstance(out, MultirankError):
            raise out
        return out
