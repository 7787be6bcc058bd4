"""05 evaluate: `run(config)`, config an evaluate.config.EvalConfig (every setting,
validated once, which may change on resume).

  config.py    EvalConfig
  cli.py       the command line (05_evaluate.py)
  stage.py     run(): the checks, the parts (offline, each arm) kept once finished, the manifest
  draft.py     04's export: checked, identified, loaded; the target's head for its greedy tokens
  offline.py   the draft over held-out store samples against the target's greedy tokens
  online.py    real vLLM per arm (eagle3 / none / ngram), its spec-decode counters
  report.py    report.json, report.md, acceptance.png
"""


def run(cfg, **options):
    """Evaluate as config (an EvalConfig) says; the report's text."""
    from eagle3_train.evaluate.stage import run as run_stage

    return run_stage(cfg, **options)
