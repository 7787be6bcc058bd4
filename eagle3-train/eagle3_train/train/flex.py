"""Flex attention's Triton block sizes for this GPU's shared memory (issue 25), and the fallback when
a kernel still does not fit.

torch picks flex attention's blocks per GPU generation (torch 2.13:
torch/_inductor/template_heuristics/triton.py, CUDAConfigHeuristic.get_flex_attn_fwd_configs /
get_flex_attn_bwd_configs), not from the shared memory a block may use. On sm_12x (RTX PRO 6000
Blackwell, 101,376 B per block) its backward default, blocks 64/64/64/64 with 1 stage, needs 114,688 B
once the q/k and v head sizes both round up to 256 (pytorch#198224): the kernel fails at its first
launch with "No valid triton configs. OutOfResources: out of resource: shared memory". Its runtime
retries a kernel with 1 stage, never with smaller blocks (runtime/triton_heuristics.py,
compile_by_disabling_pipelining), so smaller blocks are ours to pass, as `kernel_options`.

The estimate (bytes; head sizes rounded up to a power of two as kernel/flex/common.py
set_head_dim_values does, D = Dqk + Dv):
- backward (templates/flex_backwards.py.jinja): a dK/dV program keeps its K [N1, Dqk] and V [N1, Dv]
  tiles and walks Q [M1, Dqk] and dO [M1, Dv] tiles; a dQ program keeps Q/dO [M2, ·] and walks K/V
  [N2, ·]. Every tile a dot reads is staged in shared memory once: (M + N) * D * bytes for the larger
  program, plus a quarter of the M x N score tile per extra stage.
- forward (templates/flex_attention.py.jinja): `tl.dot(q, kT)` then `tl.dot(p, v)`: the larger of
  the Q [M, Dqk] and K [N, Dqk] tiles (Triton reuses one buffer), V [N, Dv] and P [M, N], plus the
  same stage term.
Checked against Triton's own sm_120 compile of torch 2.13's kernels (metadata.shared; the table is
in tests/test_flex.py): never low; the backward equal for most blocks up to 32 and at most 31% high
(Triton shares buffers at 64), the forward at most 47% high. torch's sm_12x backward default comes
out at 131,072 B for heads 256/256 (Triton: 114,688, pytorch#198224's figure) and at 98,304 B for
the MLA draft's 192/128 (Triton: 83,968): the MLA draft keeps torch's defaults there.

When a kernel fails anyway (another torch, another GPU, an estimate that is wrong), `first_that_runs`
walks down `ladder` one rung at a time, saying so in one line per rung, and gives up in one error
line naming the user's choices. No rung is a dense S x S path. A kernel that passed the probe but
fails at a training step anyway is one error line too (`in_one_line`, on Trainer.forward_backward).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable
from unittest import mock

import torch

from eagle3_train.common.errors import PipelineError
from eagle3_train.train.config import STAGE

# (BLOCK_M, BLOCK_N, num_stages, num_warps) and (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages,
# num_warps), as torch's FlexConfig / FlexBwDConfig: the smaller configs to pick from, the first that
# fits wins. Each keeps the kernels' static asserts (BLOCK_N1 % BLOCK_M1 == 0, BLOCK_M2 % BLOCK_N2 == 0)
# and divides the block mask's 128. The backward's first is the one pytorch#198228 measured fastest of
# those that fit on a GB10 (sm_121), 1.85x the next.
FWD_RUNGS = ((64, 64, 2, 4), (64, 32, 2, 4), (32, 32, 2, 4), (16, 16, 1, 4))
BWD_RUNGS = ((32, 32, 32, 32, 2, 4), (16, 32, 32, 16, 1, 4), (16, 16, 16, 16, 1, 4))
# What a kernel that still does not fit steps down to, in order: hard, the estimate was wrong once.
FALLBACK = ({"fwd": (32, 32, 2, 4), "bwd": (32, 32, 32, 32, 2, 4)},
            {"fwd": (16, 16, 1, 4), "bwd": (16, 16, 16, 16, 1, 4)})
# The estimate is measured for the GPUs whose Triton dots are mma.sync (sm_8x, sm_12x: the same bytes
# for sm_86, sm_89 and sm_120); Hopper's wgmma kernels stage differently (sm_90's forward measured up
# to 8% above the estimate), so there a fifth of the shared memory is kept in reserve.
WGMMA_MAJORS = (9, 10)
# torch 2.13 says "OutOfResources: out of resource: shared memory, Required: ..."; later ones
# "OutOfMemoryError: out of resource: <kernel> Required: ..." (pytorch#198224)
SMEM_ERRORS = ("No valid triton configs", "out of resource", "OutOfResources")
# What the user can do when no blocks fit (the dense path, sized down to fit in memory)
ADVICE = "train with --attn sdpa (dense masks: lower --max-tokens-per-batch until it fits in memory)"
# What setup installed in this process (use_compiled_flex is process-wide too): the device's words,
# the options its probe tried in order, the last one being what training runs with.
installed: dict | None = None


def rounded(d: int) -> int:
    return 1 << max(int(d) - 1, 0).bit_length()


def fwd_smem(qk: int, v: int, cfg: tuple, nbytes: int) -> int:
    """The forward kernel's shared memory, bytes (see the module docstring)."""
    m, n, stages = cfg[:3]
    qk, v = rounded(qk), rounded(v)
    return nbytes * (max(m, n) * qk + n * v + m * n + (stages - 1) * m * n // 4)


def bwd_smem(qk: int, v: int, cfg: tuple, nbytes: int) -> int:
    """The backward kernel's shared memory, bytes: the larger of its dK/dV and dQ programs."""
    m1, n1, m2, n2, stages = cfg[:5]
    d = rounded(qk) + rounded(v)
    return nbytes * max((m + n) * d + (stages - 1) * m * n // 4 for m, n in ((m1, n1), (m2, n2)))


@contextlib.contextmanager
def _capability(capability: tuple[int, int]):
    # torch's heuristic reads the current device's capability; we ask about a given one
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: tuple(capability)):
        yield


def torch_defaults(capability: tuple[int, int], qk: int, nbytes: int) -> tuple[tuple, tuple]:
    """torch's own default (forward, backward) configs for this capability, read from the installed
    torch's heuristic (without max-autotune: one config each, the default)."""
    from torch._inductor import config
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    dtype = torch.float32 if nbytes == 4 else torch.bfloat16
    h = CUDAConfigHeuristic()
    with _capability(capability), config.patch(max_autotune=False):
        f = h.get_flex_attn_fwd_configs(qk, dtype)[-1]
        b = h.get_flex_attn_bwd_configs(qk, dtype)[-1]
    return ((f.block_m, f.block_n, f.num_stages, f.num_warps),
            (b.block_m1, b.block_n1, b.block_m2, b.block_n2, b.num_stages, b.num_warps))


def as_options(fwd: tuple | None = None, bwd: tuple | None = None) -> dict:
    """torch's kernel_options for these configs (fwd_/bwd_ prefixes: each applies to its kernel only)."""
    out = {}
    if fwd is not None:
        out |= dict(zip(("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps"), fwd))
    if bwd is not None:
        out |= dict(zip(("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages",
                         "bwd_num_warps"), bwd))
    return out


def _fit(default: tuple, rungs: Iterable[tuple], need: Callable[[tuple], int], smem: int) -> tuple | None:
    """None when torch's default fits; else the largest rung that does (the smallest if none)."""
    if need(default) <= smem:
        return None
    rungs = [r for r in rungs if need(r) < need(default)]
    return next((r for r in rungs if need(r) <= smem), rungs[-1] if rungs else None)


def kernel_options(capability: tuple[int, int], smem_per_block: int, qk_head_dim: int, v_head_dim: int,
                   dtype_bytes: int) -> dict | None:
    """flex attention kernel_options for a GPU of this capability and shared memory per block (opt-in),
    or None where torch's defaults fit. Only the kernel that does not fit gets options."""
    fd, bd = torch_defaults(capability, qk_head_dim, dtype_bytes)
    limit = smem_per_block if capability[0] not in WGMMA_MAJORS else int(smem_per_block * 0.8)
    fwd = _fit(fd, FWD_RUNGS, lambda c: fwd_smem(qk_head_dim, v_head_dim, c, dtype_bytes), limit)
    bwd = _fit(bd, BWD_RUNGS, lambda c: bwd_smem(qk_head_dim, v_head_dim, c, dtype_bytes), limit)
    return as_options(fwd, bwd) or None


def ladder(capability: tuple[int, int], smem_per_block: int, qk_head_dim: int, v_head_dim: int,
           dtype_bytes: int) -> list[dict | None]:
    """The options to try in order: the estimate's choice, then the smaller fallbacks."""
    out = [kernel_options(capability, smem_per_block, qk_head_dim, v_head_dim, dtype_bytes)]
    for rung in FALLBACK:
        opts = as_options(rung["fwd"], rung["bwd"])
        if opts not in out:
            out.append(opts)
    return out


def describe(options: dict | None) -> str:
    if not options:
        return "torch's default blocks"
    parts = []
    for k, names in (("fwd", ("BLOCK_M", "BLOCK_N")), ("bwd", ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))):
        if f"{k}_{names[0]}" in options:
            blocks = "/".join(str(options[f"{k}_{n}"]) for n in names)
            parts.append(f"{'forward' if k == 'fwd' else 'backward'} blocks {blocks}, "
                         f"{options[f'{k}_num_stages']} stage(s)")
    return "; ".join(parts)


