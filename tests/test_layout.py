"""The package's shape, checked: production never imports the test rigs, no import circle, every
stage is a subpackage entered by run(cfg) with its CLI in the package, the numbered scripts are
shims, a CLI parses without importing torch, and scripts/ and tests/ load no stage by file path."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, STAGE_PACKAGES

PKG = REPO / "eagle3-train" / "eagle3_train"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every eagle3_* module a file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("eagle3_"):
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("eagle3_"))
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.add("<relative>")
    return out


def production_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in imports_of(p) if m in files and m != name} for name, p in files.items()}


def test_production_never_imports_the_rigs_or_relative_paths():
    for path in PKG.rglob("*.py"):
        found = imports_of(path)
        assert not any(m.startswith("eagle3_testkit") for m in found), path
        assert "<relative>" not in found, f"{path}: absolute imports only (one name per module everywhere)"


def test_no_import_circle():
    graph = production_graph()
    # a package's __init__ is not an edge into its own modules (Python imports it first anyway)
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if nxt == node.rsplit(".", 1)[0]:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if not state.get(nxt):
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if not state.get(name):
            visit(name, [name])


@pytest.mark.parametrize("script,package", sorted(STAGE_PACKAGES.items()))
def test_every_stage_is_a_subpackage_with_run_and_a_cli(script, package):
    pkg = importlib.import_module(f"eagle3_train.{package}")
    assert callable(pkg.run)
    cli = importlib.import_module(f"eagle3_train.{package}.cli")
    assert callable(cli.main) and callable(cli.entry)
    shim = (REPO / "eagle3-train" / f"{script}.py").read_text().splitlines()
    code = [line for line in shim if line.strip() and not line.startswith(("#", '"""'))]
    assert code == [f"from eagle3_train.{package}.cli import entry", "entry()"], script


def test_a_cli_parses_and_validates_without_torch():
    """--help and a bad flag must answer at once, before torch (seconds to import) is loaded."""
    code = ("import sys\n"
            f"for p in {sorted(set(STAGE_PACKAGES.values()))!r}:\n"
            "    __import__(f'eagle3_train.{p}.cli')\n"
            "    __import__(f'eagle3_train.{p}.config')\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_nothing_loads_a_stage_script_by_file_path():
    for root in ("scripts", "tests"):
        for path in (REPO / root).rglob("*.py"):
            text = path.read_text()
            assert "spec_from_file_location" not in text or path.name == "test_layout.py", path
