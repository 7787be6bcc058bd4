"""00_preflight's settings: what to check and against what. Torch-free, like every stage's config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from eagle3_train.common.config import Settings, require, setting


@dataclass(kw_only=True)
class PreflightConfig(Settings):
    stage: ClassVar[str] = "00_preflight"

    model: str | None = setting(None, help="the target's folder (or a hub id in the local cache): every weight file "
                                           "its index names, whole, and its tokenizer (default: not checked)")
    tokenizer: str | None = setting(None, help="the tokenizer to check (default: --model's)")
    no_reasoning: bool = setting(False, help="the target does not reason: no <think> / </think> needed")
    work_dir: str = setting(".", help="where the run writes: the free space of its disk is checked")
    need_gb: float | None = setting(None, help="GB the run writes under --work-dir (default: --plan's disk total; "
                                               "neither: free space only reported)")
    plan: str | None = setting(None, help="a plan JSON, `00_plan.py ... --json > plan.json`: its disk_total is "
                                          "the space the run needs")
    gpus: int | None = setting(None, help="GPUs the run will use: fewer visible is a fail (default: any number)")
    allreduce_procs: int | None = setting(None, help="processes of the torchrun all-reduce (default: one per GPU, "
                                                     "skipped without CUDA; 0: skipped; without CUDA, N >= 2 runs N "
                                                     "gloo processes on the CPU)")
    allreduce_mb: float = setting(256.0, help="MB per all-reduce")
    allreduce_iters: int = setting(20, help="timed all-reduces")
    allreduce_timeout: float = setting(120.0, help="seconds the all-reduces may take once every process has "
                                                   "started, before the run counts as hung")
    min_busbw: float = setting(5.0, help="NCCL bus bandwidth (GB/s) below which the all-reduce warns")
    json: bool = setting(False, help="print the report as JSON instead of one line per check")
    out: str | None = setting(None, help="also write the JSON report to this file")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name in ("allreduce_mb", "allreduce_iters", "allreduce_timeout"):
            value = getattr(self, name)
            require(value > 0, f"--{name.replace('_', '-')} must be positive, not {value}")
        require(self.min_busbw >= 0, f"--min-busbw must not be negative, not {self.min_busbw}")
        require(self.need_gb is None or self.need_gb > 0, f"--need-gb must be positive, not {self.need_gb}")
        require(self.need_gb is None or self.plan is None, "pass --need-gb or --plan, not both")
        require(self.gpus is None or self.gpus >= 1, f"--gpus must be at least 1, not {self.gpus}")
        require(self.allreduce_procs is None or self.allreduce_procs >= 0,
                f"--allreduce-procs must not be negative, not {self.allreduce_procs}")
        # paths, before minutes of GPU checks: the disk checked must be a folder's, the report a file
        from eagle3_train.preflight.files import existing_parent, plan_bytes

        where = existing_parent(Path(self.work_dir))
        require(where.is_dir(), f"--work-dir {self.work_dir}: {where} is a file, not a directory; pass the "
                                "directory the run will write under")
        require(self.out is None or not Path(self.out).is_dir(),
                f"--out {self.out} is a directory; pass a file name for the JSON report, e.g. "
                f"{self.out}/preflight.json")
        if self.plan:
            plan_bytes(self.plan)  # a missing or foreign --plan is one line now, not after the checks
