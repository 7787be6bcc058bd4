"""00 preflight: is this box ready for a run? One line per check (ok / warn / fail / skipped and
what to do), exit 1 on a fail.

  config.py            PreflightConfig
  cli.py               the command line (00_preflight.py)
  verdict.py           Verdict, the report's lines and JSON
  gpu.py               GPUs (nvidia-smi), the driver against this torch's CUDA, the vLLM build
  files.py             disk free under the work dir, the model folder complete, the tokenizer's ids
  allreduce.py         the timed all-reduce under torchrun, a hang turned into the P2P advice
  allreduce_worker.py  what each torchrun process runs
  runner.py            run(): every check in order, the report, the exit code
"""


def run(cfg, **options):
    """Run every check cfg (a PreflightConfig) asks for and print the report; the exit code."""
    from eagle3_train.preflight.runner import run as run_stage

    return run_stage(cfg, **options)
