"""01c tokenize: raw answers -> the tokenized training set (input_ids + loss_mask).

  config.py   TokenizeConfig, the tokenization flags 01a/01b share
  cli.py      the command line (01c_tokenize.py)
  dataset.py  run(); the training set's format and its reader (TrainingSet, used by 02 and 03)
  report.py   01c's mismatch report: counts by kind, examples
"""


def run(cfg, **options):
    """Tokenize as cfg (a TokenizeConfig) says; the summary counts."""
    from eagle3_train.tokenize.dataset import run as run_stage

    return run_stage(cfg, **options)
