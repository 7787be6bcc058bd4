"""04's checkpoints: checkpoints/step-XXXXXXX/ holds weights.pt (trainable tensors), optimizer.pt
(every optimizer's state, by parameter name), trainer.pt (schedulers, optimizer name, loop state,
metric accumulators), rng/rank-R.pt, state.json and COMPLETE. Each is written in a temp dir and
renamed into place, so it is valid only with COMPLETE; one `Checkpointer` owns the interval, keep-last, save, load and the records a kill could lose."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit, atomic_write_json
from eagle3_train.train.config import CKPT_DIR
from eagle3_train.train.dist import Dist
from eagle3_train.train.metrics import read_metrics

COMPLETE = "COMPLETE"


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Valid checkpoints (those with COMPLETE), oldest first."""
    root = Path(run_dir) / CKPT_DIR
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step-") and (p / COMPLETE).exists():
                with contextlib.suppress(ValueError):
                    out.append((int(p.name[5:]), p))
    return sorted(out)


class Checkpointer:
    """Every rank holds one and calls save/load together (they are collectives under FSDP)."""

    def __init__(self, run_dir: Path, d: Dist, *, interval: int, keep_last: int):
        self.root = Path(run_dir) / CKPT_DIR
        self.run_dir, self.d, self.interval, self.keep_last = Path(run_dir), d, interval, keep_last
        self.resumed_from: Path | None = None

    def should_save(self, step: int, *, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def valid(self) -> dict[int, Path]:
        return dict(checkpoints(self.run_dir))

    def load(self, core: nn.Module, opt, optimizer: str | None = None) -> dict | None:
        """Restore the last valid checkpoint into `core` and `opt` (an optimizer or a list of
        them; and this rank's RNG); its trainer state, or None when there is none. A checkpoint
        made by another `optimizer` (one without the record: AdamW's) is refused."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        found = checkpoints(self.run_dir)
        if not found:
            return None
        path = self.resumed_from = found[-1][1]
        state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
        made_with = state.get("optimizer", "adamw")
        if optimizer is not None and made_with != optimizer:
            raise PipelineError(f"{path} was trained with --optimizer {made_with}, but this run uses {optimizer}; "
                                f"pass --optimizer {made_with} to resume it, or --overwrite to start over")
        sd = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
        osd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
        set_state_dict(core, opt, model_state_dict=sd, optim_state_dict=osd,
                       options=StateDictOptions(full_state_dict=True, strict=False))
        rng = path / "rng" / f"rank-{self.d.rank:05d}.pt"
        if rng.exists():
            set_rng_state(torch.load(rng, map_location="cpu", weights_only=False), self.d.device)
        return state

    def load_weights(self, core: nn.Module, step: int) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        sd = torch.load(self.valid()[step] / "weights.pt", map_location="cpu", weights_only=True)
        set_model_state_dict(core, sd, options=StateDictOptions(full_state_dict=True, strict=False))

    def save(self, step: int, core: nn.Module, opt, trainer_state: dict, summary: dict, keep: set[int]) -> Path:
        """Rank 0 writes a temp dir, every rank its RNG file, rank 0 marks it COMPLETE and renames
        it into place, then prunes all but the last `keep_last` and `keep`."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        d = self.d
        final = self.root / f"step-{step:07d}"
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        msd, osd = get_state_dict(core, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        trainable = {n for n, p in core.named_parameters() if p.requires_grad}
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        d.barrier()
        # Multi-node runs want --output-dir on shared storage; elsewhere a node's RNG files stay
        # local and a resume there starts those ranks from a fresh RNG (nothing in training draws from it).
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        _save(rng_state(d.device), tmp / "rng" / f"rank-{d.rank:05d}.pt")
        d.barrier()
        if d.main:
            _save({n: t for n, t in msd.items() if n in trainable}, tmp / "weights.pt")
            _save(osd, tmp / "optimizer.pt")
            _save(trainer_state, tmp / "trainer.pt")
            atomic_write_json(tmp / "state.json", summary)
            (tmp / COMPLETE).write_text(f"step {step}\n")
            atomic_dir_commit(tmp, final)
            for s, p in checkpoints(self.run_dir)[:-self.keep_last]:
                if s not in keep:
                    shutil.rmtree(p, ignore_errors=True)
        d.barrier()
        return final

    def relog(self, step: int, metrics) -> None:
        """A kill between a checkpoint's commit and its `val`/`checkpoint` lines in metrics.jsonl
        would lose them for good (the resumed run starts after that step): write them from the
        checkpoint's own state.json when they are missing."""
        ckpt = self.resumed_from
        logged = read_metrics(self.run_dir)
        has = lambda kind: any(r.get("step") == step for r in logged.get(kind, []))  # noqa: E731
        try:
            summary = json.loads((ckpt / "state.json").read_text())
        except (OSError, json.JSONDecodeError):
            return
        if summary.get("val") is not None and not has("val"):
            metrics.write({"kind": "val", "step": step, **summary["val"], "time": summary.get("time")})
        if not has("checkpoint"):
            metrics.write({"kind": "checkpoint", "step": step, "path": str(ckpt), "time": summary.get("time")})


def rng_state(device: torch.device) -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def set_rng_state(st: dict, device: torch.device) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


def _save(obj, path: Path) -> None:
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as e:
        # torch's zip writer reports a short write as "[enforce fail ...] unexpected pos", dropping
        # the OS's ENOSPC; say what happened when the file system is indeed (nearly) full
        if shutil.disk_usage(path.parent).free < 16 << 20:
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from e
        raise
