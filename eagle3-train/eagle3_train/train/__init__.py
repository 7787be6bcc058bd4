"""04 train: `run(config)`, config a train.config.TrainConfig (every setting,
validated once, which may change on resume).

  config.py      TrainConfig (every flag), the draft architectures and losses
  cli.py         the command line (04_train.py)
  budget.py      --budget, the length rule, the default lr for the width
  draft.py       the EAGLE-3 draft (speculators' Eagle3DraftModel) built, unrolled, exported
  draft_mla.py   the MLA draft layer (DeepSeek-V3 / Kimi targets), vLLM's deepseek_eagle3 format
  recipe.py      Muon on the hidden matrices + AdamW on the rest
  muon.py        Muon's orthogonalisation (fp32 on CPU)
  inputs.py      the store, mapping and target, checked to belong together; their identity
  data.py        the by-id split, packing, collation, the plan of batches per step
  model.py       the draft made from the config, the target head, the objective as processes share it
  objective.py   the TTT loss (--loss ce by default, or forward KL); forward returns (draft tokens, loss, metrics)
  dist.py        processes and devices; DDP / FSDP wrapping
  checkpoint.py  Checkpointer: interval, keep-last, atomic save with COMPLETE, load, relog
  metrics.py     Meter (sums per interval), Recorder (metrics.jsonl + progress), curves
  loop.py        run() and the Trainer: train, train_step, validate, save
  resolve.py     the draft's defaulted flags (arch, K, block, window, norms) resolved; a bare rerun's kept
  export.py      the export vLLM serves (speculators' eagle3 / DFlash format; MLA: vLLM's deepseek_eagle3), manifest
"""


def run(cfg, **options):
    """Train (or resume) as config (a TrainConfig) says; the summary."""
    from eagle3_train.train.loop import run as run_stage

    return run_stage(cfg, **options)
