"""The device profile: what only CUDA shows, on the lent GPU machine as it is (scripts/gpu_check.py
--profile device calls this; --dry-run runs every step's code on CPU at tiny sizes).

    python3 scripts/gpu_check.py --profile device --out OUT [--budget-s 330] [--only 04-mla,flex]
    python3 scripts/gpu_check.py --profile device --dry-run --out DIR     # CPU, tiny sizes
    python3 scripts/gpu_check.py --make-kit                               # here, before a lease

The lent machine has python3 with torch 2.11 and no network, no uv, no vLLM, no speculators, and
only the working tree plus up to 8 ignored paths travel there (64 MiB in all). So this file puts
eagle3-train/ and the device kit (.cache/device-kit: pure-Python wheels as zip files, compiled ones
unpacked, made here by --make-kit with `pip download --no-deps`) on sys.path itself, before the
image's own packages, and imports nothing else from outside the machine.

Steps, in order, each cut at its own budget with what it had measured so far recorded:

  env         the device, torch, the shared memory per block, the kit's versions
  02-hf       02's hf backend on CUDA over a tiny random Llama: fp32 = a plain forward, bf16 close
  kimi-inputs a random DeepSeek-V3 target at Kimi-K2.5's width (hidden 7168) and MLA head sizes (64
              heads, q/k 192, v 128), a few synthetic samples, 02 hf on CUDA (bf16), 03
  04-mla      04's MLA draft on them, bf16, CUDA defaults (compiled flex + fused KL): step time,
              tokens/s and peak memory as ratios to 00's per-GPU figures (plan/planner.py)
  04-eager    the same batches with sdpa + the eager KL: the loss trajectories agree, the speed-up
  04-dflash   04's DFlash block draft at the same width: step time, tokens/s, peak memory vs 00
  flex        compiled flex at Kimi's head sizes: the shared-memory chooser's pick (train/flex.py)
              and each rung of its ladder, timed
  resume      04 killed (SIGKILL) after a checkpoint and rerun: losses and export bitwise equal to
              an uninterrupted run on CUDA (CUDA RNG state in the checkpoint)
  fsdp        04 --distributed fsdp under torchrun on one rank
  02-vllm, 05 need GPU vLLM: `skipped: no vLLM here` unless it imports

Writes OUT/gpu_profile.json after every step and OUT/gpu_profile.md (a table) at the end.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / ".cache" / "device-kit"
TREE_LIMIT = 64 * 2**20  # the run tool's working tree + carried paths
# What the profile imports and the lent image ('cuda', /work/.library/device/KINDS.md's package list)
# lacks, read off the import chain of 04's drafts, 02's hf backend and speculators 0.9.0 in the repo's
# venv, pinned as uv.lock pins them; transformers too, for the repo's 5.19 (the image has 5.17).
# `pure`: a py3 wheel carried as a zip on sys.path; else a CPython 3.12 manylinux wheel, unpacked (the
# image's python is 3.12). A bare torch + numpy image would lack far more: speculators imports datasets,
# hence pyarrow and pandas (BARE_ONLY), and pyarrow's wheel alone is most of the 64 MiB.
WHEELS = (
    ("speculators", "0.9.0", True), ("hs-connectors", "0.9.0", True), ("transformers", "5.19.0", True),
    ("datasets", "5.1.0", True), ("dill", "0.4.1", True), ("multiprocess", "0.70.19", True),
    ("openai", "3.57.0", True), ("jiter", "0.19.0", False), ("sniffio", "1.3.1", True),
    ("httpx2", "2.16.2", True), ("httpcore2", "2.16.2", True), ("truststore", "0.10.5", True),
    ("pydantic", "2.14.4", True), ("pydantic-core", "2.50.5", False), ("pydantic-settings", "2.16.3", True),
    ("python-dotenv", "1.2.4", True), ("typing-inspection", "0.4.5", True), ("annotated-types", "0.8.0", True),
    ("typing-extensions", "4.16.0", True), ("loguru", "0.7.3", True),
)
# the models transformers keeps in the kit: those the repo and speculators 0.9.0 import by name
TRANSFORMERS_MODELS = ("auto", "llama", "qwen2", "qwen3", "qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_k25",
                       "deepseek_v2", "deepseek_v3", "gemma3")
BARE_ONLY = (("pyarrow", "26.0.1"), ("pandas", "3.1.1"), ("tokenizers", "0.23.3"), ("huggingface-hub", "2.4.0"),
             ("safetensors", "0.8.0"), ("aiohttp", "3.14.5"), ("regex", "2026.11.19"), ("pyyaml", "6.0.4"))
# Bytes the kit takes as made here (--make-kit; tests/test_gpu_check.py checks the sum against a lease's
# 64 MiB without the network); kit.json records the real sizes once made.
KIT_BYTES = 27_619_268  # 20 wheels, made 2026-12-05
STEPS = {  # name: (budget s on one H100, what it shows); the whole profile stays under 6 minutes
    "env": (30, "device, torch, shared memory per block, kit versions (speculators' import: 5-15 s)"),
    "02-hf": (30, "02 hf on CUDA over a tiny Llama: fp32 = plain forward, bf16 close"),
    "kimi-inputs": (40, "a random DeepSeek-V3 target at hidden 7168 / Kimi's MLA heads, 02 hf (bf16), 03"),
    "04-dflash": (40, "04 DFlash draft at hidden 7168: step s, tok/s, peak GiB vs 00's figures"),
    "04-mla": (45, "04 MLA draft, bf16, flex + fused KL: step s, tok/s, peak GiB vs 00's figures"),
    "04-eager": (30, "the same with sdpa + eager KL: loss trajectories agree, speed-up of the fused path"),
    "flex": (30, "compiled flex at q/k 192, v 128: the shared-memory chooser's pick, each rung timed"),
    "resume": (60, "04 SIGKILLed after a checkpoint, rerun: losses and export bitwise = uninterrupted"),
    "fsdp": (30, "04 --distributed fsdp under torchrun, one rank (sdpa + eager: no compile in the budget)"),
    "02-vllm": (0, "02 --backend vllm (needs GPU vLLM)"),
    "05": (0, "05 online in vLLM (needs GPU vLLM)"),
}
VLLM_STEPS = {"02-vllm", "05"}
BUDGET_S = 335  # one H100: the steps' sum, so the profile and a rerun fit one 15-minute lease
KIMI = {"hidden": 7168, "heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128}
TINY = {"hidden": 128, "heads": 2, "q_lora_rank": 32, "kv_lora_rank": 512, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 64, "v_head_dim": 16}  # --dry-run: MLA's fixed latent, small elsewhere
DRY_SCALE = 10  # --dry-run: a shared CPU at tiny sizes is no faster than an H100 at Kimi's
PER_GPU_TOK_S = 5000.0  # plan/planner.py RATES["04"]: 8 GPUs x ~5,000 tok/s (assumed)


# ----------------------------------------------------------------------------- the kit

def kit_paths(kit: Path = KIT) -> list[Path]:
    """What goes on sys.path from the kit: its unpacked folders, then each pure wheel (zip)."""
    if not kit.is_dir():
        return []
    return [d for d in (kit / "transformers", kit / "site") if d.is_dir()] + sorted(kit.glob("*.whl"))


def bootstrap(kit: Path = KIT, *, need_kit: bool | None = None) -> list[str]:
    """eagle3-train/ first on sys.path, and the kit before the image's own packages (its transformers
    5.17 would otherwise win over the repo's 5.19) where speculators is not importable: the device
    machine. Under uv (speculators installed) the kit stays off: its compiled wheels are for 3.12."""
    import importlib.util

    global BOOTED
    if BOOTED is not None and need_kit is None:
        return BOOTED  # the first call's paths (speculators may import from the kit by now)
    if need_kit is None:
        need_kit = importlib.util.find_spec("speculators") is None
    paths = [str(REPO / "eagle3-train"), *(map(str, kit_paths(kit)) if need_kit else ())]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    BOOTED = paths
    return paths


BOOTED: list[str] | None = None  # what bootstrap() put on sys.path (04's child processes get it too)


def make_kit(kit: Path = KIT, python: str = sys.executable) -> dict:
    """`pip download --no-deps` each wheel of WHEELS for CPython 3.12 on x86-64 Linux; keep the pure
    ones as zips, unpack the compiled ones into kit/site; write kit.json (name, file, bytes)."""
    wheels = kit / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, version, pure in WHEELS:
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheels),
               "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
               "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", f"{name}=={version}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        norm = name.replace("-", "_").lower()
        whl = next(p for p in wheels.glob("*.whl") if p.name.lower().startswith(f"{norm}-{version}-"))
        if name == "transformers":  # it lists its own models/ folder at import: unpacked, pruned
            with zipfile.ZipFile(whl) as z:
                z.extractall(kit / "transformers", [m for m in z.namelist() if keep_transformers_file(m)])
        elif pure:
            dst = kit / whl.name
            dst.write_bytes(whl.read_bytes())
        else:
            with zipfile.ZipFile(whl) as z:
                z.extractall(kit / "site")
        rows.append({"name": name, "version": version, "pure": pure, "wheel": whl.name,
                     "bytes": whl.stat().st_size})
    for whl in wheels.glob("*.whl"):
        whl.unlink()
    wheels.rmdir()
    (kit / "kit.json").write_text(json.dumps(rows, indent=1) + "\n")
    return {"bytes": dir_bytes(kit), "wheels": rows}


def keep_transformers_file(member: str) -> bool:
    """transformers' files less the modeling code of the models this repo and speculators never use
    (48 MiB unpacked, 14 without): the wheel cannot be a zip on sys.path (it lists models/ at import,
    NotADirectoryError), and every model's package, config and tokenizer stay (transformers' own
    modules import them by name)."""
    parts = member.split("/")
    if len(parts) > 3 and parts[:2] == ["transformers", "models"] and parts[2] not in TRANSFORMERS_MODELS:
        return parts[3] == "__init__.py" or parts[3].startswith(("configuration_", "tokenization_"))
    return True


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def tree_bytes(repo: Path = REPO) -> int:
    """What the run tool carries besides the carried paths: tracked files (as they are now, deleted
    ones skipped) and untracked files git does not ignore."""
    def listed(*extra: str) -> list[str]:
        out = subprocess.run(["git", "ls-files", "-z", *extra], cwd=repo, capture_output=True, check=True)
        return [p for p in out.stdout.decode().split("\0") if p]

    files = set(listed()) | set(listed("--others", "--exclude-standard"))
    return sum((repo / f).stat().st_size for f in files if (repo / f).is_file())


def kit_bytes(kit: Path = KIT) -> int:
    """The kit as made (on disk), else as measured when it was last made here (KIT_BYTES)."""
    return dir_bytes(kit) if (kit / "kit.json").exists() else KIT_BYTES


# ----------------------------------------------------------------------------- the steps

class Cut(BaseException):
    """A step ran past its budget (raised from SIGALRM; a BaseException, so no step's own handler eats it)."""


def _alarm(signum, frame):
    raise Cut()


def vllm_here() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def sync(ctx) -> None:
    import torch

    if ctx["device"] == "cuda":
        torch.cuda.synchronize()


def step_env(ctx, res) -> None:
    import torch

    res |= {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda,
            "kit": [Path(p).name for p in ctx["paths"][1:]]}
    from importlib.metadata import version

    for mod in ("speculators", "transformers", "datasets", "safetensors", "tokenizers", "pydantic"):
        try:
            m = __import__(mod)
            res[mod] = f"{version(mod)} from {Path(m.__file__).parent.parent.name}"
        except Exception as e:  # noqa: BLE001 -- recorded: this is what the step is for
            res[mod] = f"missing: {type(e).__name__}: {e}"
    if ctx["device"] == "cuda":
        from eagle3_train.train import flex

        cap, smem, name = flex.device_limits(0)
        res |= {"gpu": name, "capability": list(cap), "smem_per_block": smem,
                "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    res["ok"] = not any(str(v).startswith("missing") for v in res.values())


def step_02_hf(ctx, res) -> None:
    import gpu_check as gc
    from eagle3_testkit.fixtures import random_target_dir

    target, work = random_target_dir("llama"), ctx["work"]
    inp_dir = work / "in-llama"
    inp = gc.token_set(inp_dir, target, 4 if ctx["dry"] else 16, 32, 128 if ctx["dry"] else 512)
    res |= gc.check_hf("llama", target, inp_dir, inp, work, ctx["device"])


def kimi_target(out: Path, dims: dict, layers: int, device: str) -> Path:
    """A random DeepSeek-V3 target at `dims` (Kimi-K2.5's MLA head sizes and width), bf16: the draft reads
    its config, norm and lm_head; its layers only make 02's states."""
    import torch
    from eagle3_testkit.fixtures import tokenizer_dir
    from eagle3_testkit.tiny import deepseek_v3_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("k25"))
    cfg = deepseek_v3_config(tok, hidden=dims["hidden"], layers=layers, head_dim=dims["qk_nope_head_dim"])
    cfg.num_attention_heads = cfg.num_key_value_heads = dims["heads"]
    cfg.q_lora_rank, cfg.v_head_dim = dims["q_lora_rank"], dims["v_head_dim"]
    torch.manual_seed(0)
    with torch.device(device):  # ~400M random parameters: initialised on the GPU, in a second
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def step_kimi_inputs(ctx, res) -> None:
    from eagle3_testkit.fixtures import synthetic_training_set
    from eagle3_train.extract.cli import main as extract_main
    from eagle3_train.vocab.cli import main as vocab_main

    work, dims = ctx["work"] / "kimi", ctx["dims"]
    t = time.perf_counter()
    target = kimi_target(work / "target", dims, layers=4, device=ctx["device"])
    res["target_s"] = round(time.perf_counter() - t, 1)
    data = synthetic_training_set(work / "data", target, n=ctx["samples"], seed=0)
    cuda = ctx["device"] == "cuda"
    t = time.perf_counter()
    extract_main(["--input", str(data), "--model", str(target), "--output-dir", str(work / "02"), "--backend", "hf",
                  "--device", ctx["device"], "--dtype", "bfloat16" if cuda else "float32", "--storage", "bf16"])
    res["extract_s"] = round(time.perf_counter() - t, 1)
    vocab_main(["--data", str(data), "--target", str(target), "--output-dir", str(work / "03"),
                "--draft-vocab-size", "256"])
    ctx["kimi"] = {"target": target, "hs": work / "02", "vocab": work / "03"}
    res |= {"dims": dims, "samples": ctx["samples"], "ok": True}


def train_argv(ctx, out: Path, extra: list[str], steps: int) -> list[str]:
    k = ctx["kimi"]
    ttt = [] if "dflash" in extra else ["--ttt-steps", "3"]  # a block draft takes no unroll flags
    return ["--hidden-states", str(k["hs"]), "--vocab-mapping", str(k["vocab"]), "--target", str(k["target"]),
            "--out", str(out), "--max-tokens-per-batch", str(ctx["max_tokens"]), *ttt,
            "--max-steps", str(steps), "--epochs", "50", "--val-fraction", "0.1", "--save-every", str(steps),
            "--log-every", "1", "--lr", "3e-4", "--device", ctx["device"], "--quiet", "--loss", "kl", *extra]


def fast_flags(ctx) -> list[str]:
    """The CUDA defaults (compiled flex + fused KL); on CPU (--dry-run) the only kernels it has."""
    return [] if ctx["device"] == "cuda" else ["--attn", "sdpa", "--loss-impl", "eager"]


def train(ctx, res, name: str, extra: list[str]) -> dict:
    """One 04 run in this process; its figures go into `res` as they come (a cut keeps them)."""
    import torch
    from eagle3_train.train import run
    from eagle3_train.train.cli import parse_args as train_args
    from eagle3_train.train.metrics import read_metrics

    out = ctx["work"] / name
    if ctx["device"] == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    run(train_args(train_argv(ctx, out, extra, ctx["steps"])))
    res["wall_s"] = round(time.perf_counter() - t, 1)
    recs = read_metrics(out)["train"]
    timed = recs[2:] or recs  # the first two steps compile
    secs = [r["tokens"] / r["tokens_per_s"] for r in timed]
    res |= {"steps": len(recs), "losses": [r["loss"] for r in recs], "step_s": statistics.median(secs),
            "tokens_per_s": sum(r["tokens"] for r in timed) / sum(secs)}
    if ctx["device"] == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    info = out / "export" / "training_info.json"
    if info.exists():  # what flex.setup chose on this GPU (None: torch's defaults fit)
        res["flex_options"] = json.loads(info.read_text()).get("flex_options", "absent")
    res["tokens_per_s_over_planner"] = res["tokens_per_s"] / PER_GPU_TOK_S
    return res


def planned_gib(ctx, arch: str) -> float:
    """00's per-GPU memory for this draft and batch (plan/draft.py train_memory's total)."""
    from eagle3_train.plan import planner

    k = ctx["kimi"]
    shape = planner.Shape.from_config(json.loads((k["target"] / "config.json").read_text()))
    flags = planner.Flags(samples=ctx["samples"], tokens_per_sample=200, storage="bf16", draft_vocab_size=256,
                          max_tokens_per_batch=ctx["max_tokens"], ttt_steps=3, draft_arch=arch,
                          attn="flex" if ctx["device"] == "cuda" else "sdpa", act_bytes=2)
    return planner.train_memory(shape, flags)["total"] / 2**30


def step_04(arch: str, extra: list[str]):
    def step(ctx, res) -> None:
        res["planned_gib"] = planned_gib(ctx, arch)
        train(ctx, res, f"04-{arch}", ["--draft-arch", arch, *extra, *fast_flags(ctx)])
        if "peak_gib" in res:
            res["peak_over_planned"] = res["peak_gib"] / res["planned_gib"]
        res["ok"] = all(math.isfinite(x) for x in res["losses"])
    return step


def step_04_eager(ctx, res) -> None:
    from gpu_check import trajectories_agree

    train(ctx, res, "04-eager", ["--draft-arch", "mla", "--attn", "sdpa", "--loss-impl", "eager"])
    fast = ctx["results"].get("04-mla", {})
    if fast.get("losses"):
        res |= trajectories_agree(fast["losses"], res["losses"])
        res["fast_over_eager_tokens_per_s"] = fast["tokens_per_s"] / res["tokens_per_s"]
        res["ok"] = res.pop("agree")
    else:
        res["ok"], res["error"] = False, "04-mla left no losses to compare"


def step_flex(ctx, res) -> None:
    """The chooser's pick at q/k 192, v 128 (bf16) and each rung run and timed (CUDA only)."""
    import torch
    from eagle3_train.train import flex
    from eagle3_train.train.draft_core import use_compiled_flex

    qk, v = KIMI["qk_nope_head_dim"] + KIMI["qk_rope_head_dim"], KIMI["v_head_dim"]
    if ctx["device"] == "cuda":
        cap, smem, _ = flex.device_limits(0)
    else:
        cap, smem = (9, 0), 232448  # an H100's, so the ladder's arithmetic runs here
    rungs = flex.ladder(cap, smem, qk, v, 2)
    res |= {"capability": list(cap), "smem_per_block": smem, "ladder": [flex.describe(r) for r in rungs],
            "rungs": []}
    if ctx["device"] != "cuda":
        res["ok"] = bool(rungs)
        return
    for opts in rungs:
        row = {"options": flex.describe(opts)}
        res["rungs"].append(row)
        try:
            use_compiled_flex(opts)
            fb = flex.probe(qk, v, torch.bfloat16, "cuda", tokens=ctx["max_tokens"])
            fb()  # compiles
            t = time.perf_counter()
            for _ in range(5):
                fb()
            row["ms"] = (time.perf_counter() - t) / 5 * 1e3
        except Exception as e:  # noqa: BLE001 -- a rung that does not fit is a figure here
            row["error"] = flex.short(e)
    res["chosen"] = next((r["options"] for r in res["rungs"] if "ms" in r), None)
    res["ok"] = res["chosen"] == res["ladder"][0]  # the estimate's pick runs


def env_for_children(ctx) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*ctx["paths"], os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def step_resume(ctx, res) -> None:
    """SIGKILL 04 after its first checkpoint, rerun the same command: bitwise the uninterrupted run."""
    import torch
    from eagle3_train.train import run
    from eagle3_train.train.cli import parse_args as train_args
    from eagle3_train.train.metrics import read_metrics
    from safetensors.torch import load_file

    steps = min(ctx["steps"], 6)  # the child imports and compiles again: few steps
    # one CPU thread in every run of the three: a CPU op's sums follow the thread count, and the
    # child process would otherwise take another count than this one (bitwise is the point)
    flags = ["--draft-arch", "mla", *fast_flags(ctx), "--save-every", "2", "--keep-last", "1", "--threads", "1"]
    ref, out = ctx["work"] / "resume-ref", ctx["work"] / "resume"
    threads = torch.get_num_threads()
    run(train_args(train_argv(ctx, ref, flags, steps)))
    res["reference_done"] = True
    argv = train_argv(ctx, out, flags, steps)
    proc = subprocess.Popen([sys.executable, str(REPO / "eagle3-train" / "04_train.py"), *argv],
                            env=env_for_children(ctx), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        while proc.poll() is None and not any((out / "checkpoints").glob("step-*/COMPLETE")):
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    res["killed"] = proc.returncode == -signal.SIGKILL
    if not res["killed"]:
        res["child_stderr"] = proc.stderr.read().decode(errors="replace")[-1500:]
    run(train_args(argv))
    torch.set_num_threads(threads)
    a, b = read_metrics(ref)["train"], read_metrics(out)["train"]
    res["losses_equal"] = [r["loss"] for r in a] == [r["loss"] for r in b]
    wa, wb = load_file(str(ref / "export" / "model.safetensors")), load_file(str(out / "export" / "model.safetensors"))
    res["weights_equal"] = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    res["ok"] = bool(res["killed"] and res["losses_equal"] and res["weights_equal"])


def step_fsdp(ctx, res) -> None:
    out = ctx["work"] / "fsdp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(REPO / "eagle3-train" / "04_train.py"),
           *train_argv(ctx, out, ["--draft-arch", "mla", "--distributed", "fsdp", "--attn", "sdpa",
                                  "--loss-impl", "eager"], 3)]
    p = subprocess.run(cmd, env=env_for_children(ctx), capture_output=True, text=True, check=False)
    res["exit_code"] = p.returncode
    if p.returncode:
        res["stderr_tail"] = p.stderr[-1500:]
    res["ok"] = p.returncode == 0 and (out / "export" / "config.json").exists()


def step_vllm(ctx, res) -> None:
    res["ok"] = False
    res["error"] = "vLLM imports here: run `scripts/gpu_check.py --only 02-twin,05` for the vLLM steps"


RUN = {"env": step_env, "02-hf": step_02_hf, "kimi-inputs": step_kimi_inputs,
       "04-dflash": step_04("dflash", []), "04-mla": step_04("mla", []), "04-eager": step_04_eager,
       "flex": step_flex, "resume": step_resume, "fsdp": step_fsdp, "02-vllm": step_vllm, "05": step_vllm}
NEEDS_KIMI = {"04-mla", "04-eager", "04-dflash", "resume", "fsdp"}


# ----------------------------------------------------------------------------- the run

def table(result: dict) -> str:
    """The short markdown table of gpu_profile.md."""
    keys = ("step_s", "tokens_per_s", "tokens_per_s_over_planner", "peak_gib", "planned_gib", "peak_over_planned",
            "fast_over_eager_tokens_per_s", "loss_rel_gap_max", "chosen", "flex_options", "bf16_max_rel_err")
    lines = [f"# GPU profile: {result.get('device')} (torch {result.get('torch')})", "",
             "| step | result | s | figures |", "|---|---|---|---|"]
    for name, r in result["steps"].items():
        state = r.get("state", "?")
        figs = ", ".join(f"{k} {r[k]:.3g}" if isinstance(r[k], float) else f"{k} {r[k]}"
                         for k in keys if r.get(k) is not None)
        why = r.get("skipped") or r.get("error") or ""
        lines.append(f"| {name} | {state} | {r.get('wall_s', 0)} | {'; '.join(x for x in (figs, why[:160]) if x)} |")
    return "\n".join(lines) + "\n"


def run_profile(args, paths: list[str]) -> int:
    import torch

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        print("error: --profile device: no CUDA device here; add --dry-run to run its steps on CPU at tiny sizes",
              file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ctx = {"device": device, "dry": dry, "paths": paths, "work": Path(tempfile.mkdtemp(prefix="gpu_profile-")),
           "dims": TINY if dry else KIMI, "samples": 6 if dry else 24, "max_tokens": 256 if dry else 4096,
           "steps": 4 if dry else 12, "results": {}}
    result = {"device": torch.cuda.get_device_name(0) if not dry else "cpu (dry run)", "torch": torch.__version__,
              "budget_s": args.budget_s, "steps": ctx["results"]}

    def save() -> None:
        result["elapsed_s"] = round(time.monotonic() - t0, 1)
        (out / "gpu_profile.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    signal.signal(signal.SIGALRM, _alarm)
    scale = DRY_SCALE if dry else 1
    for name in args.steps:
        res: dict = {}
        ctx["results"][name] = res
        budget = STEPS[name][0] * scale
        if name in VLLM_STEPS and not vllm_here():
            res |= {"state": "skipped", "skipped": "no vLLM here"}
        elif name in NEEDS_KIMI and "kimi" not in ctx:
            res |= {"state": "skipped", "skipped": "needs kimi-inputs"}
        elif time.monotonic() - t0 + budget > args.budget_s * scale:
            res |= {"state": "skipped", "skipped": f"the profile's budget ({args.budget_s:.0f} s) would be exceeded"}
        if "state" in res:
            print(f"{name}: skipped: {res['skipped']}", flush=True)
            save()
            continue
        t = time.monotonic()
        signal.alarm(max(1, int(budget)))
        try:
            RUN[name](ctx, res)
            res["state"] = "ok" if res.get("ok") else "failed"
        except Cut:
            res |= {"state": "cut", "error": f"cut at its budget of {budget} s (figures so far kept)"}
        except Exception as e:  # noqa: BLE001 -- recorded; the other steps still say something
            res |= {"state": "failed", "error": f"{type(e).__name__}: {str(e)[:300]}",
                    "traceback": traceback.format_exc()[-2000:]}
        finally:
            signal.alarm(0)
        res["wall_s"] = round(time.monotonic() - t, 1)
        print(f"{name}: {res['state']} in {res['wall_s']} s", flush=True)
        save()
    states = [r["state"] for r in ctx["results"].values()]
    result["ok"] = "failed" not in states and "cut" not in states
    save()
    (out / "gpu_profile.md").write_text(table(result))
    print(f"{'OK' if result['ok'] else 'FAILED'}: {out / 'gpu_profile.json'}, {out / 'gpu_profile.md'}", flush=True)
    return 0 if result["ok"] else 1


def make_kit_cli() -> int:
    made = make_kit()
    total = made["bytes"] + tree_bytes()
    print(f"device kit: {KIT} ({made['bytes'] / 2**20:.1f} MiB, {len(made['wheels'])} wheels); with the "
          f"working tree {total / 2**20:.1f} MiB of the run tool's {TREE_LIMIT / 2**20:.0f} MiB")
    if total > TREE_LIMIT:
        print("error: the device kit and the working tree exceed the run tool's 64 MiB: carry fewer wheels",
              file=sys.stderr)
        return 2
    return 0


def main(args) -> int:
    """args: gpu_check's parsed arguments (profile, make_kit, dry_run, out, budget_s, steps)."""
    if args.make_kit:
        return make_kit_cli()
    return run_profile(args, bootstrap())  # (already on sys.path: gpu_check bootstrapped it)
