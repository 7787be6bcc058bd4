"""01 split prompts: a prompt source -> disjoint train.jsonl and heldout.jsonl.

  config.py  SplitConfig
  cli.py     the command line (01_split_prompts.py)
  stage.py   run(); the choice of held-out ids is common/split.py:pick_heldout
"""


def run(cfg):
    """Split the prompts as cfg (a SplitConfig) says; the exit code."""
    from eagle3_train.split_prompts.stage import run as run_stage

    return run_stage(cfg)
