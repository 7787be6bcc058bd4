"""Every stage command the docs show (README.md, docs/runbook.md, docs/stages.md: `uv run
eagle3-train/NN_*.py ...`, `uv run torchrun ... eagle3-train/04_train.py ...`, the pilot) is accepted
by that stage's own parse_args: a flag renamed or a value refused breaks this test, not the first
real run. Commands only, nothing runs (tests/test_runbook.py runs the runbook): backslash
continuations are joined, `$W` / `$MODEL` / `TARGET` / `WORK` become temporary paths, a command ends
at the shell's `>`, `&`, `|`, `;` or `#`, and `[--flag value]` usage brackets are taken as written
without them. Comment lines (`# ...`) are prose, not commands. Also: the docs pass 01b no fixed
concurrency and no `--max-seq-len` (01b steers its concurrency and follows `--max-tokens`), and name
no issue numbers."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

from eagle3_testkit.fixtures import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = [README, REPO_ROOT / "docs" / "runbook.md", REPO_ROOT / "docs" / "stages.md"]
SCRIPT = re.compile(r"^eagle3-train/(\w+)\.py$")
SHIM = re.compile(r"^from (eagle3_train\.\w+\.cli) import entry$", re.M)


def code_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced block and each 4-space indented block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("```")), len(lines))
            blocks.append((i + 2, lines[i + 1:j]))
            i = j + 1
        elif lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            blocks.append((i + 1, lines[i:j]))
            i = j
        else:
            i += 1
    return blocks


def logical_lines(start: int, lines: list[str]) -> list[tuple[int, str]]:
    """Backslash continuations joined; (README line number, command text); comment lines dropped."""
    out, buf, first = [], "", None
    for n, line in enumerate(lines, start):
        if not buf and line.strip().startswith("#"):
            continue
        first = n if not buf else first
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((first, buf + line))
        buf = ""
    return out


def stage_command(line: str, subst: dict[str, str]) -> tuple[str, list[str]] | None:
    """(script name, its arguments) of a `uv run ... eagle3-train/NAME.py ARGS` line, else None."""
    if "uv run" not in line or "eagle3-train/" not in line:
        return None
    line = re.sub(r"\[(?!-)[^\]]*\]", "", line)  # usage prose: [the real run's flags]
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens = list(lex)
    at = next((i for i, t in enumerate(tokens) if SCRIPT.match(t)), None)
    if at is None or "uv" not in tokens[:at]:
        return None
    args = []
    for t in tokens[at + 1:]:
        if set(t) <= set("();<>|&"):  # the shell's: the command ends here
            break
        t = t.strip("[]") if t.startswith("[") or t.endswith("]") else t  # usage brackets
        for k, v in subst.items():  # "$MODEL" before "$W"; TARGET and WORK only as whole words
            t = v if t == k else t.replace(k, v) if k.startswith("$") else t
        args.append(t)
    return SCRIPT.match(tokens[at]).group(1), args


def parser_for(script: str):
    shim = (REPO_ROOT / "eagle3-train" / f"{script}.py").read_text()
    return importlib.import_module(SHIM.search(shim).group(1)).parse_args


def section_of(text: str, line_no: int) -> str:
    """The markdown heading above a line (a bash comment inside a fence is no heading)."""
    head, fenced = "", False
    for ln in text.splitlines()[:line_no]:
        fenced ^= ln.startswith("```")
        if not fenced and re.match(r"#{1,6} ", ln):
            head = ln.lstrip("# ")
    return head


def doc_commands(tmp: Path) -> list[tuple[str, int, str, list[str]]]:
    """(file, line, script, arguments) of every stage command in DOCS' code blocks."""
    subst = {"$MODEL": str(tmp / "model"), "$W": str(tmp / "w"), "TARGET": str(tmp / "model"), "WORK": str(tmp / "w")}
    found = []
    for doc in DOCS:
        for start, lines in code_blocks(doc.read_text()):
            for n, line in logical_lines(start, lines):
                cmd = stage_command(line, subst)
                if cmd:
                    found.append((doc.name, n, *cmd))
    return found


