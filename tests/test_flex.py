"""Flex attention's kernel options for a GPU's shared memory (eagle3_train.train.flex, issue 25): the
estimate against what Triton itself allocates for torch's kernels, the choice per device (torch's
defaults where they fit), the step-down when a kernel still does not fit, and the options reaching
the attention call of the MLA draft's training unroll."""

from __future__ import annotations

import functools

import pytest
import torch
from eagle3_train.common.errors import PipelineError
from eagle3_train.train import draft_core as core
from eagle3_train.train import flex
from eagle3_train.train.flex import bwd_smem, fwd_smem, kernel_options
from test_draft_mla import batch, make

H200 = ((9, 0), 232_448)  # shared memory per block with opt-in (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SM120 = ((12, 0), 101_376)  # RTX PRO 6000 Blackwell; sm_86 / sm_89 have the same
SM86 = ((8, 6), 101_376)
BF16 = 2

# metadata.shared of torch 2.13's flex kernels (rendered by inductor from templates/flex_*.py.jinja
# with the draft's document mask, a TTT step's extended one) compiled by Triton 3.7 for sm_120
# (GPUTarget("cuda", 120, 32)): (q/k head, v head, config, bytes); sm_86 and sm_89 gave the same where
# tried. Reproduce: docs/measurements.md "flex attention's shared memory".
BWD_MEASURED = [
    (256, 256, (64, 64, 64, 64, 1, 4), 114_688),  # torch's sm_12x default: pytorch#198224's figure
    (256, 256, (32, 32, 32, 32, 2, 4), 66_048),
    (256, 256, (16, 32, 32, 16, 1, 4), 45_056),
    (256, 256, (32, 64, 16, 16, 1, 4), 90_112),
    (256, 256, (16, 16, 64, 64, 1, 4), 100_352),
    (192, 128, (64, 64, 64, 64, 1, 4), 83_968),  # the MLA draft under torch's sm_12x default: it fits
    (192, 128, (64, 64, 64, 64, 2, 4), 84_992),
    (192, 128, (64, 64, 64, 64, 3, 4), 86_016),
    (192, 128, (32, 64, 64, 32, 1, 4), 67_584),
    (192, 128, (32, 64, 64, 32, 2, 4), 68_096),
    (192, 128, (32, 32, 32, 32, 1, 4), 43_008),
    (192, 128, (32, 32, 32, 32, 2, 4), 43_520),
    (192, 128, (32, 32, 32, 32, 3, 4), 44_032),
    (192, 128, (16, 32, 32, 16, 1, 4), 34_816),
    (192, 128, (16, 16, 16, 16, 1, 4), 22_528),
    (192, 128, (64, 128, 128, 64, 1, 8), 135_168),
    (192, 128, (64, 128, 128, 64, 3, 8), 137_216),
    (192, 128, (64, 128, 16, 16, 1, 4), 133_120),
    (192, 128, (16, 16, 128, 32, 1, 4), 116_736),
    (128, 128, (64, 64, 64, 64, 1, 4), 57_344),
    (128, 128, (64, 128, 128, 64, 3, 8), 100_352),
    (128, 128, (32, 64, 16, 16, 1, 4), 49_152),
]
FWD_MEASURED = [
    (192, 128, (64, 64, 3, 4), 58_368),  # torch's sm_12x default for head 192
    (192, 128, (64, 64, 1, 4), 57_344),
    (192, 128, (128, 64, 3, 4), 82_944),
    (192, 128, (128, 64, 2, 8), 82_432),
    (192, 128, (128, 32, 2, 8), 73_984),
    (192, 128, (128, 128, 1, 8), 98_304),
    (192, 128, (128, 128, 3, 4), 100_352),
    (192, 128, (64, 32, 3, 4), 45_568),
    (192, 128, (32, 64, 2, 4), 37_376),
    (192, 128, (32, 32, 2, 4), 26_880),
    (192, 128, (32, 16, 1, 4), 21_504),
    (192, 128, (16, 16, 1, 4), 12_800),
    (256, 256, (32, 64, 2, 4), 53_760),  # torch's sm_12x default for head 256
    (256, 256, (64, 64, 3, 4), 74_752),
    (256, 256, (16, 16, 1, 4), 16_896),
    (128, 128, (128, 64, 2, 8), 49_664),  # torch's sm_12x default for head 128
    (128, 128, (128, 64, 3, 8), 50_176),
]


@pytest.mark.parametrize("qk,v,cfg,measured", BWD_MEASURED)
def test_backward_estimate_bounds_what_triton_allocates(qk, v, cfg, measured):
    est = bwd_smem(qk, v, cfg, BF16)
    assert measured <= est <= 1.35 * measured


