#!/usr/bin/env python3
"""04: train the draft and export it for vLLM; the CLI is eagle3_train/train/cli.py."""
from eagle3_train.train.cli import entry

entry()
