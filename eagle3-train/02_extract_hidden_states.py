#!/usr/bin/env python3
"""02: store the target's hidden states for EAGLE-3; the CLI is eagle3_train/extract/cli.py."""
from eagle3_train.extract.cli import entry

entry()