def test_the_extractor_reads_shell_as_the_runbook_writes_it(tmp_path):
    subst = {"$MODEL": "/m", "$W": "/w"}
    line = ("uv run torchrun --nproc-per-node 8 eagle3-train/04_train.py --hidden-states $W/hidden "
            "--target $MODEL --save-every 200 || true   # a comment")
    assert stage_command(line, subst) == ("04_train", ["--hidden-states", "/w/hidden", "--target", "/m",
                                                      "--save-every", "200"])
    assert stage_command("uv run eagle3-train/00_plan.py --target T --json > $W/plan.json", subst) == \
        ("00_plan", ["--target", "T", "--json"])
    assert stage_command("  uv run eagle3-train/02_x.py --a 1 &", subst) == ("02_x", ["--a", "1"])
    assert stage_command("uv run eagle3-train/00_preflight.py --gpus 8 [--plan plan.json]", subst) == \
        ("00_preflight", ["--gpus", "8", "--plan", "plan.json"])
    assert stage_command("uv run python scripts/demo.py --quick", subst) is None
    assert stage_command("vllm serve $MODEL --port 8000 &", subst) is None
    block = ["# 0a. prose with uv run eagle3-train/pilot.py --screen-only x", "uv run eagle3-train/03_v.py --a \\",
             "    --b 2          # then look", "X=1"]
    assert [stage_command(ln, subst) for _, ln in logical_lines(1, block)] == [("03_v", ["--a", "--b", "2"]), None]
    assert logical_lines(10, block)[0][0] == 11  # the command's first line, as README numbers it


def test_every_stage_command_in_the_docs_parses(tmp_path, monkeypatch):
    commands = doc_commands(tmp_path)
    # Relative paths are the user's own (prompts.jsonl, answers.jsonl ...): a stage that checks its
    # input exists at parse time finds an empty one in this temporary working directory.
    monkeypatch.chdir(tmp_path)
    for *_, args in commands:
        for a in args:
            if re.fullmatch(r"[\w.-]+\.jsonl?", a):
                (tmp_path / a).touch()
    # what stages read at parse time: the work directory, and the plan the preflight reads
    for d in (tmp_path / "w", tmp_path / "runs" / "demo"):
        d.mkdir(parents=True, exist_ok=True)
    for plan in (tmp_path / "w" / "plan.json", tmp_path / "plan.json"):
        plan.write_text('{"disk_total": 1.0}')
    commands = [c for c in commands if "..." not in c[3]]  # usage lines: `... --validate`
    scripts = {s for _, _, s, _ in commands}
    # the whole chain is shown (docs reorganised without their commands would pass empty)
    assert {"00_plan", "00_preflight", "01_split_prompts", "pilot", "01b_generate_synthetic", "01a_import_text",
            "01c_tokenize", "02_extract_hidden_states", "03_build_vocab_mapping", "04_train", "05_evaluate",
            "status"} <= scripts, scripts
    assert {s for f, _, s, _ in commands if f == "README.md"} >= {"01_split_prompts", "01b_generate_synthetic",
                                                                    "04_train", "05_evaluate"}
    broken = []
    for doc, n, script, args in commands:
        where = f"{doc}:{n} ({section_of((REPO_ROOT / ('docs/' if doc != 'README.md' else '') / doc).read_text(), n)})"
        try:
            parser_for(script)(args)
        except SystemExit as e:  # argparse: its message went to stderr; the code says it refused
            broken.append(f"{where}: {script} exits {e.code} on {shlex.join(args)}")
        except Exception as e:  # a config's validation: PipelineError's one line
            broken.append(f"{where}: {script}: {e}")
    assert not broken, "\n".join(broken)


def cli_docstrings() -> dict[str, str]:
    """Each stage's --help description: its cli.py's module docstring."""
    pkg = REPO_ROOT / "eagle3-train" / "eagle3_train"
    return {str(p.relative_to(REPO_ROOT)): importlib.import_module(f"eagle3_train.{p.parent.name}.cli").__doc__ or ""
            for p in sorted(pkg.glob("*/cli.py"))}