@pytest.mark.parametrize("qk,v,cfg,measured", FWD_MEASURED)
def test_forward_estimate_bounds_what_triton_allocates(qk, v, cfg, measured):
    est = fwd_smem(qk, v, cfg, BF16)
    assert measured <= est <= 1.5 * measured


def test_torch_defaults_are_read_from_the_installed_torch_per_capability():
    # torch/_inductor/template_heuristics/triton.py, CUDAConfigHeuristic: sm_12x's backward default
    # for head > 128 is 64/64/64/64 with 1 stage; sm90's 2 stages; sm_12x has no forward entry for 192
    assert flex.torch_defaults(SM120[0], 192, BF16) == ((64, 64, 3, 4), (64, 64, 64, 64, 1, 4))
    assert flex.torch_defaults(H200[0], 192, BF16)[1] == (64, 64, 64, 64, 2, 4)
    assert flex.torch_defaults(SM120[0], 128, BF16) == ((128, 64, 2, 8), (64, 64, 64, 64, 1, 4))


@pytest.mark.parametrize("qk,v", [(192, 128), (192, 192), (256, 256), (128, 128)])
def test_an_h200_keeps_torchs_defaults(qk, v):
    assert kernel_options(*H200, qk, v, BF16) is None


def test_sm120_keeps_the_defaults_where_they_fit():
    # Kimi's MLA draft: q/k 192 (-> 256), v 128: 98,304 B by the estimate (Triton: 83,968) < 101,376
    assert kernel_options(*SM120, 192, 128, BF16) is None
    assert kernel_options(*SM120, 128, 128, BF16) is None  # a Llama draft's head 128


@pytest.mark.parametrize("device", [SM120, SM86])
@pytest.mark.parametrize("qk,v", [(192, 192), (256, 256)])
def test_sm120_gets_smaller_backward_blocks_when_both_heads_round_to_256(device, qk, v):
    cap, smem = device
    default_fwd, default_bwd = flex.torch_defaults(cap, qk, BF16)
    assert bwd_smem(qk, v, default_bwd, BF16) > smem  # the default does not fit (Triton: 114,688 B)
    opts = kernel_options(cap, smem, qk, v, BF16)
    assert opts is not None and not any(k.startswith("fwd_") for k in opts)  # the forward's default fits
    bwd = tuple(opts[f"bwd_{k}"] for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps"))
    assert bwd_smem(qk, v, bwd, BF16) <= smem < bwd_smem(qk, v, default_bwd, BF16)
    assert all(b <= d for b, d in zip(bwd[:4], default_bwd[:4]))
    assert bwd[1] % bwd[0] == 0 and bwd[2] % bwd[3] == 0 and all(128 % b == 0 for b in bwd[:4])  # torch's asserts


def test_a_small_shared_memory_shrinks_the_forward_too():
    opts = kernel_options(SM120[0], 48 * 1024, 192, 128, BF16)
    fwd = tuple(opts[f"fwd_{k}"] for k in ("BLOCK_M", "BLOCK_N", "num_stages", "num_warps"))
    assert fwd_smem(192, 128, fwd, BF16) <= 48 * 1024 < fwd_smem(192, 128, (64, 64, 3, 4), BF16)


def oom(required=114_688):
    """What torch 2.13 raises when a flex kernel does not fit: triton's OutOfResources at launch, turned
    into "No valid triton configs" by inductor's runtime, wrapped in an InductorError."""
    from torch._inductor.exc import InductorError
    from triton.runtime.errors import OutOfResources

    launch = OutOfResources(required, 101_376, "shared memory")
    inner = RuntimeError(f"No valid triton configs. OutOfResources: {launch}")
    return InductorError(inner, None)


def test_a_kernel_that_does_not_fit_steps_down_in_one_line():
    rungs = flex.ladder(*SM120, 192, 192, BF16)
    assert len(rungs) == 3 and rungs[-1]["bwd_BLOCK_M1"] == 16  # the choice, then two smaller fallbacks
    tried, said = [], []

    def attempt(opts):
        tried.append(opts)
        if len(tried) == 1:
            raise oom()

    got = flex.first_that_runs(rungs, attempt, "sm_120 (101,376 B)", say=said.append)
    assert got == rungs[1] and tried == rungs[:2]
    assert len(said) == 1 and "\n" not in said[0]
    assert "does not fit sm_120 (101,376 B)" in said[0] and "Required: 114688" in said[0]
    assert "backward blocks 32/32/32/32" in said[0] and "retrying with forward blocks 32/32" in said[0]


def test_when_nothing_fits_one_error_names_the_device_and_the_users_choices():
    from triton.runtime.errors import OutOfResources

    said = []

    def attempt(opts):
        raise OutOfResources(22_528, 16_384, "shared memory")

    with pytest.raises(PipelineError) as e:
        flex.first_that_runs([None, flex.as_options((16, 16, 1, 4), (16, 16, 16, 16, 1, 4))], attempt,
                             "a tiny GPU", say=said.append)
    msg = str(e.value)
    assert "\n" not in msg and "a tiny GPU" in msg and "--attn sdpa" in msg and "--max-tokens-per-batch" in msg
    assert "backward blocks 16/16/16/16" in msg and len(said) == 1 and "torch's default blocks" in said[0]


def test_other_failures_are_not_taken_for_shared_memory():
    def attempt(opts):
        raise ValueError("Q and KV block size must be divisible by BLOCK_M and BLOCK_N")

    with pytest.raises(ValueError):
        flex.first_that_runs([None, {}], attempt, "x", say=lambda line: pytest.fail(line))
    assert flex.is_smem_error(oom()) and not flex.is_smem_error(RuntimeError("CUDA error: illegal memory access"))
    # later torch words it as pytorch#198224 quotes it
    later = RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: "
                         "triton_tem_fused_flex_attention_backward_1 Required: 114688 Hardware limit:101376")
    assert flex.is_smem_error(later) and "Required: 114688" in flex.short(later)


