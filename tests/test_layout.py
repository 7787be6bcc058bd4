"""The package's shape, checked: production never imports the test rigs, no import circle, every
stage is a subpackage entered by run(cfg) with its CLI in the package, the numbered scripts are
shims, a CLI parses without importing torch, and scripts/ and tests/ load no stage by file path."""

from __future__ import annotations

import ast
import re
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


# A stage package imports another stage's package only for one of these reasons (what several stages
# share lives in common/: 01b's file names in common/layout.py, the text re-wrap in common/text_answers.py,
# 02's and 04's --dry-run reach 00's planner through common/dry_run.py). Each is a stage running or
# reading what another stage defines; none runs back up (the package graph has no circle).
CROSS_STAGE = {
    ("generate", "tokenize"): "01b --tokenize runs 01c's build with 01c's flags; its capture keeps what 01c keeps",
    ("import_text", "tokenize"): "01a --tokenize runs 01c's build with 01c's flags",
    ("generate", "extract"): "01b --capture-hidden-states writes 02's store with 02's flags, layers and vLLM command",
    ("extract", "tokenize"): "02 reads the tokenized set through its one reader (TrainingSet)",
    ("vocab", "tokenize"): "03 reads the tokenized set through its one reader (TrainingSet)",
    ("train", "extract"): "04 checks the store's aux layers with 02's rule",
    ("train", "vocab"): "04 reads 03's mapping through its reader",
    ("evaluate", "train"): "05 loads 04's export with the draft's own model code",
    ("plan", "extract"): "00 models 02 with 02's layer rule",
    ("plan", "train"): "00 models 04 with 04's epoch and lr rules",
}
# the entry points that drive every stage: they may import any of them
DRIVERS = {"pilot": "the pilot runs every stage on a slice, with their settings, and reads their outputs"}


def package_edges() -> dict[tuple[str, str], set[str]]:
    """(importer's package, imported package) -> the module imports behind it, common/ left out."""
    edges: dict[tuple[str, str], set[str]] = {}
    for name, imported in production_graph().items():
        for other in imported:
            a, b = name.split(".")[1:2], other.split(".")[1:2]
            if a and b and a != b and "common" not in (a[0], b[0]):
                edges.setdefault((a[0], b[0]), set()).add(f"{name} -> {other}")
    return edges


def test_stages_import_each_other_only_for_a_listed_reason():
    edges = package_edges()
    unlisted = {k: sorted(v) for k, v in edges.items() if k not in CROSS_STAGE and k[0] not in DRIVERS}
    assert not unlisted, f"share it through common/, or list the reason in CROSS_STAGE: {unlisted}"
    # the imports that ran back up before: 01b's file names, the text re-wrap, the dry runs' planner
    for gone in (("tokenize", "generate"), ("import_text", "generate"), ("generate", "import_text"),
                 ("extract", "plan"), ("train", "plan")):
        assert gone not in edges, edges[gone]


def test_no_import_runs_back_up_between_packages():
    edges = package_edges()
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    circles = sorted((a, b) for a, b in edges if reaches(b, a, {b}))
    assert not circles, {k: sorted(edges[k]) for k in circles}


def test_the_dry_runs_reach_a_planner_for_their_stage():
    from eagle3_train.common.dry_run import PLANNERS, planner
    from eagle3_train.extract.config import ExtractConfig
    from eagle3_train.train.config import TrainConfig

    assert set(PLANNERS) == {ExtractConfig.stage, TrainConfig.stage}
    assert all(callable(planner(stage)) for stage in PLANNERS)


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


# ----------------------------------------------------------------------------- one way to run a stage

STAGE_SCRIPT = re.compile(r"eagle3-train/(\d\d[a-z]?_\w+|pilot)\.py")
# pyproject's console scripts and `python -m`: other spellings of the same commands
OTHER_SPELLINGS = re.compile(r"(?<![\w/.-])eagle3-(preflight|plan|split-prompts|import-text|generate|tokenize|"
                             r"extract|vocab|"
                             r"train|evaluate|pilot)(?![\w/.-])|python3? -m eagle3_train|python3? eagle3-train/")
UV_RUN = re.compile(r"uv run (torchrun( --?[\w-]+(=\S+| [\w$.-]+)?)* )?$")


def invocation_problems(text: str, code_lines: list[str]) -> list[str]:
    """Each stage command in `code_lines` as `uv run eagle3-train/NN_name.py` (torchrun: `uv run
    torchrun ... eagle3-train/...`); no console script, `python -m` or `python eagle3-train/` in `text`."""
    bad = [m.group(0) for m in OTHER_SPELLINGS.finditer(text)]
    for line in code_lines:
        for m in STAGE_SCRIPT.finditer(line):
            if not UV_RUN.search(line[:m.start()]):
                bad.append(line.strip())
    return bad


def docstring_code(doc: str) -> list[str]:
    return [line for line in doc.splitlines() if line.startswith(" ")]


def markdown_code(md: str) -> list[str]:
    out, fenced = [], False
    for line in md.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            out.append(line)
    return out


def test_every_example_runs_a_stage_as_uv_run():
    problems = {}
    for cli in sorted(PKG.glob("*/cli.py")):
        doc = ast.get_docstring(ast.parse(cli.read_text())) or ""
        problems[str(cli.relative_to(REPO))] = invocation_problems(doc, docstring_code(doc))
    stages_md = (REPO / "docs" / "stages.md").read_text()
    problems["docs/stages.md"] = invocation_problems(stages_md, markdown_code(stages_md))
    assert not {k: v for k, v in problems.items() if v}, problems


@pytest.mark.parametrize("line,ok", [
    ("    uv run eagle3-train/04_train.py --out x", True),
    ("    uv run torchrun --nproc-per-node 8 eagle3-train/04_train.py ...", True),
    ("    uv run torchrun --nnodes 2 --node-rank R --master-addr HOST eagle3-train/04_train.py", True),
    ("    python eagle3-train/04_train.py --out x", False),
    ("    torchrun --nproc-per-node 8 eagle3-train/04_train.py ...", False),
    ("    eagle3-train/01c_tokenize.py --raw-dir x", False),
    ("    uv run python eagle3-train/01c_tokenize.py --raw-dir x", False),
    ("    eagle3-pilot --screen-only W/gen", False),
    ("    uv run python -m eagle3_train.train.cli", False),
])
def test_the_invocation_check_tells_the_spellings_apart(line, ok):
    assert (invocation_problems(line, [line]) == []) is ok
