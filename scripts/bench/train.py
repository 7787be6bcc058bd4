#!/usr/bin/env python3
"""Benchmarks of 04_train on CPU, one subcommand each (`train.py CMD --help`: what it measures, how
to read its ratio, its flags).

  uv run python scripts/bench/train.py speed [--samples 160] [--max-tokens 1024] [--ttt-steps 3] [--rounds 1]
  uv run python scripts/bench/train.py memory [--max-tokens 1024] [--ttt-steps 3] [--samples 64]
  uv run python scripts/bench/train.py group-tokens [--max-tokens 4096] [--groups 0,256,512,1024]
  uv run python scripts/bench/train.py muon --widths 256,512,1024 --threads 1
  uv run python scripts/bench/train.py follow [--samples 96] [--bound-shards 3]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from eagle3_testkit.bench_runs import subcommands, training_inputs, workdir, write_json
from eagle3_testkit.train_memory import compare
from eagle3_train.train.cli import parse_args as train_args
from eagle3_train.train.muon import Muon

# --- speed: ours against speculators' Trainer -------------------------------------------------------------------


def speculators_data(work: Path, hs: Path) -> Path:
    """The same samples in speculators' offline format (eagle3_testkit.speculators_data), fp32, all training."""
    from eagle3_testkit.speculators_data import convert_store

    out = work / "speculators-data"
    convert_store(hs, out, val_fraction=0.0, dtype="float32", progress=False)
    return out


def run_ours(work: Path, hs: Path, vocab: Path, target: Path, args, k: int) -> dict:
    from eagle3_train.train import run
    from eagle3_train.train.metrics import read_metrics

    out = work / f"ours-{k}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["--hidden-states", str(hs), "--vocab-mapping", str(vocab), "--target", str(target), "--out", str(out),
            "--max-tokens-per-batch", str(args.max_tokens), "--ttt-steps", str(args.ttt_steps),
            "--val-fraction", "0", "--epochs", "1", "--save-every", "1000000", "--log-every", "1000000",
            "--lr", "1e-3", "--attn", "sdpa", "--loss-impl", "eager", "--quiet", "--overwrite"]
    run(train_args(argv))
    # One record for the whole epoch: tokens and the loop's wall time, first batch's load included,
    # the final checkpoint/export not (speculators' train_epoch does neither).
    rec = read_metrics(out)["train"][-1]
    seconds = rec["tokens"] / rec["tokens_per_s"]
    return {"tokens": rec["tokens"], "seconds": seconds, "tokens_per_s": rec["tokens_per_s"],
            "tokens_per_cpu_s": rec["tokens"] / rec["cpu_s"], "steps": rec["step"]}


def run_speculators(work: Path, data: Path, hs: Path, vocab: Path, target: Path, args, k: int) -> dict:
    from eagle3_train.train import draft as D
    from eagle3_train.train import draft_core as core
    from eagle3_train.vocab.mapping import read_mapping
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, shift_batch
    from speculators.train import distributed as sdist
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig
    from transformers import AutoConfig

    sdist._local_rank = "cpu"  # its Trainer moves the model and batches to `local_rank`
    cfg = AutoConfig.from_pretrained(target)
    m = read_mapping(vocab)
    d2t, t2d = torch.from_numpy(m.d2t).long(), torch.from_numpy(m.t2d).bool()
    store_cfg = json.loads((hs / "manifest.json").read_text())
    ours = D.build_draft(str(target), cfg, aux_layer_ids=store_cfg["layer_ids"][:-1], d2t=d2t, t2d=t2d,
                         weights=core.load_target_weights(target), attn_impl="sdpa")
    model = Eagle3DraftModel(ours.config)  # speculators' own, with its verifier head for the loss
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    ds = ArrowDataset(max_len=args.max_tokens, datapath=data, on_missing="raise", train_ratio=1.0,
                      split="train", hidden_states_dtype=torch.float32)
    loader = _setup_dataloader(ds, args.max_tokens, cfg.hidden_size, num_workers=0, prefetch_factor=None,
                               preprocess=shift_batch, seed=0)
    kwargs = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": 1.0,
              "loss_config": resolve_loss_config("kl_div", "eager")}
    tc = TrainerConfig(lr=1e-3, num_epochs=1, save_path=str(work / f"spec-{k}"), train_call_kwargs=kwargs,
                       val_call_kwargs=kwargs, hidden_states_dtype=torch.float32, log_freq=10 ** 9,
                       scheduler_type="cosine")
    trainer = Trainer(model, tc, loader, None)
    tokens = sum(n - 1 for n in ds.approx_lengths)
    # Its step timer synchronizes the accelerator on logged steps (every log_freq-th, step 0
    # included), which fails without one; start the count off a logged step.
    trainer.global_step = 1
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train_epoch(0)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_cpu_s": tokens / cpu, "steps": len(loader)}


