#!/usr/bin/env python3
"""01b: regenerate a prompt set's answers with the target served by vLLM; the CLI is eagle3_train/generate/cli.py."""
from eagle3_train.generate.cli import entry

entry()
