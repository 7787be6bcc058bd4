"""The pilot: every stage on a small slice of the real run (64 prompts -> 20 training steps -> 05 on
16 prompts) into <work-dir>/pilot, 01b's answers screened for garbled output, one verdict table.
The runbook: preflight -> 00 plan -> pilot -> the full run.

  config.py  PilotConfig
  cli.py     the command line (pilot.py, eagle3-pilot)
  driver.py  stages as processes: banner, skip when finished and matching, refuse another run's
             output, stage times (scripts/demo.py drives the demo with it too)
  stage.py   run(): the pilot's steps, the screen, pilot_report.json / .md
  rates.py   01b's measured tok/s and answer lengths -> gen_rates.json, the full run's 01b from them
"""


def run(cfg, **options):
    """Run the pilot as cfg (a PilotConfig) says; the exit code."""
    from eagle3_train.pilot.stage import run as run_stage

    return run_stage(cfg, **options)