def is_smem_error(e: BaseException) -> bool:
    """Whether an exception (or one it wraps: InductorError, a cause) says a kernel did not fit."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ in ("OutOfResources", "NoTritonConfigsError", "NoValidChoicesError") \
                or any(s in str(e) for s in SMEM_ERRORS):
            return True
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return False


def short(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    hit = next((ln for ln in lines if "out of resource" in ln or "Required" in ln), lines[0] if lines else "")
    return f"{type(e).__name__}: {hit}"[:240]


def first_that_runs(rungs: list[dict | None], attempt: Callable[[dict | None], None], where: str, *,
                    say: Callable[[str], None] | None = None) -> dict | None:
    """The first options `attempt` runs with; each kernel that does not fit is said in one line with
    what comes next; none fits: one PipelineError line with the user's choices. Any other failure
    is not ours to hide: it propagates."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    for i, opts in enumerate(rungs):
        try:
            attempt(opts)
            return opts
        except Exception as e:
            if not is_smem_error(e):
                raise
            if i + 1 == len(rungs):
                raise PipelineError(f"flex attention does not fit {where} even with {describe(opts)} "
                                    f"({short(e)}); {ADVICE}") from None
            say(f"warning: flex attention with {describe(opts)} does not fit {where} ({short(e)}); "
                f"retrying with {describe(rungs[i + 1])}")
    return None


