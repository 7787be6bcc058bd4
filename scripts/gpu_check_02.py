"""GPU check for 02_extract_hidden_states: run on a CUDA machine, self-contained, < 2 minutes.

  python scripts/gpu_check_02.py [--out DIR] [--budget-s 110]

  1. hf backend on CUDA, tiny Llama and tiny DeepSeek-V3 (MLA + MoE): fp32 extraction equals a
     plain HF forward (id i = input of layer i, id N = pre-norm), bf16 extraction is close to it.
  2. throughput: extraction tok/s / plain forward tok/s (goal >= 0.9) on a 136M-parameter random
     Llama (hidden 1024, 12 layers) and on the tiny Llama, for bf16 / fp8 / fp8-topk.
  3. vllm backend, if vLLM is importable ($EAGLE3_VLLM_PYTHON, .venv-vllm, or this python): the stage
     launches vLLM with extract_hidden_states + ExampleHiddenStatesConnector and its store must match
     the hf backend's (bf16 tolerance); records tok/s. Llama first, then DeepSeek-V3 (MLA; vLLM
     0.32's connector warns "MLA verifiers are unsupported") while the time budget lasts.
Writes gpu_check_02.json (to --out, default $OUT or .) and exits 1 if a correctness check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
T0 = time.monotonic()
DEVICE = "cuda"  # --device cpu runs the same steps on CPU, smaller (a smoke test of this script)


def elapsed() -> float:
    return time.monotonic() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def stage_main(argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("stage02", REPO / "eagle3-train" / "02_extract_hidden_states.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


def make_set(directory: Path, model_dir: Path, n: int, lo: int, hi: int):
    from bench_extract import make_input
    from eagle3_train.common.manifest import describe_tokenizer
    from eagle3_train.common.target import target_info
    from eagle3_train.common.tokenization import load_tokenizer

    _, cfg = target_info(str(model_dir))
    tok = describe_tokenizer(load_tokenizer(str(model_dir)), str(model_dir))
    return make_input(directory, cfg.vocab_size, n, lo, hi, tokenizer=tok)


@torch.inference_mode()
def reference(model_dir, ids, dtype):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
    m.config.tie_last_hidden_states = False  # hidden_states[N] = before the final norm
    out = m(torch.tensor([ids], device=DEVICE), output_hidden_states=True)
    hs = [h[0].float().cpu() for h in out.hidden_states]
    del m, out
    empty_cache()
    return hs


def empty_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def check_hf(arch, model_dir, inp_dir, inp, work) -> dict:
    from eagle3_train.common import hidden_store as hs

    res = {"arch": arch}
    common = ["--input", str(inp_dir), "--model", str(model_dir), "--device", DEVICE, "--shard-mb", "4"]
    stage_main([*common, "--output", str(work / f"hf32-{arch}"), "--dtype", "float32", "--storage", "fp32"])
    stage_main([*common, "--output", str(work / f"hf16-{arch}"), "--dtype", "bfloat16", "--storage", "bf16"])
    s32, s16 = hs.HiddenStates(work / f"hf32-{arch}"), hs.HiddenStates(work / f"hf16-{arch}")
    ids = s32.layer_ids
    worst32, worst16 = 0.0, 0.0
    for sid in inp.ids[:3]:
        a, b = s32.get(sid), s16.get(sid)
        ref = reference(model_dir, a.input_ids.tolist(), torch.float32)
        for j, i in enumerate(ids[:-1]):
            worst32 = max(worst32, float((a.aux[:, j] - ref[i]).abs().max()))
            worst16 = max(worst16, rel_err(b.aux[:, j], ref[i]))
        worst32 = max(worst32, float((a.last - ref[ids[-1]]).abs().max()))
        worst16 = max(worst16, rel_err(b.last, ref[ids[-1]]))
    res |= {"fp32_max_abs_diff": worst32, "bf16_max_rel_err": worst16,
            "ok": worst32 < 2e-3 and worst16 < 3e-2}
    return res


def bench(model_dir, name, work, samples, lo, hi, batch_tokens) -> list[dict]:
    from bench_extract import bench_target
    from eagle3_train.common.target import target_info

    _, cfg = target_info(str(model_dir))
    inp = make_set(work / f"bench-in-{name}", model_dir, samples, lo, hi)
    out = []
    for storage in ("bf16", "fp8", "fp8-topk"):
        r = bench_target(model_dir, inp, storage=storage, device=DEVICE,
                         dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32,
                         batch_tokens=batch_tokens, topk=32, rounds=3, work=work / "bench-work", shard_mb=64)
        r["name"] = name
        log(f"bench {name} {storage}: plain {r['plain_tok_s']:.0f} tok/s, extract {r['extract_tok_s']:.0f} tok/s, "
            f"ratio {r['ratio']:.3f}")
        out.append(r)
        empty_cache()
    return out


def vllm_available() -> str | None:
    from eagle3_train.common.vllm_server import vllm_python

    py = vllm_python()
    ok = subprocess.run([py, "-c", "import vllm"], capture_output=True).returncode == 0
    return py if ok else None


def check_vllm(arch, model_dir, inp_dir, inp, work, *,
               vllm_args: str = "--enforce-eager --gpu-memory-utilization 0.4") -> dict:
    """02 --backend vllm --launch-server in bf16 vs the hf backend's bf16 store work/hf16-<arch>."""
    from eagle3_train.common import hidden_store as hs

    out = work / f"vllm-{arch}"
    t = time.monotonic()
    res = {"arch": arch}
    try:
        stage_main(["--input", str(inp_dir), "--model", str(model_dir), "--output", str(out), "--backend", "vllm",
                    "--launch-server", "--dtype", "bfloat16", "--storage", "bf16", "--concurrency", "64",
                    "--vllm-args", vllm_args])
    except BaseException as e:  # record, keep going: this is what the check is for
        res |= {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "server_log_tail": _tail(out / "vllm-server.log")}
        return res
    res["stage_wall_s_incl_server_start"] = time.monotonic() - t
    last = [ln for ln in (out / "progress.log").read_text().splitlines() if " 02 extract " in ln][-1]
    res["progress_line"] = last
    a, b = hs.HiddenStates(work / f"hf16-{arch}"), hs.HiddenStates(out)
    worst = 0.0
    for sid in inp.ids[:8]:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.input_ids, y.input_ids)
        worst = max(worst, rel_err(y.aux, x.aux), rel_err(y.last, x.last))
    res |= {"max_rel_err_vs_hf_bf16": worst, "ok": worst < 5e-2}
    return res


