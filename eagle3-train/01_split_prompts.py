#!/usr/bin/env python3
"""01: a prompt source -> train.jsonl + heldout.jsonl; the CLI is eagle3_train/split_prompts/cli.py."""
from eagle3_train.split_prompts.cli import entry

entry()
