#!/usr/bin/env python3
"""05: measure the draft's acceptance offline and in real vLLM; the CLI is eagle3_train/evaluate/cli.py."""
from eagle3_train.evaluate.cli import entry

entry()
