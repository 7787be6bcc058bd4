"""speculators 0.9.0's own training entry point (speculators.train.cli.main, its Trainer), run on
a machine without an accelerator, for scripts/bench/quality.py's reference arm.

    python -m eagle3_testkit.speculators_train <speculators' train flags>

Its trainer assumes an accelerator in three places, and nothing else is changed:
  - the model and batches go to `get_local_rank()` (0 = cuda:0): set to "cpu" once its
    distributed setup has run;
  - autocast uses `current_accelerator().type`, falling back to "cuda" (which is then disabled
    with a warning, so bf16 hidden states meet fp32 weights): "cpu", so its bf16 autocast runs;
  - its step timer calls `torch.accelerator.synchronize()` on logged steps: a no-op without one.
Everything else (Muon, scheduler, loss, TTT, data loading, checkpoints) is its code as shipped.
"""

from __future__ import annotations

import sys


def patch_for_cpu() -> None:
    import torch
    from speculators.train import cli, trainer
    from speculators.train import distributed as sdist

    if torch.accelerator.is_available():  # a CUDA build reports cuda as its accelerator even without a GPU
        return
    setup = cli.maybe_setup_distributed

    def setup_on_cpu(*args, **kwargs):
        out = setup(*args, **kwargs)
        sdist._local_rank = "cpu"
        return out

    cli.maybe_setup_distributed = setup_on_cpu
    init = trainer.Trainer.__init__

    def init_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = init_on_cpu
    torch.accelerator.synchronize = lambda *a, **k: None


def main(argv=None) -> int:
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    patch_for_cpu()
    train_main(TrainConfig.resolve(list(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
