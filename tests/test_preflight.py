"""00_preflight: each check's parsing and verdicts on captured text (8x RTX PRO 6000 Blackwell
nvidia-smi output, drivers 575 and 580 against the lock's CUDA 13 torch), the model folder on tmp
folders (complete, missing shard, truncated shard), the tokenizer check on the tiny k25 tokenizer
(the Kimi twin's in the whole command), the torchrun all-reduce with 2 gloo processes (ok, and a
hang turned into the P2P line), and the whole command on this CPU machine."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.vllm_server import has_nvidia_gpu
from eagle3_train.preflight import allreduce, files, gpu
from eagle3_train.preflight.allreduce import Outcome
from eagle3_train.preflight.cli import main, parse_args
from eagle3_train.preflight.verdict import FAIL, OK, SKIPPED, WARN, Verdict, exit_code

PRO6000 = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
SMI_8X = "".join(f"{i}, {PRO6000}, 12.0, 97887, 580.82.07\n" for i in range(8))
HEADER_580 = ("+-----------------------------------------------------------------------------------------+\n"
              "| NVIDIA-SMI 580.82.07              Driver Version: 580.82.07      CUDA Version: 13.0     |\n")
HEADER_575 = "| NVIDIA-SMI 575.57.08              Driver Version: 575.57.08      CUDA Version: 12.9     |\n"
CU130 = gpu.TorchCuda("2.13.0+cu130", "13.0", True, 8, ("sm_80", "sm_90", "sm_100", "sm_120", "compute_120"))
no_cuda_here = pytest.mark.skipif(has_nvidia_gpu() or bool(shutil.which("nvidia-smi")),
                                  reason="checks what a machine without CUDA prints")


# ----------------------------------------------------------------------------- GPUs and the driver

def test_nvidia_smi_query_and_header_parse():
    gpus = gpu.parse_gpus(SMI_8X)
    assert len(gpus) == 8 and gpus[7] == gpu.Gpu(7, PRO6000, (12, 0), 97887, "580.82.07")
    assert gpu.parse_gpus("0, NVIDIA H200, 9.0, [N/A], 570.86.15\nNo devices were found\n") == [
        gpu.Gpu(0, "NVIDIA H200", (9, 0), None, "570.86.15")]
    assert gpu.parse_smi_cuda(HEADER_580) == "13.0" and gpu.parse_smi_cuda(HEADER_575) == "12.9"
    assert gpu.parse_smi_cuda("NVIDIA-SMI has failed") is None


def test_gpus_verdict():
    gpus = gpu.parse_gpus(SMI_8X)
    v = gpu.gpus_verdict(gpus, expected=8)
    assert v.status == OK and v.detail == f"8 GPUs: 8x {PRO6000}, sm120, 95.6 GiB"
    assert gpu.gpus_verdict(gpus[:7], expected=8).status == FAIL
    mixed = [*gpus[:4], gpu.Gpu(4, "NVIDIA H200", (9, 0), 143771, "580.82.07")]
    v = gpu.gpus_verdict(mixed)
    assert v.status == WARN and v.detail == f"5 GPUs: 4x {PRO6000}, sm120, 95.6 GiB; 1x NVIDIA H200, sm90, 140.4 GiB"
    assert gpu.gpus_verdict([]).status == FAIL


def test_driver_580_runs_the_cu130_torch_and_575_is_refused_naming_the_minimum():
    gpus = gpu.parse_gpus(SMI_8X)
    ok = gpu.driver_verdict(gpus, "13.0", CU130)
    assert ok.status == OK and "580.82.07 (CUDA 13.0)" in ok.detail and "CUDA 13.0" in ok.detail
    old = gpu.driver_verdict([g.__class__(g.index, g.name, g.capability, g.memory_mib, "575.57.08") for g in gpus],
                             "12.9", CU130)
    assert old.status == FAIL and "needs driver >= 580.65.06" in old.detail and "580.65.06" in old.advice
    # a driver new enough by version but reporting an older CUDA minor: minor-version compatibility
    newer_torch = gpu.TorchCuda("2.14.0+cu132", "13.2", True, 8, CU130.arch_list)
    assert gpu.driver_verdict(gpus, "13.0", newer_torch).status == WARN


@pytest.mark.parametrize("torch_info,status,says", [
    (gpu.TorchCuda("2.13.0+cpu", None, False, 0, ()), FAIL, "CPU build"),
    (gpu.TorchCuda("2.13.0+cu130", "13.0", False, 0, ()), FAIL, "sees no CUDA device"),
    (gpu.TorchCuda("2.13.0+cu130", "13.0", True, 8, ("sm_80", "sm_90", "compute_90")), OK, ""),  # PTX for sm120
    (gpu.TorchCuda("2.13.0+cu130", "13.0", True, 8, ("sm_80", "sm_90", "sm_100")), FAIL, "no kernels for sm120"),
    (gpu.TorchCuda("2.13.0+cu130", "13.0", True, 4, CU130.arch_list), WARN, "sees 4 of 8"),
])
def test_driver_verdict_against_what_torch_reports(torch_info, status, says):
    v = gpu.driver_verdict(gpu.parse_gpus(SMI_8X), "13.0", torch_info)
    assert v.status == status and says in v.detail


def test_kernels_run_on_same_major_newer_minor_and_ptx_on_anything_newer():
    assert gpu.runs_on(["sm_120"], (12, 1)) and not gpu.runs_on(["sm_121"], (12, 0))
    assert not gpu.runs_on(["sm_100", "sm_90"], (12, 0)) and gpu.runs_on(["compute_90"], (12, 0))
    assert gpu.runs_on(["sm_100a"], (10, 0))


# ----------------------------------------------------------------------------- vLLM

def test_vllm_probe_output_and_verdicts():
    info = gpu.parse_vllm_probe('INFO some log line\n{"vllm": "0.32.0", "torch": "2.13.0+cu130", "cuda": "13.0"}\n')
    assert info == {"vllm": "0.32.0", "torch": "2.13.0+cu130", "cuda": "13.0"}
    assert gpu.vllm_verdict(info, "", "py", gpu_box=True, pinned="0.32.0").status == OK
    cpu = {**info, "torch": "2.13.0+cpu", "cuda": None}
    assert gpu.vllm_verdict(cpu, "", "py", gpu_box=True).status == FAIL  # a CPU build on the GPU box
    assert gpu.vllm_verdict(cpu, "", "py", gpu_box=False, pinned="0.32.0").status == OK
    assert gpu.vllm_verdict(None, "No module named 'vllm'", "py", gpu_box=True).status == FAIL
    assert gpu.vllm_verdict(None, "No module named 'vllm'", "py", gpu_box=False).status == WARN
    older = gpu.vllm_verdict({**info, "vllm": "0.31.2"}, "", "py", gpu_box=True, pinned="0.32.0")
    assert older.status == WARN and "vllm==0.32.0" in older.advice


def test_sm120_with_int4_compressed_tensors_warns_to_run_the_garbled_output_screen():
    info = {"vllm": "0.32.0", "torch": "2.13.0+cu130", "cuda": "13.0"}
    v = gpu.vllm_verdict(info, "", "py", gpu_box=True, pinned="0.32.0", sm120=True, quant="compressed-tensors")
    assert v.status == WARN and "garbled-output screen" in v.advice
    assert gpu.vllm_verdict(info, "", "py", gpu_box=True, sm120=False, quant="compressed-tensors").status == OK
    assert gpu.vllm_verdict(info, "", "py", gpu_box=True, sm120=True, quant=None).status == OK
    assert gpu.vllm_verdict(info, "", "py", gpu_box=True, sm120=True, quant="compressed-tensors",
                            fixed="0.31.0").status == OK  # once a fixed release is known, newer ones pass


# ----------------------------------------------------------------------------- disk

def test_disk_verdict_thresholds():
    GB = files.GB
    assert files.disk_verdict("runs", 100 * GB, None).status == OK
    assert files.disk_verdict("runs", 100 * GB, 50 * GB).status == OK
    assert files.disk_verdict("runs", 100 * GB, 95 * GB).status == WARN  # under 10% to spare
    v = files.disk_verdict("runs", 100 * GB, 120 * GB)
    assert v.status == FAIL and "free 20.0 GB" in v.advice


def test_plan_json_gives_the_need_and_a_bad_one_is_bad_input(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"stages": {}, "disk_total": 123_000_000_000}))
    assert files.plan_bytes(plan) == 123_000_000_000
    (tmp_path / "bad.json").write_text('{"stages": {}}')
    with pytest.raises(PipelineError, match="disk_total"):
        files.plan_bytes(tmp_path / "bad.json")
    assert run_main(main, ["--plan", str(tmp_path / "bad.json"), "--allreduce-procs", "0"]) == 2
    assert run_main(main, ["--plan", str(plan), "--need-gb", "5"]) == 2
    assert run_main(main, ["--allreduce-timeout", "0"]) == 2
    assert files.existing_parent(tmp_path / "a" / "b") == tmp_path


# ----------------------------------------------------------------------------- the model folder

def sharded_model(folder, *, shards=2):
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{s}.w": np.full((64, 32), s, dtype=np.float32), f"layers.{s}.b": np.ones(7, np.float16)}
        save_file(tensors, str(folder / name))
        weight_map |= {k: name for k in tensors}
    (folder / files.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_complete_model_folder_is_ok(tmp_path):
    v = files.model_verdict(sharded_model(tmp_path / "m"))
    assert v.status == OK and v.detail.startswith("2 weight files") and "every tensor of the index" in v.detail


def test_missing_shard_fails_naming_it(tmp_path):
    folder = sharded_model(tmp_path / "m")
    (folder / "model-00002-of-00002.safetensors").unlink()
    v = files.model_verdict(folder)
    assert v.status == FAIL and "model-00002-of-00002.safetensors: missing" in v.detail and "hf download" in v.advice


@pytest.mark.parametrize("keep,says", [(-10, "truncated: "), (0, "empty"), (5, "no header"), (20, "inside its header")])
def test_truncated_shard_fails(tmp_path, keep, says):
    folder = sharded_model(tmp_path / "m")
    shard = folder / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    v = files.model_verdict(folder)
    assert v.status == FAIL and says in v.detail, v.detail
    assert "model-00001" in v.detail and "model-00002" not in v.detail


def test_a_shard_without_a_tensor_its_index_names_fails(tmp_path):
    folder = sharded_model(tmp_path / "m")
    index = json.loads((folder / files.INDEX).read_text())
    index["weight_map"]["layers.9.w"] = "model-00002-of-00002.safetensors"
    (folder / files.INDEX).write_text(json.dumps(index))
    v = files.model_verdict(folder)
    assert v.status == FAIL and "lacks 1 tensor(s)" in v.detail and "layers.9.w" in v.detail


def test_single_file_and_missing_config(tmp_path, llama_target_dir):
    assert files.model_verdict(llama_target_dir).status == OK
    folder = tmp_path / "m"
    shutil.copytree(llama_target_dir, folder)
    (folder / "config.json").unlink()
    assert files.model_verdict(folder).status == FAIL
    assert files.shard_problem(folder / "model.safetensors")[0] is None


# ----------------------------------------------------------------------------- the tokenizer

def test_tiny_tokenizer_is_ok_alone_and_refused_for_a_kimi_target(k25_tokenizer):
    facts = files.tokenizer_facts(k25_tokenizer)
    assert facts["encoded"] == [facts["think_start_id"], *facts["digit"], facts["think_end_id"]]
    assert files.tokenizer_verdict(facts).status == OK
    v = files.tokenizer_verdict(facts, model_type="kimi_k25")
    assert v.status == FAIL and "163606/163607" in v.detail
    v = files.tokenizer_verdict(facts, target_vocab=facts["vocab"] - 1)
    assert v.status == FAIL and "no embedding row" in v.detail


def test_tokenizer_verdict_on_split_think_tokens_and_errors():
    facts = {"vocab": 500, "error": None, "think_start_id": 400, "think_end_id": 401, "end_of_turn_id": 3,
             "eos_id": 2, "text": "<think>2</think>", "digit": [50], "encoded": [60, 61, 62, 50, 400],
             "decoded": "<think>2</think>"}
    assert files.tokenizer_verdict(facts).status == FAIL
    assert files.tokenizer_verdict({**facts, "encoded": [400, 50, 401], "decoded": "2"}).status == FAIL
    assert files.tokenizer_verdict({**facts, "encoded": [400, 50, 401]}).status == OK
    v = files.tokenizer_verdict({"vocab": 500, "error": "the tokenizer has no <think> token: ..."})
    assert v.status == FAIL and "no <think>" in v.detail


# ----------------------------------------------------------------------------- the all-reduce

RESULT = {"world": 8, "backend": "nccl", "bytes": 256_000_000, "iters": 20, "seconds": 2.0, "correct": True}


def test_bus_bandwidth_and_the_worker_output_parse():
    assert allreduce.busbw_gbs(RESULT) == pytest.approx(256e6 / 0.1 * 2 * 7 / 8 / 1e9)  # 4.48 GB/s
    lines = ["[W] some warning", f"{allreduce.READY} 1 4242", f"{allreduce.READY} 0 4241",
             f"{allreduce.RESULT} " + json.dumps(RESULT)]
    assert allreduce.parse_output(lines) == ({1: 4242, 0: 4241}, RESULT)
    # The workers share one pipe: two ranks' words can land on one line (seen from torchrun here).
    glued = [f"{allreduce.READY} 0 29103{allreduce.READY} 1 29104", "",
             "W1202 warning" + f"{allreduce.RESULT} " + json.dumps(RESULT)]
    assert allreduce.parse_output(glued) == ({0: 29103, 1: 29104}, RESULT)


def test_allreduce_verdicts():
    v = allreduce.allreduce_verdict(8, Outcome("ok", RESULT), None, timeout=120, min_busbw=1)
    assert v.status == OK and "bus bandwidth 4.5 GB/s" in v.detail
    assert allreduce.allreduce_verdict(8, Outcome("ok", RESULT), None, timeout=120, min_busbw=5).status == WARN
    wrong = allreduce.allreduce_verdict(8, Outcome("ok", {**RESULT, "correct": False}), None, timeout=120)
    assert wrong.status == FAIL and "wrong" in wrong.detail
    both = allreduce.allreduce_verdict(8, Outcome("hung"), Outcome("hung", p2p_disabled=True), timeout=120)
    assert both.status == FAIL and both.detail.startswith("hung across 8 GPUs (NCCL peer-to-peer?)")
    assert "also hung" in both.detail and "rerun with NCCL_P2P_DISABLE=1, and export it for 02/04/05" in both.advice
    set_already = allreduce.allreduce_verdict(8, Outcome("hung", p2p_disabled=True), None, timeout=120)
    assert set_already.status == FAIL and "already set" in set_already.detail
    assert allreduce.allreduce_verdict(8, Outcome("startup", tail=["x"]), None, timeout=120).status == FAIL


def test_allreduce_on_a_gpu_box_is_skipped_or_refused_before_launching():
    from eagle3_train.preflight.runner import allreduce_check

    cfg = parse_args([])
    assert allreduce_check(cfg, 1).detail == "1 GPU: nothing to all-reduce"
    assert allreduce_check(parse_args(["--allreduce-procs", "0"]), 8).detail == "--allreduce-procs 0"
    assert allreduce_check(cfg, 8, Verdict("driver", FAIL, "old")).detail == "the driver check failed"
    with pytest.raises(PipelineError, match="torch sees 4 GPUs"):
        allreduce_check(parse_args(["--allreduce-procs", "8"]), 4)


def test_hang_is_a_fail_line_and_the_p2p_retry_names_the_fix(monkeypatch):
    """The hook makes the last rank sleep unless NCCL_P2P_DISABLE=1 (what a P2P hang does): the
    first run is killed 5 s after both processes started (their all-reduces take ~0.03 s), the
    retry with the variable runs."""
    monkeypatch.setenv("EAGLE3_PREFLIGHT_HANG", "p2p")
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    v = allreduce.run_allreduce(2, 0.1, 2, 5.0, unit="CPU processes")
    assert v.status == FAIL, v
    assert v.detail.startswith("hung across 2 CPU processes (NCCL peer-to-peer?)"), v.detail
    assert "with NCCL_P2P_DISABLE=1 it ran: 2 x 0 MB over 2 processes (gloo): bus bandwidth" in v.detail
    assert v.advice.startswith("export NCCL_P2P_DISABLE=1 for 02/04/05")


# ----------------------------------------------------------------------------- the command

@no_cuda_here
def test_whole_command_on_this_cpu_machine(tmp_path, kimi_random_twin_dir, capsys):
    """GPU checks skipped, a real 2-process gloo all-reduce, the real vLLM probe, the twin's folder
    and tokenizer; exit 0; the JSON report written."""
    out = tmp_path / "preflight.json"
    argv = ["--model", str(kimi_random_twin_dir), "--work-dir", str(tmp_path / "runs"), "--need-gb", "0.001",
            "--allreduce-procs", "2", "--allreduce-mb", "1", "--allreduce-iters", "3", "--out", str(out)]
    assert run_main(main, argv) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [ln.split()[1].rstrip(":") for ln in lines[:-1]]
    assert names == ["gpus", "driver", "all-reduce", "vllm", "disk", "model", "tokenizer"]
    assert lines[0] == "skipped  gpus: no CUDA device" and lines[1] == "skipped  driver: no CUDA device"
    assert lines[2].startswith("ok       all-reduce: 3 x 1 MB over 2 processes (gloo): bus bandwidth ")
    assert lines[3].split()[0] in (OK, WARN) and lines[4].startswith("ok       disk:")
    assert lines[5].startswith("ok       model: 1 weight file")
    # the twin is a kimi_k25 target: its tokenizer must put the think tokens at Kimi's ids
    assert files.model_type_and_vocab(kimi_random_twin_dir) == ("kimi_k25", 163840)
    assert lines[6] == ("ok       tokenizer: vocab 163,840, <think> 163606, </think> 163607, end of turn 163586, "
                        "EOS 163585")
    rep = json.loads(out.read_text())
    assert rep["exit_code"] == 0 and [c["name"] for c in rep["checks"]] == names


@no_cuda_here
def test_without_allreduce_procs_the_allreduce_is_skipped_and_a_fail_exits_1(tmp_path, capsys, monkeypatch):
    from eagle3_train.preflight.runner import allreduce_check

    # the vLLM probe is not what this test is about (the whole-command test runs it for real)
    monkeypatch.setattr(gpu, "probe_vllm", lambda python: (None, "not probed in this test"))

    assert allreduce_check(parse_args([]), None) == Verdict("all-reduce", SKIPPED, "no CUDA device")
    assert run_main(main, ["--model", str(tmp_path / "nope"), "--allreduce-procs", "0", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["exit_code"] == 1 and {c["name"]: c["status"] for c in rep["checks"]}["model"] == FAIL


def test_verdict_line_and_exit_code():
    v = Verdict("disk", FAIL, "1.0 GB free under runs", "free 5 GB")
    assert v.line() == "fail     disk: 1.0 GB free under runs (free 5 GB)"
    assert exit_code([v]) == 1 and exit_code([Verdict("x", WARN, "y"), Verdict("z", SKIPPED, "w")]) == 0
    with pytest.raises(ValueError):
        Verdict("x", "bad", "y")
