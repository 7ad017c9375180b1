"""Every name a function in the repository reads from module scope is defined there (or is a builtin).

A cheap guard for what CI cannot run: bench/ and scripts/ only run on a GPU machine, and a helper
lost in a refactor (a ``_graphs`` once dropped from bench/dispatch.py) surfaces there as a NameError after
minutes of device time. ``symtable`` resolves the scopes exactly as the compiler does.
"""
from __future__ import annotations

import builtins
import pathlib
import symtable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIRS = ("bench", "scripts", "train", "tlx_dist", "tlx", "tests")


def _files():
    for d in DIRS:
        yield from sorted((ROOT / d).rglob("*.py"))


def _module_names(top: symtable.SymbolTable) -> set[str]:
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()
            or s.is_namespace()}


def undefined_globals(src: str, filename: str) -> list[tuple[str, str]]:
    """(scope, name) pairs for names read as implicit globals that module scope never binds."""
    top = symtable.symtable(src, filename, "exec")
    if "*" in {s.get_name() for s in top.get_symbols()}:
        return []  # a star import binds names symtable cannot see
    known = _module_names(top) | set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__",
                                                       "__builtins__", "__loader__", "__package__"}
    bad = []

    def walk(t: symtable.SymbolTable, path: str):
        for s in t.get_symbols():
            free_read = s.is_global() if t is not top else not (s.is_assigned() or s.is_imported())
            if s.is_referenced() and free_read and s.get_name() not in known:
                bad.append((path, s.get_name()))
        for c in t.get_children():
            walk(c, f"{path}.{c.get_name()}")

    walk(top, "<module>")
    return sorted(set(bad))


def test_checker_finds_a_missing_helper():
    src = "import os\n\ndef f():\n    return os.sep, _gone(1)\n\ndef g(x):\n    return [len(y) for y in x]\n"
    assert undefined_globals(src, "x.py") == [("<module>.f", "_gone")]
    assert undefined_globals("def f():\n    return h()\n\ndef h():\n    return 1\n", "y.py") == []


@pytest.mark.parametrize("path", list(_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_undefined_module_names(path):
    bad = undefined_globals(path.read_text(), str(path))
    assert not bad, f"{path.relative_to(ROOT)} reads names nothing defines: {bad}"
