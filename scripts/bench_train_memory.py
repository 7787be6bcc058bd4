"""04's memory on CPU, part by part, against the planner's figure (planner.train_memory).

    uv run python scripts/bench_train_memory.py [--max-tokens 1024] [--ttt-steps 3] [--samples 64]

Builds 04's Trainer on the tiny trained target (tokenized -> 02 fp32 -> 03, as bench_train.py does)
and measures what its tensors hold, not the process's RSS (torch and speculators alone are ~1 GB of
it, which would swamp a draft of a few MB):
  weights        every parameter of the draft (frozen ones too)
  grads_and_adam the gradients + AdamW's two states after one step
  target_head    the frozen target head's buffers (norm, full lm_head, the draft-vocab rows) and
                 the batch's targets it computes
  activations    what autograd keeps for the backward during one full-size step (saved tensors,
                 each storage counted once, parameters and the batch's inputs excluded)
Prints each part planned / measured; exits 1 if the total is off by more than --tolerance.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measure(trainer) -> dict:
    """The four parts of one step of `trainer` (its first batch of full size)."""
    from eagle3_train.train.objective import prepare

    model, d = trainer.model, trainer.d
    exclude = {p.untyped_storage().data_ptr() for p in model.objective.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in model.objective.buffers()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
        return t

    batches = trainer.loader.step(0)
    batch = max(batches, key=lambda b: int(b.ids.shape[1]))
    tokens = int(batch.ids.shape[1])  # S, padded: what the step's tensors are sized by
    # One forward over the batch, as the planner sizes it (flex on GPU; --group-tokens groups only
    # dense attention, and holds less)
    batch = prepare(batch.to(d.device, d.dtype), model.head, trainer.config.ttt_steps)
    exclude |= {v.untyped_storage().data_ptr() for v in vars(batch).values() if isinstance(v, torch.Tensor)}
    for o in trainer.optimizers:
        o.zero_grad(set_to_none=True)
    model.objective.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), d.autocast():
        _, loss, _ = model.wrapped(batch)
    activations = sum(saved.values())
    loss.backward()
    for o in trainer.optimizers:
        o.step()
    states = [v for o in trainer.optimizers for s in o.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"weights": nbytes(model.objective.draft.parameters()),
            "grads_and_adam": nbytes(p.grad for p in model.parameters) + nbytes(states),
            # the head's buffers and the targets it made for this batch (the plan counts both there)
            "target_head": (nbytes(model.head.buffers()) if model.head is not None else 0) + nbytes([batch.targets]),
            "activations": activations, "tokens": tokens}


PARTS = ("weights", "grads_and_adam", "target_head", "activations", "total")


def compare(cfg) -> tuple[dict, object]:
    """04's Trainer for `cfg` (a parsed 04 config) measured against planner.train_memory:
    {part: {planned, measured, ratio}} and the planner flags used."""
    from eagle3_train.plan import planner
    from eagle3_train.train.dist import setup_dist
    from eagle3_train.train.inputs import open_inputs
    from eagle3_train.train.loop import Trainer

    d = setup_dist(cfg.device)
    inp = open_inputs(cfg, d.dtype)
    trainer = Trainer(cfg, d, inp, Path(cfg.output_dir))
    got = measure(trainer)
    got["total"] = sum(got[k] for k in PARTS[:-1])
    shape = planner.Shape.from_config(json.loads((Path(cfg.target) / "config.json").read_text()))
    flags = planner.Flags(samples=len(inp.store.ids), tokens_per_sample=100,
                          storage="fp8-topk" if inp.topk else "fp32", n_aux=len(inp.aux_ids),
                          draft_vocab_size=int(inp.mapping.d2t.shape[0]), max_tokens_per_batch=got["tokens"],
                          ttt_steps=cfg.ttt_steps, attn=trainer.model.kernels["attn"],
                          act_bytes=2 if d.dtype in (torch.bfloat16, torch.float16) else 4,
                          train_lm_head=cfg.train_lm_head, train_embeddings=cfg.train_embeddings,
                          optimizer=cfg.optimizer, draft_arch=cfg.draft_arch)
    plan = planner.train_memory(shape, flags)
    rows = {k: {"planned": plan[k], "measured": got[k], "ratio": plan[k] / got[k] if got[k] else None} for k in PARTS}
    return rows, flags


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=1024, help="04's --max-tokens-per-batch (default: 1024)")
    p.add_argument("--ttt-steps", type=int, default=3, help="04's --ttt-steps (default: 3)")
    p.add_argument("--samples", type=int, default=64, help="samples to extract (default: 64)")
    p.add_argument("--tolerance", type=float, default=0.25, help="allowed |plan - measured| / measured (default: 0.25)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from eagle3_testkit.fixtures import tiny_reasoner_dir

    target = tiny_reasoner_dir()
    bench = load(REPO / "scripts" / "bench_train.py", "bench_train")
    stage = load(REPO / "eagle3-train" / "04_train.py", "stage_04")
    with tempfile.TemporaryDirectory(prefix="bench_train_memory-") as tmp:
        work = Path(tmp)
        hs, vocab = bench.make_inputs(work, target, args.samples)
        cfg = stage.parse_args(["--hidden-states", str(hs), "--vocab-mapping", str(vocab), "--target", str(target),
                                "--out", str(work / "run"), "--max-tokens-per-batch", str(args.max_tokens),
                                "--ttt-steps", str(args.ttt_steps), "--device", "cpu", "--quiet", "--threads", "1"])
        rows, flags = compare(cfg)
    for k, r in rows.items():
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"{k:15s} planned {r['planned'] / 2**20:9.2f} MiB   measured {r['measured'] / 2**20:9.2f} MiB   "
              f"plan/measured {ratio}")
    print(f"batch {flags.max_tokens_per_batch} tokens, TTT {flags.ttt_steps}, attention {flags.attn}, "
          f"draft vocab {flags.draft_vocab_size}, storage {flags.storage}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "flags": vars(flags)}, indent=1, default=str))
    return 0 if abs(rows["total"]["ratio"] - 1) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
