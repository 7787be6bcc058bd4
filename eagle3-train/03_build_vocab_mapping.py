#!/usr/bin/env python3
"""03: choose the draft vocabulary (d2t / t2d); the CLI is eagle3_train/vocab/cli.py."""
from eagle3_train.vocab.cli import entry

entry()
