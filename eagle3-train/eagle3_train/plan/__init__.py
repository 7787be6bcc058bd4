"""00 plan: disk, per-GPU memory, tokens and hours per stage, before anything runs.

  config.py   PlanConfig
  cli.py      the command line (00_plan.py)
  planner.py  run(); plan / table; 02's and 04's --dry-run
  gen.py      01b's model: answer lengths, the level --concurrency auto reaches, tok/s against it
"""


def run(cfg, **options):
    """Print the plan cfg (a PlanConfig) asks for; the exit code."""
    from eagle3_train.plan.planner import run as run_stage

    return run_stage(cfg, **options)
