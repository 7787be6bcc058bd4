#!/usr/bin/env python3
"""What Triton allocates in shared memory for torch's flex attention kernels on a given GPU target,
measured on a machine WITHOUT a GPU (issue 25; the table in tests/test_flex.py).

    python flex_smem.py [--qk 192] [--v 128] [--arch 120] [--bwd 64,64,64,64,1,4 ...] [--fwd 64,64,3,4 ...]

How: inductor renders the flex forward/backward Triton templates for the draft's document mask
(speculators' create_combined_mask_mod) on CPU tensors with cpu_backend="triton" (CPU flex has no
backward, and no Triton template forward: both guards are bypassed for this capture only, and the
kernels are never run: the outputs are garbage), the rendered kernel source is read back from the
inductor cache, its block constexprs are rewritten per config, and triton.compile(..., target=
GPUTarget("cuda", arch, 32)) gives metadata.shared: the bytes the launch checks against the GPU's
shared memory per block. torch's sm_12x backward default at heads 256/256 gives 114,688 B, the
figure pytorch#198224 reports from a real sm_12x board.
"""
import argparse
import glob
import inspect
import os
import re
import sys
import tempfile
import types

cache = tempfile.mkdtemp(prefix="flex-smem-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache

import torch  # noqa: E402
import torch._inductor.kernel.flex.flex_attention as FM  # noqa: E402
import torch.nn.attention.flex_attention as FA  # noqa: E402
import triton  # noqa: E402
from torch._inductor.runtime import triton_heuristics as TH  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402


def capture(qk: int, v: int) -> dict[str, str]:
    """{"fwd": path, "bwd": path} of the rendered kernels for these head sizes (bf16)."""
    from speculators.models.eagle3.attention import create_combined_mask_mod, extend_mask_for_draft_tokens

    src = inspect.getsource(FM.flex_attention).replace('if query.get_device().type == "cpu":', "if False:", 1)
    exec(compile(src, FM.__file__, "exec"), FM.__dict__)  # the Triton template path for CPU tensors
    FA._validate_device = lambda *a: None  # CPU flex refuses a backward

    class Target:  # triton's driver, as a CUDA device of no particular kind (codegen only)
        def get_current_target(self):
            return GPUTarget("cuda", 120, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, *a):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Target())
    TH.CachingAutotuner.precompile = lambda self, *a, **k: None  # never compiled for, nor run on, the CPU
    TH.CachingAutotuner.run = lambda self, *a, **k: None
    torch._inductor.config.cpu_backend = "triton"
    S = 384
    doc = torch.zeros(S, dtype=torch.long)
    doc[100:], doc[300:] = 1, -1
    mask = extend_mask_for_draft_tokens(FA.create_block_mask(create_combined_mask_mod(doc, S), None, None, S, S,
                                                             device="cpu"))  # a TTT step's mask
    q = torch.randn(1, 2, S, qk, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 2 * S, qk, dtype=torch.bfloat16, requires_grad=True)
    val = torch.randn(1, 2, 2 * S, v, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(FA.flex_attention, dynamic=False)(q, k, val, block_mask=mask).sum().backward()
    out = {}
    for path in glob.glob(f"{cache}/*/*.py"):
        text = open(path).read()
        if re.search(r"^def triton_flex_attention_backward\(", text, re.M):
            out["bwd"] = path
        elif re.search(r"^def triton_flex_attention\(", text, re.M):
            out["fwd"] = path
    return out


def shared(path: str, consts: dict, warps: int, stages: int, arch: int) -> int:
    text = open(path).read()
    for k, val in consts.items():
        text, n = re.subn(rf"^(\s*{k} : tl.constexpr = ).*$", rf"\g<1>{val}", text, flags=re.M)
        assert n, k
    sig = eval(re.search(r"'signature': (\{[^}]*\})", text).group(1))
    attrs = eval(re.search(r"'configs': \[(\{.*?\})\]\}", text).group(1))
    text = re.sub(r"@triton_heuristics\.template\(.*?\)\n@triton\.jit", "@triton.jit", text, flags=re.S)
    mod_path = f"{path}.{abs(hash(str(consts)))}.py"  # triton reads the jit functions' source files
    open(mod_path, "w").write(text)
    mod = types.ModuleType("kernel")
    exec(compile(text, mod_path, "exec"), mod.__dict__)
    fn = getattr(mod, re.search(r"^def (triton_\w+)\(", text, re.M).group(1))
    c = triton.compile(ASTSource(fn, signature=sig, constexprs={}, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return c.metadata.shared


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--qk", type=int, default=192, help="q/k head size (default: 192, MLA's)")
    p.add_argument("--v", type=int, default=128, help="v head size (default: 128)")
    p.add_argument("--arch", type=int, default=120, help="CUDA target, e.g. 120, 89, 86, 90 (default: 120)")
    p.add_argument("--bwd", nargs="*", default=["64,64,64,64,1,4", "32,32,32,32,2,4", "16,16,16,16,1,4"],
                   help="backward configs BLOCK_M1,BLOCK_N1,BLOCK_M2,BLOCK_N2,stages,warps")
    p.add_argument("--fwd", nargs="*", default=["64,64,3,4", "32,32,2,4"], help="forward configs M,N,stages,warps")
    a = p.parse_args()
    paths = capture(a.qk, a.v)
    for c in a.bwd:
        m1, n1, m2, n2, s, w = map(int, c.split(","))
        b = shared(paths["bwd"], dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2), w, s, a.arch)
        print(f"sm_{a.arch} backward q/k {a.qk} v {a.v} {c}: {b:,} B", flush=True)
    for c in a.fwd:
        m, n, s, w = map(int, c.split(","))
        print(f"sm_{a.arch} forward  q/k {a.qk} v {a.v} {c}: "
              f"{shared(paths['fwd'], dict(BLOCK_M=m, BLOCK_N=n), w, s, a.arch):,} B", flush=True)


if __name__ == "__main__":
    sys.exit(main())