@pytest.fixture(scope="module")
def twin(kimi_random_twin_dir):
    """The random Kimi twin's MLA draft inputs (q/k head 96, v head 32), as tests/test_draft_mla.py's."""
    from eagle3_train.common.target_layout import load_config

    t2d = torch.zeros(163_840, dtype=torch.bool)
    t2d[:64] = True
    return {"target": kimi_random_twin_dir, "cfg": load_config(kimi_random_twin_dir), "t2d": t2d,
            "d2t": torch.zeros(64, dtype=torch.long), "weights": core.load_target_weights(kimi_random_twin_dir)}


@pytest.fixture
def recorded(monkeypatch):
    """speculators' attention module with torch.compile swapped for a recorder of the eager kernel
    (flex runs forward-only on CPU), restored afterwards."""
    import speculators.models.attention as sa

    calls, real_compile, kernel = [], torch.compile, sa.flex_attention

    def compile_(fn, *a, **kw):
        if fn is not kernel:  # torch's own uses (its eager flex path compiles a wrapper)
            return real_compile(fn, *a, **kw)

        @functools.wraps(fn)
        def rec(*a, **k):
            calls.append(k.get("kernel_options"))
            return fn(*a, **k)
        return rec

    monkeypatch.setattr(sa, "flex_attention", sa.flex_attention)
    monkeypatch.setattr(sa, "_eagle3_train_compiled", None, raising=False)
    monkeypatch.setattr(torch, "compile", compile_)
    return calls


def test_the_options_reach_the_mla_drafts_attention_calls(twin, recorded):
    ref = make(twin, attn_impl="sdpa").eval()
    model = make(twin, attn_impl="simple_flex_attention").eval()
    model.load_state_dict(ref.state_dict())
    opts = flex.as_options(None, (32, 32, 32, 32, 2, 4))
    core.use_compiled_flex(opts)
    aux, tok, pos, doc = batch(2, n=128, split=70)
    with torch.no_grad():
        for a, b in zip(core.unroll(ref, aux, tok, pos, doc, 3), core.unroll(model, aux, tok, pos, doc, 3)):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    assert recorded == [opts] * 3  # one attention call per TTT step, each with the options
    core.use_compiled_flex(None)  # back to torch's defaults: the same compiled function, no options
    with torch.no_grad():
        next(core.unroll(model, aux, tok, pos, doc, 1))
    assert recorded[-1] is None and len(recorded) == 4


def test_setup_installs_the_options_its_probe_ran_and_says_each_step_down(twin, recorded, monkeypatch, capsys):
    """setup on a fake 40,000 B GPU: the estimate picks 32-blocks for the twin's q/k 96 / v 32 heads;
    the fake probe refuses every 32-block backward as a kernel launch would, so it steps down twice."""
    import speculators.models.attention as sa

    model = make(twin, attn_impl="simple_flex_attention")
    monkeypatch.setattr(flex, "device_limits", lambda device: ((12, 0), 40_000, "fake sm_120"))
    monkeypatch.setattr(flex, "installed", None)  # setup records what it tried: restored after this test
    ran = []

    def probe(qk, v, dtype, device):
        assert (qk, v, dtype) == (96, 32, torch.bfloat16)

        def run():
            installed = getattr(sa.flex_attention, "keywords", {}).get("kernel_options")
            ran.append(installed)
            if installed is None or installed["bwd_BLOCK_M1"] == 32:
                raise oom()
        return run

    monkeypatch.setattr(flex, "probe", probe)
    got = flex.setup(model, "cpu", torch.bfloat16)
    assert [r["bwd_BLOCK_M1"] for r in ran] == [32, 32, 16] and got == ran[-1]
    assert sa.flex_attention.keywords["kernel_options"] == got  # what training will call
    assert flex.installed["tried"] == ran and "fake sm_120's 40,000 B" in flex.installed["where"]
    out, err = capsys.readouterr()
    assert err.count("\n") == 2 and all(ln.startswith("warning: flex attention with ") for ln in err.splitlines())
    assert "fake sm_120's 40,000 B of shared memory per block (q/k head 96, v head 32, bfloat16)" in err
    assert out.count("\n") == 1 and "backward blocks 16/16/16/16" in out
    ran.clear()
    assert flex.setup(model, "cpu", torch.bfloat16, main=False) == got  # other ranks: the same, silently
    assert capsys.readouterr() == ("", "")


