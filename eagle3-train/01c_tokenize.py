#!/usr/bin/env python3
"""01c: 01b's raw answers -> the tokenized training set; the CLI is eagle3_train/tokenize/cli.py."""
from eagle3_train.tokenize.cli import entry

entry()