def head_dims(layer_config) -> tuple[int, int]:
    """(q/k, v) head sizes of a draft layer: MLA's qk_nope + qk_rope and v_head_dim, else head_dim."""
    lc = layer_config
    if getattr(lc, "qk_rope_head_dim", None):
        return int(lc.qk_nope_head_dim + lc.qk_rope_head_dim), int(lc.v_head_dim)
    d = getattr(lc, "head_dim", None) or lc.hidden_size // lc.num_attention_heads
    return int(d), int(d)


def device_limits(device) -> tuple[tuple[int, int], int, str]:
    """(capability, shared memory per block with opt-in, name) of a CUDA device."""
    p = torch.cuda.get_device_properties(device)
    return (p.major, p.minor), int(p.shared_memory_per_block_optin), f"{p.name} (sm_{p.major}{p.minor})"


def probe(qk: int, v: int, dtype: torch.dtype, device, tokens: int = 256) -> Callable[[], None]:
    """One forward + backward of the installed compiled kernel through speculators' attention module,
    on a two-document packed batch under the draft's own mask, and under that mask extended for a
    TTT step (keys of both steps, as draft_core.unroll's second step attends): a kernel that does not
    fit fails here, in seconds, not in step 1. The shared memory a kernel needs depends on its blocks,
    head sizes and dtype, not on the number of tokens or heads."""
    from speculators.models.eagle3.attention import create_combined_mask_mod, extend_mask_for_draft_tokens
    from torch.nn.attention.flex_attention import create_block_mask

    def run() -> None:
        import speculators.models.attention as sa

        doc = torch.zeros(tokens, dtype=torch.long, device=device)
        doc[tokens // 3:] = 1
        mask = create_block_mask(create_combined_mask_mod(doc, tokens), B=None, H=None, Q_LEN=tokens,
                                 KV_LEN=tokens, device=device)

        def rand(n: int, d: int) -> torch.Tensor:
            return torch.randn(1, 1, n, d, device=device, dtype=dtype, requires_grad=True)

        q, k, val, k2, v2 = rand(tokens, qk), rand(tokens, qk), rand(tokens, v), rand(tokens, qk), rand(tokens, v)
        out = sa.flex_attention(q, k, val, block_mask=mask).float().sum()
        out = out + sa.flex_attention(q, torch.cat([k, k2], 2), torch.cat([val, v2], 2),
                                      block_mask=extend_mask_for_draft_tokens(mask)).float().sum()
        out.backward()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    return run


def setup(draft, device, dtype: torch.dtype, *, main: bool = True) -> dict | None:
    """Choose and install the compiled flex kernel's options for this draft on this CUDA device
    (verified by a probe, stepping down if needed); returns them (None: torch's defaults)."""
    from eagle3_train.train.draft_core import use_compiled_flex

    qk, v = head_dims(draft.config.transformer_layer_config)
    capability, smem, name = device_limits(device)
    nbytes = dtype.itemsize
    rungs = ladder(capability, smem, qk, v, nbytes)
    where = (f"{name}'s {smem:,} B of shared memory per block (q/k head {qk}, v head {v}, "
             f"{str(dtype).removeprefix('torch.')})")
    quiet = (lambda line: None) if not main else None
    run = probe(qk, v, dtype, device)

    def attempt(options: dict | None) -> None:
        use_compiled_flex(options)
        run()

    global installed
    installed = None
    chosen = first_that_runs(rungs, attempt, where, say=quiet)
    installed = {"where": where, "tried": rungs[:rungs.index(chosen) + 1]}
    if main and chosen:
        print(f"{STAGE}: flex attention on {where}: {describe(chosen)} (torch's defaults do not fit)", flush=True)
    return chosen


def step_error(e: BaseException) -> PipelineError:
    """A kernel setup's probe ran that does not fit at a training step (another mask, length or
    graph than the probe's): one line with the device and every option tried, the last the one in use."""
    rec = installed or {"where": "this GPU", "tried": [None]}
    tried = "; ".join(f"[{describe(o)}]" for o in rec["tried"])
    return PipelineError(f"flex attention does not fit {rec['where']} at a training step, with "
                         f"{describe(rec['tried'][-1])} that the start-up probe ran ({short(e)}); options "
                         f"tried: {tried}; {ADVICE}")


def in_one_line(forward_backward: Callable) -> Callable:
    """Trainer.forward_backward's hook: a flex kernel that does not fit, met at a training step, is
    step_error's one line, not an InductorError traceback; any other failure propagates as it is."""
    @functools.wraps(forward_backward)
    def run(trainer, *args, **kwargs):
        try:
            return forward_backward(trainer, *args, **kwargs)
        except Exception as e:
            if trainer.model.kernels.get("attn") != "flex" or not is_smem_error(e):
                raise
            raise step_error(e) from None
    return run