def speed(args) -> int:
    """Training throughput on CPU: 04_train's loop against speculators' own trainer
    (speculators.train.trainer.Trainer), same data, same draft, same config, same process.

        uv run python scripts/bench/train.py speed [--samples 160] [--max-tokens 1024] [--ttt-steps 3] [--rounds 1]

    Inputs are made by the pipeline itself (tokenize -> 02 hf -> 03) on the tiny trained target
    (assets/tiny-reasoner, else the random tiny Llama). speculators reads the same hidden states from
    its own on-disk format (an Arrow dataset + hs_<i>.safetensors per sample, as its data generation
    writes). Both sides: one epoch over the same samples, 1-layer Llama draft with the target's
    width, sdpa attention, eager forward-KL, fp32, AdamW, packed batches of --max-tokens tokens.
    Reported: real (unpadded) tokens per second of training wall time and per CPU-second of this
    process for each, and the ratios ours / speculators (the CPU-time ratio is the steadier one on a
    shared machine; the wall-time ratio is the goal's).
    """
    from eagle3_testkit.fixtures import TINY_REASONER, random_target_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    target = TINY_REASONER if (TINY_REASONER / "model.safetensors").exists() else random_target_dir("llama")
    results = []
    with workdir(args.workdir, "bench_train-") as work:
        hs, vocab = training_inputs(work, target, args.samples)
        data = speculators_data(work, hs)
        for k in range(args.rounds):
            spec = run_speculators(work, data, hs, vocab, target, args, k)
            ours = run_ours(work, hs, vocab, target, args, k)
            results.append({"ours": ours, "speculators": spec, "ratio": ours["tokens_per_s"] / spec["tokens_per_s"],
                            "cpu_ratio": ours["tokens_per_cpu_s"] / spec["tokens_per_cpu_s"]})
            print(f"round {k}: ours {ours['tokens_per_s']:.0f} tok/s ({ours['tokens']} tokens, "
                  f"{ours['steps']} steps), speculators {spec['tokens_per_s']:.0f} tok/s "
                  f"({spec['tokens']} tokens, {spec['steps']} steps), ratio {results[-1]['ratio']:.2f} "
                  f"(per CPU-second: {results[-1]['cpu_ratio']:.2f})", flush=True)
    ratios = sorted(r["ratio"] for r in results)  # the machine is shared: one round can be unlucky
    cpu_ratios = sorted(r["cpu_ratio"] for r in results)
    summary = {"target": str(target), "samples": args.samples, "max_tokens": args.max_tokens,
               "ttt_steps": args.ttt_steps, "threads": torch.get_num_threads(), "rounds": results,
               "median_ratio": ratios[len(ratios) // 2], "median_cpu_ratio": cpu_ratios[len(cpu_ratios) // 2],
               "goal": ">= 1.0"}
    print(f"training tokens/s, ours / speculators' Trainer: median ratio {summary['median_ratio']:.2f} "
          f"(per CPU-second {summary['median_cpu_ratio']:.2f}) over {args.rounds} round(s) (goal >= 1.0)")
    write_json(args.json, summary)
    return 0


# --- memory: 04's tensors against the planner ---------------------------------------------------------------------


def memory(args) -> int:
    """04's memory on CPU, part by part, against the planner's figure (planner.train_memory).

        uv run python scripts/bench/train.py memory [--max-tokens 1024] [--ttt-steps 3] [--samples 64]

    Builds 04's Trainer on the tiny trained target (tokenized -> 02 fp32 -> 03, as train.py speed
    does) and measures what its tensors hold, part by part (eagle3_testkit.train_memory: weights, grads +
    AdamW states, the target head, activations). Prints each part planned / measured; exits 1 if the
    total is off by more than --tolerance.
    """
    torch.set_num_threads(1)
    from eagle3_testkit.fixtures import tiny_reasoner_dir

    target = tiny_reasoner_dir()
    with tempfile.TemporaryDirectory(prefix="bench_train_memory-") as tmp:
        work = Path(tmp)
        hs, vocab = training_inputs(work, target, args.samples)
        cfg = train_args(["--hidden-states", str(hs), "--vocab-mapping", str(vocab), "--target", str(target),
                          "--out", str(work / "run"), "--max-tokens-per-batch", str(args.max_tokens),
                          "--ttt-steps", str(args.ttt_steps), "--device", "cpu", "--quiet", "--threads", "1"])
        rows, flags = compare(cfg)
    for k, r in rows.items():
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"{k:15s} planned {r['planned'] / 2**20:9.2f} MiB   measured {r['measured'] / 2**20:9.2f} MiB   "
              f"plan/measured {ratio}")
    print(f"batch {flags.max_tokens_per_batch} tokens, TTT {flags.ttt_steps}, attention {flags.attn}, "
          f"draft vocab {flags.draft_vocab_size}, storage {flags.storage}")
    write_json(args.json, {"rows": rows, "flags": vars(flags)})
    return 0 if abs(rows["total"]["ratio"] - 1) <= args.tolerance else 1


