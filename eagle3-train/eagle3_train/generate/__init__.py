"""01b generate: a prompt set's answers from the target served by vLLM, resumable by id.

  config.py  GenerateConfig
  cli.py     the command line (01b_generate_synthetic.py)
  stage.py   run(): plan the work, send, stream the answers, errors.jsonl, the manifest
  concurrency.py  --concurrency auto: the pure controller (next_level) and its driver (pools, history)
"""


def run(cfg, **options):
    """Generate as cfg (a GenerateConfig) says; the exit code."""
    from eagle3_train.generate.stage import run as run_stage

    return run_stage(cfg, **options)
