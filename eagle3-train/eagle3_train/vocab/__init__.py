"""03 vocab: the draft vocabulary from the supervised tokens' frequencies.

  config.py    VocabConfig
  cli.py       the command line (03_build_vocab_mapping.py)
  stage.py     run() (an identical rerun is a no-op)
  counts.py    streaming counts, the reusable frequency file
  mapping.py   top-K + required tokens, d2t / t2d, save / read
  coverage.py  coverage curve, plot, K for 90/95/99%
"""


def run(cfg, **options):
    """Build the vocabulary as cfg (a VocabConfig) says; the exit code."""
    from eagle3_train.vocab.stage import run as run_stage

    return run_stage(cfg, **options)