# --- group-tokens: grouped forwards against one forward -----------------------------------------------------------


def group_tokens(args) -> int:
    """04's grouped forwards (--group-tokens) with dense attention: training tokens/s of a step's
    forward + backward at several group sizes, as a ratio to one forward over the whole batch, all in
    one process on the same batches.

        uv run python scripts/bench/train.py group-tokens [--hidden-states /work/bench/02
            --vocab-mapping /work/bench/03 --target assets/bench-reasoner] [--max-tokens 4096]
            [--groups 0,256,512,1024] [--steps 4] [--rounds 3]

    Without --hidden-states it builds the tiny trained target's inputs (as train.py speed does). The
    settings take turns within each round, so the machine's drift hits them alike; each one's loss on
    the same batches is printed beside one forward's, which it must equal up to rounding.
    """
    torch.set_num_threads(args.threads)
    groups = [int(g) for g in args.groups.split(",")]
    from eagle3_train.train.dist import setup_dist
    from eagle3_train.train.inputs import open_inputs
    from eagle3_train.train.loop import Trainer

    with tempfile.TemporaryDirectory(prefix="bench_group_tokens-") as tmp:
        work = Path(tmp)
        if args.hidden_states is None:
            from eagle3_testkit.fixtures import tiny_reasoner_dir

            target = tiny_reasoner_dir()
            hs, vocab = training_inputs(work, target, 64)
        else:
            hs, vocab, target = args.hidden_states, args.vocab_mapping, args.target
        cfg = train_args(["--hidden-states", str(hs), "--vocab-mapping", str(vocab), "--target", str(target),
                          "--output-dir", str(work / "run"), "--max-tokens-per-batch", str(args.max_tokens),
                          "--device", "cpu", "--quiet", "--threads", str(args.threads)])
        d = setup_dist("cpu")
        trainer = Trainer(cfg, d, open_inputs(cfg, d.dtype), work / "run")
        batches = [trainer.loader.step(i) for i in range(args.steps)]
        tokens = sum(b.tokens for step in batches for b in step)
        secs = {g: 0.0 for g in groups}
        losses = {g: [] for g in groups}
        trainer.forward_backward(batches[0])  # warm-up, untimed
        for r in range(args.rounds):
            for g in groups:
                trainer.group_tokens = g or None
                t0 = time.perf_counter()
                for step in batches:
                    loss, _ = trainer.forward_backward(step)
                    for o in trainer.optimizers:
                        o.zero_grad(set_to_none=True)
                    if r == 0:
                        losses[g].append(loss)
                secs[g] += time.perf_counter() - t0
    base = groups[0]
    rows = {g: {"tokens_per_s": tokens * args.rounds / secs[g], "ratio": secs[base] / secs[g],
                "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses[g], losses[base], strict=True))}
            for g in groups}
    print(f"{args.steps} steps x {args.rounds} rounds of {args.max_tokens}-token batches ({tokens:,} tokens a "
          f"round), {args.threads} thread(s), TTT {cfg.ttt_steps}")
    for g, r in rows.items():
        print(f"--group-tokens {g:5d}: {r['tokens_per_s']:8.0f} tok/s   x{r['ratio']:.2f} of --group-tokens {base}   "
              f"loss max rel diff {r['max_loss_rel_diff']:.1e}")
    write_json(args.json, rows)
    return 0


# --- muon: bf16 against fp32 orthogonalisation --------------------------------------------------------------------


def draft_matrices(width: int) -> list[torch.nn.Parameter]:
    heads = width // 32
    kv = max(1, heads // 4) * 32
    shapes = [(width, width), (kv, width), (kv, width), (width, width),  # q, k, v, o
              (3 * width, width), (3 * width, width), (width, 3 * width),  # gate, up, down
              (width, 3 * width)]  # fc over three aux layers
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]


def time_step(params, dtype, steps: int) -> float:
    opt = Muon(params, lr=1e-3, adjust_lr_fn="match_rms_adamw", ns_dtype=dtype)
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def muon(args) -> int:
    """Muon's step on this machine with bf16 (torch's) against fp32 orthogonalisation (04's on CPU), on
    the hidden matrices of a one-layer Llama draft of each width (the benchmark draft's proportions:
    MLP 3x wide, 32-wide heads, 4 query heads per key/value head, fc 3x wide in), in one process.

        uv run python scripts/bench/train.py muon --widths 256,512,1024 --threads 1

    Prints seconds per step for each dtype and their ratio (the speed-up of fp32 here).
    """
    torch.set_num_threads(args.threads)
    print("| width | bf16 s/step | fp32 s/step | bf16 / fp32 |\n|---|---|---|---|")
    for w in (int(x) for x in args.widths.split(",")):
        params = draft_matrices(w)
        bf16 = time_step(params, torch.bfloat16, args.steps)
        fp32 = time_step(params, torch.float32, args.steps)
        print(f"| {w} | {bf16:.3f} | {fp32:.3f} | {bf16 / fp32:.1f} |", flush=True)
    return 0


def follow(args) -> int:
    """04 --follow (issue 27): train samples/s of plain 04 and of 04 --follow on a finished store, and of
    04 --follow --consume beside a live 02 (hf, CPU) bound by --max-store-gb at --bound-shards shards;
    the store's high-water mark (shard bytes, sampled every 5 ms) against bound + one shard.

        uv run python scripts/bench/train.py follow --samples 96 --bound-shards 3

    The ratios to read: follow / plain on the finished store (the cost of following: ~1), and the
    high-water mark / (bound + one shard) (must be <= 1). Beside a live producer on the same 2 cores
    the trainer waits on 02, so its samples/s there is the producer's pace, not the trainer's."""
    import os
    import subprocess
    import threading

    from eagle3_testkit.fixtures import REPO_ROOT, random_target_dir
    from eagle3_train.common import hidden_store as hs
    from eagle3_train.train import run

    target = random_target_dir("llama")
    with workdir(args.workdir, "bench-follow-") as work:
        vocab = training_inputs(work / "inputs", target, args.samples)[1]
        data = work / "inputs" / "tokenized"  # what training_inputs tokenized; 02 reruns on it below

        def produce(store: Path, bound: int | None = None):
            cmd = [sys.executable, str(REPO_ROOT / "eagle3-train" / "02_extract_hidden_states.py"), "--input",
                   str(data), "--model", str(target), "--output", str(store), "--backend", "hf", "--device", "cpu",
                   "--storage", "fp32", "--dtype", "float32", "--shard-mb", str(args.shard_mb)]
            cmd += ["--max-store-gb", str(bound / 1e9)] if bound else []
            return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)

        def train(store: Path, out: Path, *extra) -> dict:
            t = time.monotonic()
            man = run(train_args(["--hidden-states", str(store), "--vocab-mapping", str(vocab), "--target",
                                  str(target), "--out", str(out), "--max-tokens-per-batch", "160", "--val-fraction",
                                  "0.1", "--save-every", "1000", "--log-every", "1000", "--threads", "1", "--quiet",
                                  *extra]))
            s = time.monotonic() - t
            return {"s": round(s, 2), "samples": man["counts"]["train_samples"],
                    "samples_per_s": round(man["counts"]["train_samples"] / s, 1)}

        res = {}
        fin = work / "finished"
        t0 = time.monotonic()
        produce(fin).wait()
        res["02_alone_s"] = round(time.monotonic() - t0, 2)
        train(fin, work / "warmup", "--epochs", "1")  # imports and first calls out of the figures
        res["plain_finished"] = train(fin, work / "plain", "--epochs", "1")
        res["follow_finished"] = train(fin, work / "follow-finished", "--follow")
        shard = max(e["bytes"] for e in hs.committed_shards(fin).values())
        bound = args.bound_shards * shard
        live, peak, done = work / "live", [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                if live.is_dir():
                    peak[0] = max(peak[0], hs.store_bytes(live))
                time.sleep(0.005)

        threading.Thread(target=sample, daemon=True).start()
        producer = produce(live, bound)
        res["follow_live_consume"] = train(live, work / "follow-live", "--follow", "--consume")
        producer.wait()
        done.set()
        res |= {"bound_bytes": bound, "shard_bytes": shard, "store_high_water_bytes": peak[0],
                "follow_over_plain": round(res["follow_finished"]["samples_per_s"]
                                           / res["plain_finished"]["samples_per_s"], 2),
                "high_water_over_bound_plus_shard": round(peak[0] / (bound + shard), 3)}
        print(json.dumps(res, indent=1))
        write_json(args.json, res)
    return 0 if peak[0] <= bound + shard else 1


COMMANDS = {"speed": speed, "memory": memory, "group-tokens": group_tokens, "muon": muon, "follow": follow}


def parse_args(argv=None):
    p, command = subcommands(__doc__, COMMANDS)

    s = command("speed", "04's loop against speculators' own Trainer: tokens/s ours / theirs (goal >= 1.0)")
    s.add_argument("--samples", type=int, default=160, help="synthetic samples (default: 160)")
    s.add_argument("--max-tokens", type=int, default=1024, help="tokens per packed batch (default: 1024)")
    s.add_argument("--ttt-steps", type=int, default=3, help="TTT steps, speculators' default (default: 3)")
    s.add_argument("--rounds", type=int, default=3,
                   help="alternating rounds of both; the median ratio is reported (default: 3)")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    s.add_argument("--workdir", type=Path, default=None, help="keep inputs here (default: a temp dir)")
    s.add_argument("--json", type=Path, default=None, help="also write the results here")

    m = command("memory", "04's memory part by part against the planner's figure (exits 1 if the total is off)")
    m.add_argument("--max-tokens", type=int, default=1024, help="04's --max-tokens-per-batch (default: 1024)")
    m.add_argument("--ttt-steps", type=int, default=3, help="04's --ttt-steps (default: 3)")
    m.add_argument("--samples", type=int, default=64, help="samples to extract (default: 64)")
    m.add_argument("--tolerance", type=float, default=0.25, help="allowed |plan - measured| / measured (default: 0.25)")
    m.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")

    g = command("group-tokens", "--group-tokens: tokens/s of grouped forwards / one forward over the whole batch")
    g.add_argument("--hidden-states", type=Path, default=None, help="an 02 store (default: build the tiny one)")
    g.add_argument("--vocab-mapping", type=Path, default=None, help="its 03 output (with --hidden-states)")
    g.add_argument("--target", type=Path, default=None, help="its target (with --hidden-states)")
    g.add_argument("--max-tokens", type=int, default=4096, help="04's --max-tokens-per-batch (default: 4096)")
    g.add_argument("--groups", default="0,256,512,1024", help="--group-tokens values, 0 = one forward "
                                                              "(default: 0,256,512,1024)")
    g.add_argument("--steps", type=int, default=4, help="steps timed per setting and round (default: 4)")
    g.add_argument("--rounds", type=int, default=3, help="rounds (default: 3)")
    g.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    g.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")

    u = command("muon", "Muon's step with bf16 against fp32 orthogonalisation, per draft width")
    u.add_argument("--widths", default="256,512,1024", help="draft widths (default: 256,512,1024)")
    u.add_argument("--steps", type=int, default=2, help="timed steps per dtype after one warm-up (default: 2)")
    u.add_argument("--threads", type=int, default=1, help="(default: 1)")
    f = command("follow", "04 --follow: samples/s following vs on a finished store; disk high-water vs the bound")
    f.add_argument("--samples", type=int, default=96, help="synthetic samples (default: 96)")
    f.add_argument("--shard-mb", type=float, default=1.5, help="02's --shard-mb (default: 1.5)")
    f.add_argument("--bound-shards", type=int, default=3, help="02's --max-store-gb in shards (default: 3)")
    f.add_argument("--workdir", type=Path, default=None, help="keep inputs here (default: a temp dir)")
    f.add_argument("--json", type=Path, default=None, help="also write the results here (default: no)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return COMMANDS[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
