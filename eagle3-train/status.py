#!/usr/bin/env python3
"""Every stage's state in a work directory and the next command; the CLI is eagle3_train/status/cli.py."""
from eagle3_train.status.cli import entry

entry()
