"""The reliability harness: run a stage as a subprocess, SIGKILL it at seeded random moments, rerun
the same command, and compare what it left with an uninterrupted run's output.

    spec = StageSpec("03_build_vocab_mapping", argv=lambda out: [..., "--out", out], view=VIEWS["03"])
    ref = reference_run(spec, tmp / "reference")        # timed, uninterrupted
    sweep(spec, tmp, ref, seed=3, n=20)                  # 20 kills at seeded moments, each rerun

By concern:
    run      running a stage (subprocess environment and command; in-process as its script runs it)
    kill     kill moments, crash trials, reference runs, sweeps
    views    what of an output must be equal between runs: file views and each stage's (VIEWS)
    checks   what a refused run must leave: one `error:` line, nothing changed, no record lost
    hostile  a full disk, a read-only mount, a lock held by another process
    chain    the tiny pipeline the reliability tests share (Chain) and its fixtures

Test modules import from the package (`from reliability import ...`); the fixtures `chain` and
`fault_server` are imported by name into a module, then taken as arguments.
"""
from .chain import CHAIN_TRAIN, HS_ARGS, Chain, argv01b, chain, fault_server, replicate_training_set
from .checks import assert_one_error_line, assert_unchanged, jsonl_records, records_kept, snapshot
from .hostile import lock_held, read_only, resize_disk, small_disk
from .kill import (
                   Kill,
                   Moment,
                   Reference,
                   StageSpec,
                   Trial,
                   crash_trial,
                   kill_at,
                   moments,
                   probe_bytes,
                   reference_from,
                   reference_run,
                   sweep,
)
from .run import Result, run_inprocess, run_stage, stage_cmd, stage_env
from .views import (
                   NOT_OUTPUT,
                   TMP_PREFIX,
                   VIEWS,
                   VOLATILE,
                   diff_views,
                   file_view,
                   json_view,
                   jsonl_view,
                   metrics_view,
                   safetensors_view,
                   strict_jsonl,
                   temp_files,
                   torch_view,
                   tree_view,
                   view01b,
                   view02,
                   view03,
                   view04,
)

__all__ = [
    "CHAIN_TRAIN", "HS_ARGS", "Chain", "argv01b", "chain", "fault_server", "replicate_training_set",
    "assert_one_error_line", "assert_unchanged", "jsonl_records", "records_kept", "snapshot",
    "lock_held", "read_only", "resize_disk", "small_disk",
    "Kill", "Moment", "Reference", "StageSpec", "Trial", "crash_trial", "kill_at", "moments", "probe_bytes",
    "reference_from", "reference_run", "sweep",
    "Result", "run_inprocess", "run_stage", "stage_cmd", "stage_env",
    "NOT_OUTPUT", "TMP_PREFIX", "VIEWS", "VOLATILE", "diff_views", "file_view", "json_view", "jsonl_view",
    "metrics_view", "safetensors_view", "strict_jsonl", "temp_files", "torch_view", "tree_view", "view01b",
    "view02", "view03", "view04",
]
