#!/usr/bin/env python3
"""00: is this box ready (GPUs, driver, all-reduce, vLLM, disk, model, tokenizer)? The CLI is preflight/cli.py."""
from eagle3_train.preflight.cli import entry

entry()