def generate_lines() -> list[tuple[str, str]]:
    """(where, command) of every 01b or pilot command in the docs' code blocks and the --help texts."""
    found = []
    for doc in [*DOCS, REPO_ROOT / "DESIGN.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for start, lines in code_blocks(doc.read_text()):
            found += [(f"{doc.name}:{n}", ln) for n, ln in logical_lines(start, lines)]
    for path, doc in cli_docstrings().items():
        found += [(path, ln) for _, ln in logical_lines(1, doc.splitlines())]
    return [(w, ln) for w, ln in dict.fromkeys(found)
            if re.search(r"01b_generate_synthetic\.py|eagle3-generate|pilot\.py|eagle3-pilot", ln)]


def test_01b_gets_no_fixed_concurrency_and_no_max_seq_len_in_any_doc():
    """01b steers its concurrency from the server's /metrics (`--concurrency auto`, the default) and
    its --max-seq-len follows --max-tokens: a doc that pins either teaches the old way."""
    lines = generate_lines()
    assert any("01b_generate_synthetic.py" in ln for _, ln in lines)  # the search finds the commands
    bad = [f"{w}: {ln.strip()}" for w, ln in lines
           if re.search(r"--concurrency[= ](?!auto\b)\S+|--max-seq-len\b", ln.split("#")[0])]
    assert not bad, "\n".join(bad)
    assert re.search(r"--concurrency[= ](?!auto)", "x --concurrency 12") and not \
        re.search(r"--concurrency[= ](?!auto\b)\S+", "x --concurrency auto --y")


def test_vllm_serve_lines_leave_room_for_01b():
    """A `vllm serve` for 01b with a small --max-num-seqs would cap 01b's auto concurrency."""
    bad = []
    for doc in [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for start, lines in code_blocks(doc.read_text()):
            for n, ln in logical_lines(start, lines):
                m = re.search(r"max-num-seqs[= ](\d+)", ln)
                command = ln.strip().startswith(("vllm serve", "uv run"))  # not a plan's printed advice
                if command and ("vllm serve" in ln or "pilot.py" in ln) and m and int(m.group(1)) < 64:
                    bad.append(f"{doc.name}:{n}: {ln.strip()}")
    assert not bad, "\n".join(bad)


ISSUE = re.compile(r"\bissues? #?\d+|\(issues?\b|\bissue-\d+", re.I)


def test_no_issue_numbers_in_the_docs():
    """The docs describe the pipeline as it is, not the tracker's history."""
    bad = [f"{p.relative_to(REPO_ROOT)}:{n}: {ln.strip()[:120]}"
           for p in [README, REPO_ROOT / "DESIGN.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
           for n, ln in enumerate(p.read_text().splitlines(), 1) if ISSUE.search(ln)]
    assert not bad, "\n".join(bad)
    assert ISSUE.search("(issue 28)") and ISSUE.search("in issue 13,") and not ISSUE.search("a known issue")


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return "".join(c for c in heading.strip().lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def test_every_link_between_the_docs_lands_on_a_heading():
    """Headings were renamed (tracker numbers dropped); a link to the old anchor would land nowhere."""
    docs = [README, REPO_ROOT / "DESIGN.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    anchors = {p.resolve(): {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", p.read_text(), re.M)}
               for p in docs}
    bad = []
    for p in docs:
        for m in re.finditer(r"\]\(([^)\s]*?\.md)?(?:#([^)\s]+))?\)", p.read_text()):
            target = (p.parent / m.group(1)).resolve() if m.group(1) else p.resolve()
            if m.group(1) and not target.exists():
                bad.append(f"{p.name}: {m.group(0)} (no such file)")
            elif m.group(2) and target in anchors and m.group(2) not in anchors[target]:
                bad.append(f"{p.name}: {m.group(0)} (no such heading)")
    assert not bad, "\n".join(bad)
    assert slug("00 · plan a run (`00_plan.py`)") == "00--plan-a-run-00_planpy"
