"""01b generate: a prompt set's answers from the target served by vLLM, resumable by id.

  config.py  GenerateConfig
  cli.py     the command line (01b_generate_synthetic.py)
  stage.py   run(): plan the work, send, stream the answers, errors.jsonl, the manifest
  server_cache.py the servers' KV caches before any prompt: what fits whole, a warning when --concurrency does not
  concurrency.py  --concurrency auto: the pure controller (next_level) and its driver (pools, history)
  capture.py      --capture-hidden-states: the states read, stored and committed with the answers
  capture_client.py  its request option and response check; capture_settings.py: the flags it shares with 02
"""


def run(cfg, **options):
    """Generate as cfg (a GenerateConfig) says; the exit code."""
    from eagle3_train.generate.stage import run as run_stage

    return run_stage(cfg, **options)
