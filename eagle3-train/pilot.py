#!/usr/bin/env python3
"""The pilot: every stage on a small slice of the real run, screened; the CLI is eagle3_train/pilot/cli.py."""
from eagle3_train.pilot.cli import entry

entry()
