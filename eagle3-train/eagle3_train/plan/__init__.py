"""00 plan: disk, per-GPU memory, tokens and hours per stage, before anything runs.

  config.py   PlanConfig
  cli.py      the command line (00_plan.py)
  stage.py    run(): the plan printed (table, 01b's and the capture's lines)
  planner.py  plan: every stage's figures from the shapes, the data and the flags
  dry_runs.py 02's and 04's --dry-run
  data.py     --data: a finished 01b output's or tokenized set's counts and answer lengths
  gen.py      01b's model: answer lengths, the level --concurrency auto reaches, tok/s against it
"""


def run(cfg, **options):
    """Print the plan cfg (a PlanConfig) asks for; the exit code."""
    from eagle3_train.plan.stage import run as run_stage

    return run_stage(cfg, **options)
