"""The package's floors hold (docs/architecture.md): no module imports from a floor above its
own or from another folder of its floor, no function-local import other than of an optional
package, and no module uses another module's private names (``from m import _x``, ``m._x``).

As a script, it lists the violations of any checkout against this tree's floors (e.g. an
older revision: ``git worktree add /tmp/old REV && python tests/test_layers.py /tmp/old``).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLOORS = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "dbo_compile"
#: packages a module may import inside a function, so that the package works without them
OPTIONAL = {"triton", "transformers", "matplotlib", "deep_ep", "deep_gemm"}


def floors() -> dict[str, int]:
    """``group -> floor`` from the ```floors``` block of docs/architecture.md."""
    text = FLOORS.read_text()
    block = re.search(r"```floors\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```floors block"
    out = {}
    for line in block.group(1).strip().splitlines():
        floor, names = line.split(":")
        for name in names.split():
            out[name] = int(floor)
    return out


def only() -> dict[str, set[str]]:
    """``group -> the groups it may import`` from the ```imports-only``` block (``ground``: every
    group of floor 0)."""
    text = FLOORS.read_text()
    block = re.search(r"```imports-only\n(.*?)```", text, re.S)
    ground = {g for g, f in floors().items() if f == 0}
    out = {}
    for line in (block.group(1).strip().splitlines() if block else []):
        group, names = line.split(":")
        allowed = set()
        for name in names.split():
            allowed |= ground if name == "ground" else {name}
        out[group.strip()] = allowed
    return out


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _group(module: str) -> str:
    """The floor table's name of a ``dbo_compile`` module: its folder, or its file."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_package_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (ROOT / rel).is_dir() or (ROOT / rel).with_suffix(".py").is_file()


def imports(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """``(line, imported module, inside a function)`` of every import in ``path``."""
    tree = ast.parse(path.read_text())
    local: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    me = _module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, id(node) in local) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = me.split(".")[: len(me.split(".")) - node.level + (path.name == "__init__.py")]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import submodule` imports the submodule
            subs = [f"{mod}.{a.name}" for a in node.names if _is_package_module(f"{mod}.{a.name}")]
            out += [(node.lineno, m, id(node) in local) for m in (subs or [mod])]
    return out


def private_uses(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, "module._name")`` of each private name of another ``dbo_compile`` module that
    ``path`` imports or reads off a module it imported (dunder names are not private)."""
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    aliases: dict[str, str] = {}  # a local name bound to a package module
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dbo_compile.") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dbo_compile"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _is_package_module(full):
                    aliases[a.asname or a.name] = full
                elif private(a.name) and node.module != me:
                    out.append((node.lineno, full))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in aliases
                and aliases[node.value.id] != me):
            out.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return out


def violations() -> list[str]:
    table = floors()
    restricted = only()
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        group = _group(me)
        if group not in table:
            bad.append(f"{me}: its group {group!r} is on no floor of docs/architecture.md")
            continue
        for line, name in private_uses(path):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {me} uses {name}, a private name of "
                       "another module (make it public where it is defined, or move the code)")
        for line, mod, in_function in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            top = mod.split(".")[0]
            if in_function and top not in OPTIONAL:
                bad.append(f"{where}: function-local import of {mod} (import it at the top; "
                           f"only optional packages {sorted(OPTIONAL)} may be deferred)")
            if top != "dbo_compile" or mod == me:
                continue
            other = _group(mod)
            if other not in table:
                bad.append(f"{where}: {mod} is on no floor of docs/architecture.md")
                continue
            if other == group or table[other] == table[group] == 0:
                continue  # its own folder; the ground floor's files import one another
            if group in restricted and other not in restricted[group]:
                bad.append(f"{where}: {me} ({group}) imports {mod} ({other}): {group} may "
                           f"import only {sorted(restricted[group])}")
                continue
            if table[other] >= table[group]:
                bad.append(f"{where}: {me} (floor {table[group]}, {group}) imports {mod} "
                           f"(floor {table[other]}, {other}): only lower floors may be imported")
    return bad


def test_floors_cover_every_module():
    table = floors()
    groups = {_group(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert groups <= set(table), sorted(groups - set(table))


def test_no_module_imports_from_a_floor_above_it():
    bad = violations()
    assert not bad, "imports against the floors of docs/architecture.md:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, message", [
    ("from dbo_compile.passes.token_dim import annotate_token_dims\n", "only lower floors"),
    ("from dbo_compile.codegen.inductor import InductorStage\n", "only lower floors"),
    ("from dbo_compile.lowering import classify_inputs\n", "only lower floors"),
    ("def f():\n    from dbo_compile.metadata import FIELD_LAYOUT\n", "function-local import"),
])
def test_the_check_finds_an_upward_import(source, message):
    """The check itself can fail: a runtime module importing a compile stage, or a deferred
    import of a package module, is reported."""
    _probe("runtime", source, message)


@pytest.mark.parametrize("source", [
    "from dbo_compile.runtime.engine import _pad_rows\n",
    "from dbo_compile.runtime import engine\nx = engine._pad_rows\n",
    "import dbo_compile.runtime.engine as eng\nx = eng._pad_rows\n",
])
def test_the_check_finds_a_private_name_of_another_module(source):
    _probe("runtime", source, "a private name of another module")


def test_the_check_holds_the_viewer_to_schedule_data():
    _probe("viz", "from dbo_compile.passes.stream_assign import stream_assign\n", "may import only")


def test_the_check_finds_an_op_importing_a_pass():
    _probe("ops", "from dbo_compile.passes.token_dim import annotate_token_dims\n",
           "only lower floors")


def _probe(folder: str, source: str, message: str) -> None:
    probe = PACKAGE / folder / "_layer_probe.py"
    probe.write_text(source)
    try:
        found = [v for v in violations() if "_layer_probe" in v]
    finally:
        probe.unlink()
    assert found and message in found[0], found


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        ROOT = pathlib.Path(sys.argv[1]).resolve()
        PACKAGE = ROOT / "dbo_compile"
    found = violations()
    print("\n".join(found) or "no violations")
    print(f"{len(found)} violations in {PACKAGE}")
    sys.exit(1 if found else 0)
