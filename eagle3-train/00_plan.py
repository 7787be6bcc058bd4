#!/usr/bin/env python3
"""00: plan disk, memory and hours of a run before anything runs; the CLI is eagle3_train/plan/cli.py."""
from eagle3_train.plan.cli import entry

entry()
