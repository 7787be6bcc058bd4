"""One error type for everything a user can cause, and the wrapper that turns it into one line."""

from __future__ import annotations

import errno
import os
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
    except Exception as e:
        if not isinstance(e, OSError):
            if not _says_disk_full(e):
                raise
            # e.g. safetensors' SafetensorError: the OS said ENOSPC, the library kept only the text
            print(f"error: disk full, no space left on device ({type(e).__name__}: "
                  f"{str(e).strip().splitlines()[-1][:200]}); "
                  "free space and rerun the same command to resume", file=sys.stderr)
            return 2
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            print(f"error: disk full while writing {e.filename or ''} (no space left on device); "
                  "free space and rerun the same command to resume", file=sys.stderr)
            return 2
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            what = "read-only file system" if e.errno == errno.EROFS else "permission denied"
            print(f"error: {what}: {e.filename or e}", file=sys.stderr)
            return 2
        if e.errno in (errno.ENOTDIR, errno.EISDIR):
            print(f"error: {e.strerror.lower()}: {e.filename or e}", file=sys.stderr)
            return 2
        if e.errno == errno.EEXIST and e.filename and os.path.lexists(e.filename) \
                and not os.path.isdir(e.filename):
            # mkdir(exist_ok=True) of an output directory where a file is
            print(f"error: not a directory: {e.filename} is a file; pass another output directory",
                  file=sys.stderr)
            return 2
        raise


def _says_disk_full(e: BaseException) -> bool:
    """A library error whose message carries the OS's ENOSPC (it did not keep the errno)."""
    text = str(e)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text
