"""eagle3_train.common.errors.run_main, directly: what a user can cause (bad input, disk full, no
permission, a file where a directory goes) is one `error:` line and exit 2; Ctrl-C says the run
resumes, exit 130; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import errno
import os

import pytest
from eagle3_train.common.errors import PipelineError, run_main


def raising(exc):
    def main(argv):
        raise exc

    return main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_exit_code_of_main_and_argv_passed_through():
    seen = []
    assert run_main(lambda argv: seen.append(argv), ["--x", "1"]) == 0
    assert seen == [["--x", "1"]]
    assert run_main(lambda argv: 3) == 3


def test_pipeline_error_is_one_line_exit_2(capsys):
    assert run_main(raising(PipelineError("/data/x.jsonl:3: malformed JSON line"))) == 2
    assert one_error_line(capsys) == "error: /data/x.jsonl:3: malformed JSON line"


def test_keyboard_interrupt_says_rerun_resumes(capsys):
    assert run_main(raising(KeyboardInterrupt())) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted:") and "rerun the same command to resume" in err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_is_one_line_naming_the_file(code, capsys):
    assert run_main(raising(OSError(code, "No space left on device", "/out/shard-00001.safetensors"))) == 2
    line = one_error_line(capsys)
    assert "disk full" in line and "/out/shard-00001.safetensors" in line and "rerun" in line


@pytest.mark.parametrize("message", ["I/O error: No space left on device (os error 28)",
                                     "write failed\nos error 28", "Disk quota exceeded"])
def test_a_library_error_that_says_disk_full_is_one_line(message, capsys):
    class SafetensorError(Exception):
        pass

    assert run_main(raising(SafetensorError(message))) == 2
    line = one_error_line(capsys)
    assert "disk full" in line and "SafetensorError" in line and message.splitlines()[-1] in line


@pytest.mark.parametrize("code, says", [(errno.EACCES, "permission denied"), (errno.EPERM, "permission denied"),
                                        (errno.EROFS, "read-only file system"), (errno.ENOTDIR, "not a directory"),
                                        (errno.EISDIR, "is a directory")])
def test_permission_and_path_kind_errors_are_one_line(code, says, capsys):
    assert run_main(raising(OSError(code, os.strerror(code), "/out/x"))) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {says}") and "/out/x" in line


def test_a_file_where_the_output_directory_goes(tmp_path, capsys):
    (tmp_path / "out").write_text("a file")
    assert run_main(raising(FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "out")))) == 2
    assert "is a file" in one_error_line(capsys)
    (tmp_path / "d").mkdir()  # EEXIST on a directory is not that user error: a bug, re-raised
    with pytest.raises(FileExistsError):
        run_main(raising(FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "d"))))


@pytest.mark.parametrize("exc", [ValueError("a bug"), OSError(errno.ECONNREFUSED, "refused"), RuntimeError("x")])
def test_anything_else_keeps_its_traceback(exc, capsys):
    with pytest.raises(type(exc)):
        run_main(raising(exc))
    assert "error:" not in capsys.readouterr().err
