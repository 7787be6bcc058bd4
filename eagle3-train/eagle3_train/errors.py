"""One error type for everything a user can cause, and the wrapper that turns it into one line."""

from __future__ import annotations

import errno
import sys


class PipelineError(Exception):
    """Bad input, a mismatched manifest, a busy output directory: said in one line, exit 2."""


def run_main(main, argv=None) -> int:
    """Run a stage's main(); user-facing failures become `error: ...` on stderr and exit 2.

    Disk full and permission problems are the user's to fix too, so they get the same treatment;
    anything else is a bug and keeps its traceback.
    """
    try:
        rc = main(argv)
        return 0 if rc is None else int(rc)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: everything committed so far is kept; rerun the same command to resume",
              file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            print(f"error: disk full while writing {e.filename or ''} (no space left on device); "
                  "free space and rerun the same command to resume", file=sys.stderr)
            return 2
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            print(f"error: permission denied: {e.filename or e}", file=sys.stderr)
            return 2
        raise
