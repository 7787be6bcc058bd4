"""Every stage command README.md shows (`uv run eagle3-train/NN_*.py ...`, `uv run torchrun ...
eagle3-train/04_train.py ...`, the pilot) is accepted by that stage's own parse_args: a flag renamed
or a value refused breaks this test, not the first real run. Commands only, nothing runs: backslash
continuations are joined, `$W` / `$MODEL` / `TARGET` / `WORK` become temporary paths, a command ends
at the shell's `>`, `&`, `|`, `;` or `#`, and `[--flag value]` usage brackets are taken as written
without them. Comment lines (`# ...`) are prose, not commands."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

from eagle3_testkit.fixtures import REPO_ROOT

README = REPO_ROOT / "README.md"
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


def readme_commands(tmp: Path) -> list[tuple[int, str, list[str]]]:
    text = README.read_text()
    subst = {"$MODEL": str(tmp / "model"), "$W": str(tmp / "w"), "TARGET": str(tmp / "model"), "WORK": str(tmp / "w")}
    found = []
    for start, lines in code_blocks(text):
        for n, line in logical_lines(start, lines):
            cmd = stage_command(line, subst)
            if cmd:
                found.append((n, *cmd))
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


def test_every_stage_command_in_the_readme_parses(tmp_path, monkeypatch):
    commands = readme_commands(tmp_path)
    # Relative paths are the user's own (prompts.jsonl, answers.jsonl ...): a stage that checks its
    # input exists at parse time finds an empty one in this temporary working directory.
    monkeypatch.chdir(tmp_path)
    for _, _, args in commands:
        for a in args:
            if re.fullmatch(r"[\w.-]+\.jsonl?", a):
                (tmp_path / a).touch()
    scripts = {s for _, s, _ in commands}
    # the runbook's whole chain is here (a README reorganised without its commands would pass empty)
    assert {"00_plan", "00_preflight", "pilot", "01b_generate_synthetic", "01a_import_text", "01c_tokenize",
            "02_extract_hidden_states", "03_build_vocab_mapping", "04_train", "05_evaluate"} <= scripts, scripts
    text = README.read_text()
    broken = []
    for n, script, args in commands:
        try:
            parser_for(script)(args)
        except SystemExit as e:  # argparse: its message went to stderr; the code says it refused
            broken.append(f"README.md:{n} ({section_of(text, n)}): {script} exits {e.code} on {shlex.join(args)}")
        except Exception as e:  # a config's validation: PipelineError's one line
            broken.append(f"README.md:{n} ({section_of(text, n)}): {script}: {e}")
    assert not broken, "\n".join(broken)