def _tail(path: Path, n: int = 15) -> list[str]:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if "leaked" not in ln]
        errs = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errs or lines)[-n:]
    except OSError:
        return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="where to write the JSON")
    p.add_argument("--budget-s", type=float, default=110, help="skip optional steps past this (default: 110)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a small smoke run of this script")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    small = DEVICE == "cpu"
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: this is the GPU check (tests/test_extract*.py are its CPU twins; "
              "--device cpu smoke-runs this script)")
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tempfile

    from eagle3_testkit.fixtures import random_target_dir, tokenizer_dir
    from eagle3_testkit.tiny import build_random_target

    result = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "hf": [], "bench": [], "vllm": []}
    work = Path(tempfile.mkdtemp(prefix="gpu_check_02-"))
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every step, so a run cut short by a timeout still leaves its figures
        result["elapsed_s"] = elapsed()
        (args.out / "gpu_check_02.json").write_text(json.dumps(result, indent=2, default=str))

    targets = {"llama": random_target_dir("llama"), "deepseek_v3": random_target_dir("deepseek_v3")}
    log(f"fixtures ready on {result['device']}")
    sets = {}
    for arch, model_dir in targets.items():
        sets[arch] = (work / f"in-{arch}", make_set(work / f"in-{arch}", model_dir, 8 if small else 48, 32,
                                                     128 if small else 512))
        try:
            r = check_hf(arch, model_dir, *sets[arch], work)
        except Exception as e:
            r = {"arch": arch, "ok": False, "error": traceback.format_exc(limit=3)}
            log(f"hf {arch} failed: {e}")
        result["hf"].append(r)
        save()
        log(f"hf {arch}: {json.dumps({k: v for k, v in r.items() if k != 'error'})}")

    if small:
        result["bench"] += bench(targets["llama"], "llama-tiny", work, 8, 32, 128, 4096)
    else:
        medium = build_random_target(work / "llama-136m", "llama", tokenizer_dir("k25"), hidden=1024, layers=12,
                                     heads=16, kv_heads=4, intermediate=2816)
        log("built a 136M random Llama for the throughput ratio")
        result["bench"] += bench(medium, "llama-136m", work, 128, 256, 2048, 65536)
        result["bench"] += bench(targets["llama"], "llama-tiny", work, 128, 256, 2048, 65536)
    save()

    py = None if small else vllm_available()
    result["vllm_python"] = py
    if py is None:
        log("vLLM not importable: vllm backend not checked")
    for arch in ("llama", "deepseek_v3") if py else ():
        if elapsed() > args.budget_s - 45:
            log(f"time budget reached: vllm {arch} not checked")
            result["vllm"].append({"arch": arch, "skipped": "time budget"})
            continue
        empty_cache()
        r = check_vllm(arch, targets[arch], *sets[arch], work)
        result["vllm"].append(r)
        save()
        log(f"vllm {arch}: {json.dumps(r)[:600]}")

    ok = all(r.get("ok") for r in result["hf"]) and all(r.get("ok", True) for r in result["vllm"])
    result["ok"] = ok
    save()
    log(f"{'OK' if ok else 'FAILED'}; results in {args.out / 'gpu_check_02.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
