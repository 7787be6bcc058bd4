"""05_evaluate as a package: `run(config)`, config a configs.evaluate.EvalConfig (every setting,
validated once, which may change on resume).

  run.py       run(): the checks, the parts (offline, each arm) kept once finished, the manifest
  draft.py     04's export: checked, identified, loaded; the target's head for its greedy tokens
  offline.py   the draft over held-out store samples against the target's greedy tokens
  online.py    real vLLM per arm (eagle3 / none / ngram), its spec-decode counters
  report.py    report.json, report.md, acceptance.png
"""

from .run import run

__all__ = ["run"]
