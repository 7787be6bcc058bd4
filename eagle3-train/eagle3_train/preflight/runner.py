"""run(): every check in order, each line printed as its check ends (the all-reduce can take
minutes), then the summary; the exit code is 1 when a check failed."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.preflight import allreduce, files, gpu
from eagle3_train.preflight.config import PreflightConfig
from eagle3_train.preflight.verdict import FAIL, Verdict, exit_code, report, skipped, summary


def needed_bytes(cfg: PreflightConfig) -> int | None:
    if cfg.plan:
        return files.plan_bytes(cfg.plan)
    return int(cfg.need_gb * files.GB) if cfg.need_gb else None


def model_folder(cfg: PreflightConfig) -> tuple[Path | None, Verdict | None]:
    """The model's folder, or the fail line saying why there is none (a typo is the check's finding)."""
    if not cfg.model:
        return None, skipped("model", "no --model given")
    from eagle3_train.common.target import local_model_dir

    try:
        return local_model_dir(cfg.model), None
    except PipelineError as e:
        return None, Verdict("model", FAIL, str(e))


def allreduce_check(cfg: PreflightConfig, gpus: int | None, driver: Verdict | None = None) -> Verdict:
    """`gpus`: the GPUs torch sees (None: no CUDA device on this machine)."""
    name = "all-reduce"
    if gpus is None:  # no CUDA here: gloo on the CPU only when asked for (the tests, a dry run of the check)
        n = cfg.allreduce_procs or 0
        if n < 2:
            return skipped(name)
        return allreduce.run_allreduce(n, cfg.allreduce_mb, cfg.allreduce_iters, cfg.allreduce_timeout,
                                       unit="CPU processes")
    if driver is not None and driver.status == FAIL:
        return skipped(name, "the driver check failed")
    n = gpus if cfg.allreduce_procs is None else cfg.allreduce_procs
    if n > gpus:
        raise PipelineError(f"--allreduce-procs {n}: torch sees {gpus} GPUs here (one process per GPU)")
    if n < 2:
        return skipped(name, "--allreduce-procs 0" if n == 0 else "1 GPU: nothing to all-reduce")
    return allreduce.run_allreduce(n, cfg.allreduce_mb, cfg.allreduce_iters, cfg.allreduce_timeout,
                                   min_busbw=cfg.min_busbw)


def tokenizer_check(cfg: PreflightConfig, folder: Path | None) -> Verdict:
    name = cfg.tokenizer or (str(folder) if folder else None)
    if not name:
        return skipped("tokenizer", "no --model or --tokenizer given")
    from eagle3_train.common.tokenization import load_tokenizer

    try:
        tok = load_tokenizer(name)
    except PipelineError as e:
        return Verdict("tokenizer", FAIL, str(e), "pass the target's tokenizer folder as --tokenizer")
    model_type, vocab = files.model_type_and_vocab(folder) if folder else (None, None)
    return files.tokenizer_verdict(files.tokenizer_facts(tok, reasoning=not cfg.no_reasoning),
                                   model_type=model_type, target_vocab=vocab, target=str(folder or ""))


def run(cfg: PreflightConfig) -> int:
    need = needed_bytes(cfg)  # a bad --plan is bad input: exit 2 before any check
    verdicts: list[Verdict] = []

    def emit(v: Verdict) -> None:
        verdicts.append(v)
        if not cfg.json:
            print(v.line(), flush=True)

    found, driver_cuda, problem = gpu.probe_gpus()
    if found is None:
        emit(skipped("gpus"))
        emit(skipped("driver"))
        emit(allreduce_check(cfg, None))
    elif problem:
        emit(Verdict("gpus", FAIL, problem, "`nvidia-smi` alone shows what the driver says"))
        emit(skipped("driver", "no GPU list to check it against"))
        emit(skipped("all-reduce", "the gpus check failed"))
    else:
        emit(gpu.gpus_verdict(found, cfg.gpus))
        torch_info = gpu.probe_torch()
        emit(driver := gpu.driver_verdict(found, driver_cuda, torch_info))
        emit(allreduce_check(cfg, torch_info.devices, driver))

    folder, model_fail = model_folder(cfg)
    from eagle3_train.common.target_layout import quantization
    from eagle3_train.common.vllm_server import vllm_python

    python = vllm_python()
    info, error = gpu.probe_vllm(python)
    emit(gpu.vllm_verdict(info, error, python, gpu_box=bool(found), pinned=gpu.pinned_vllm(),
                          sm120=any(g.capability and g.capability[0] == 12 for g in found or []),
                          quant=quantization(folder) if folder else None))
    emit(files.disk_verdict(cfg.work_dir, files.probe_disk(cfg.work_dir), need))
    emit(model_fail or files.model_verdict(folder))
    emit(tokenizer_check(cfg, folder))

    rep = report(verdicts)
    if cfg.out:
        from eagle3_train.common.store import atomic_write_json

        atomic_write_json(Path(cfg.out), rep)
    print(json.dumps(rep, indent=1) if cfg.json else summary(verdicts), flush=True)
    return exit_code(verdicts)

