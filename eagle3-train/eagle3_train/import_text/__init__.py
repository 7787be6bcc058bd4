"""01a import text: answers with only reasoning/content text -> a 01b-format output.

  config.py  ImportTextConfig
  cli.py     the command line (01a_import_text.py)
  stage.py   run(); one answer's ids re-wrapped from its text (also 01b --allow-text-fallback)
"""


def run(cfg, **options):
    """Import the answers as cfg (an ImportTextConfig) says; the exit code."""
    from eagle3_train.import_text.stage import run as run_stage

    return run_stage(cfg, **options)
