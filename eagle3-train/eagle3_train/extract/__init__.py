"""02 extract: the target's hidden states (aux layers + last, or top-k) into a store.

  config.py  ExtractConfig
  cli.py     the command line (02_extract_hidden_states.py)
  stage.py   run(): plan, shards, resume, disk check, --validate / --repair
  hf.py      the transformers backend (layer stack, dtype, device, top-k head)
  vllm.py    the vLLM backend (extract_hidden_states + connector) and its serve command
"""


def run(cfg, **options):
    """Extract as cfg (an ExtractConfig) says; the exit code."""
    from eagle3_train.extract.stage import run as run_stage

    return run_stage(cfg, **options)