def test_the_probe_also_runs_a_ttt_steps_extended_mask(monkeypatch):
    """setup's probe calls the installed kernel under the draft's document mask and under that mask
    extended for a TTT step (twice the keys), so a kernel that fails only there is stepped down at
    start-up. The stand-in kernel raises Triton's error on the extended call, as a launch would."""
    import speculators.models.attention as sa

    calls, failing = [], {"on": True}

    def kernel(q, k, v, block_mask=None, **kw):
        calls.append((q.shape[2], k.shape[2], block_mask.shape[-2:]))
        if k.shape[2] > q.shape[2] and failing["on"]:
            raise oom()
        return q[..., :v.shape[-1]] + 0 * (k.sum() + v.sum())  # shaped as flex's output, with gradients

    monkeypatch.setattr(sa, "flex_attention", kernel)
    run = flex.probe(96, 32, torch.float32, "cpu", tokens=256)
    said = []

    def attempt(opts):
        failing["on"] = opts is None  # the defaults fail under the extended mask, the next rung runs
        run()

    rungs = [None, flex.as_options(None, (16, 16, 16, 16, 1, 4))]
    assert flex.first_that_runs(rungs, attempt, "sm_120", say=said.append) == rungs[1]
    assert calls == [(256, 256, (256, 256)), (256, 512, (256, 512))] * 2
    assert len(said) == 1 and "retrying with backward blocks 16/16/16/16" in said[0]


def test_a_kernel_that_fails_at_a_training_step_is_one_error_line_naming_the_options_tried(monkeypatch):
    """The probe passed, and training's own first step (another length, mask or graph) still meets
    Triton's "No valid triton configs" / out of resource: Trainer.forward_backward turns it into one
    error line with the device, every option the probe tried and what to do. Other failures, and
    this one on a run not using flex, propagate as they are."""
    import contextlib
    from types import SimpleNamespace

    from eagle3_train.train import loop

    small = flex.as_options(None, (32, 32, 32, 32, 2, 4))
    monkeypatch.setattr(flex, "installed", {"where": "fake sm_120's 101,376 B of shared memory per block",
                                            "tried": [None, small]})
    monkeypatch.setattr(loop, "prepare", lambda batch, *a, **k: batch)
    raised = {"e": oom()}

    def wrapped(batch):
        raise raised["e"]

    class Batch:
        def to(self, *a):
            return self

    def trainer(attn):
        model = SimpleNamespace(kernels={"attn": attn, "flex_options": small}, head=None, wrapped=wrapped,
                                sync=lambda last: contextlib.nullcontext())
        return SimpleNamespace(model=model, d=SimpleNamespace(device="cpu", dtype=torch.bfloat16,
                                                              autocast=contextlib.nullcontext),
                               config=SimpleNamespace(draft_steps=3), group_tokens=None)

    with pytest.raises(PipelineError) as e:
        loop.Trainer.forward_backward(trainer("flex"), [Batch()])
    msg = str(e.value)
    assert "\n" not in msg and e.value.__cause__ is None
    assert msg.startswith("flex attention does not fit fake sm_120's 101,376 B of shared memory per block "
                          "at a training step, with backward blocks 32/32/32/32, 2 stage(s) that the start-up "
                          "probe ran (InductorError: ")
    assert "Required: 114688" in msg
    assert "options tried: [torch's default blocks]; [backward blocks 32/32/32/32, 2 stage(s)]" in msg
    assert "--attn sdpa" in msg
    with pytest.raises(type(raised["e"])):  # sdpa/eager: not flex's to explain
        loop.Trainer.forward_backward(trainer("sdpa"), [Batch()])
    raised["e"] = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        loop.Trainer.forward_backward(trainer("flex"), [Batch()])
