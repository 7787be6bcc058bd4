#!/usr/bin/env python3
"""01a: import text-only answers as a 01b-format output; the CLI is eagle3_train/import_text/cli.py."""
from eagle3_train.import_text.cli import entry

entry()
