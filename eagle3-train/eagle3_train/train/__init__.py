"""04_train as a package: `run(config)`, config a configs.train.TrainConfig (every setting,
validated once, which may change on resume).

  inputs.py      the store, mapping and target, checked to belong together; their identity
  data.py        the by-id split, packing, collation, the plan of batches per step
  model.py       the draft made from the config, the target head, the objective as processes share it
  objective.py   the TTT forward KL; forward returns (draft tokens, loss, metrics)
  dist.py        processes and devices; DDP / FSDP wrapping
  checkpoint.py  Checkpointer: interval, keep-last, atomic save with COMPLETE, load, relog
  metrics.py     Meter (sums per interval), Recorder (metrics.jsonl + progress), curves
  loop.py        run() and the Trainer: train, train_step, validate, save
  export.py      the speculators-format export and the manifest
"""

from .loop import run

__all__ = ["run"]
