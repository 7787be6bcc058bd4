"""04's recipe (issue 13): --budget parsing, the epochs/steps rule, Muon/AdamW parameter groups,
norm_before_fc in the draft and its export, the chosen values recorded, resume with either optimizer."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_train.common.errors import PipelineError
from eagle3_train.train import budget as B
from eagle3_train.train import run
from eagle3_train.train.checkpoint import checkpoints
from eagle3_train.train.metrics import read_metrics
from eagle3_train.train.recipe import build_optimizers, split_params
from helpers import inputs_argv, stage_cli
from helpers_train import train_inputs
from safetensors.torch import load_file

stage = stage_cli("04_train")


@pytest.mark.parametrize("text,kind,amount", [
    ("2h", "time", 7200), ("1.5h", "time", 5400), ("30m", "time", 1800), ("10 min", "time", 600),
    ("90s", "time", 90), ("5M", "tokens", 5e6), ("2G", "tokens", 2e9), ("200k tokens", "tokens", 2e5),
    ("5Mtok", "tokens", 5e6), ("3000", "steps", 3000), ("3000 steps", "steps", 3000), ("1step", "steps", 1),
])
def test_budget_forms(text, kind, amount):
    b = B.parse_budget(text)
    assert (b.kind, b.amount) == (kind, amount)


def test_negative_looking_values_reach_the_configs_check(capsys):
    """argparse takes `-1,2` or `-2h` for an option ("expected one argument"); 04 joins them to
    their flag so the value reaches its check (--aux-layer-ids: 02's check_layers, against the
    target's layer count, once the inputs are open) and that check's one line answers."""
    base = ["--hidden-states", "h", "--vocab-mapping", "v", "--target", "t", "--out", "o"]
    assert stage.parse_args([*base, "--aux-layer-ids", "-1,2"]).aux_layer_ids == [-1, 2]
    from eagle3_train.extract.stage import check_layers

    with pytest.raises(PipelineError, match="--aux-layer-ids"):
        check_layers([-1, 2], 8, flag="--aux-layer-ids")
    with pytest.raises(PipelineError, match="--budget must be positive"):
        stage.parse_args([*base, "--budget", "-2h"])


@pytest.mark.parametrize("text", ["", "abc", "2 hours", "5x", "1.5", "5m tokens", "3e3", "h"])
def test_malformed_budgets_are_one_error_line(text, capsys):
    with pytest.raises(PipelineError, match="--budget must be a time"):
        B.parse_budget(text)
    with pytest.raises(PipelineError, match="--budget"):  # the script refuses it before any work
        stage.parse_args(["--hidden-states", "h", "--vocab-mapping", "v", "--target", "t", "--out", "o",
                          "--budget", text])


@pytest.mark.parametrize("text", ["0", "0h", "0 steps", "0M", "-3", "-3 steps", "-2h"])
def test_a_budget_of_nothing_is_said_to_be_not_positive(text, tmp_path, capfd):
    from eagle3_train.common.errors import run_main

    out = tmp_path / "run"
    capfd.readouterr()
    assert run_main(stage.main, ["--hidden-states", str(tmp_path / "h"), "--vocab-mapping", str(tmp_path / "v"),
                                 "--target", str(tmp_path / "t"), "--out", str(out), "--budget", text]) == 2
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"error: --budget must be positive (a duration like 2h, tokens like 5M, or steps like 3000), "
                   f"not {text}"], err
    assert not out.exists()  # refused before any work


def test_budget_and_epochs_are_not_both_given():
    with pytest.raises(PipelineError, match="--budget 2h and --epochs 3"):
        stage.parse_args(["--hidden-states", "h", "--vocab-mapping", "v", "--target", "t", "--out", "o",
                          "--budget", "2h", "--epochs", "3"])


def test_default_epochs_reach_min_steps_capped():
    assert B.auto_epochs(73) == min(B.MAX_EPOCHS, -(-B.MIN_STEPS // 73))  # issue 13: 73 steps an epoch
    assert B.auto_epochs(B.MIN_STEPS) == 1 and B.auto_epochs(10 * B.MIN_STEPS) == 1
    assert B.auto_epochs(1) == B.MAX_EPOCHS
    for spe in (1, 7, 73, 146, 999, 1000, 1001, 50_000):
        n = B.auto_epochs(spe)
        assert 1 <= n <= B.MAX_EPOCHS
        assert n * spe >= B.MIN_STEPS or n == B.MAX_EPOCHS  # enough steps, unless capped
        assert n == 1 or (n - 1) * spe < B.MIN_STEPS  # and not an epoch more than needed


def test_length_from_each_kind_of_budget():
    common = dict(epochs=None, max_steps=None, steps_per_epoch=100, tokens_per_epoch=400_000)
    assert B.choose_length(budget=None, **common)["total_steps"] == B.auto_epochs(100) * 100
    steps = B.choose_length(budget=B.parse_budget("250"), **common)
    assert (steps["epochs"], steps["total_steps"]) == (3, 250)  # the last epoch partial
    toks = B.choose_length(budget=B.parse_budget("2M"), **common)  # 4,000 tokens a step
    assert (toks["epochs"], toks["total_steps"]) == (5, 500)
    timed = B.choose_length(budget=B.parse_budget("30m"), seconds_per_step=0.5, **common)
    assert timed["total_steps"] == 3600 and timed["epochs"] == 36 and "0.5 s/step" in timed["why"]
    pinned = B.choose_length(**{**common, "epochs": 2, "max_steps": 150}, budget=None)
    assert (pinned["epochs"], pinned["total_steps"]) == (2, 150) and "--max-steps 150" in pinned["why"]


def _draft(target_dir, **kw):
    from eagle3_train.train.draft import build_draft
    from transformers import AutoConfig

    return build_draft(str(target_dir), AutoConfig.from_pretrained(target_dir), aux_layer_ids=[1, 2, 3], d2t=None,
                       t2d=None, weights=None, **kw)


@pytest.mark.parametrize("hidden", [None, 48])
def test_muon_takes_the_hidden_matrices_adamw_the_rest(llama_target_dir, hidden):
    draft = _draft(llama_target_dir, norm_before_fc=True, hidden_size=hidden)
    matrices, rest = split_params(draft)
    mnames, rnames = {n for n, _ in matrices}, {n for n, _ in rest}
    assert "fc.weight" in mnames and any("q_proj" in n for n in mnames) and any("down_proj" in n for n in mnames)
    assert all(p.ndim == 2 for _, p in matrices)
    assert {"input_norm.weight", "norm.weight"} <= rnames  # norms, and the vocab-sized matrices, to AdamW
    assert {"embed_tokens.weight", "lm_head.weight"} <= rnames  # (trained: weights=None means its own)
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert mnames | rnames == trainable and not mnames & rnames
    cfg = stage.parse_args(["--hidden-states", "h", "--vocab-mapping", "v", "--target", "t", "--out", "o"])
    muon, adamw = build_optimizers(cfg, draft, cuda=False, lr=3e-3)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in muon.param_groups) == len(matrices)
    cfg.optimizer = "adamw"
    (only,) = build_optimizers(cfg, draft, cuda=False, lr=3e-3)
    assert sum(len(g["params"]) for g in only.param_groups) == len(trainable)


def test_norm_before_fc_is_sized_as_vllm_sizes_it(llama_target_dir):
    """vLLM's Eagle3 Llama builds input_norm over fc's input (n_aux x target hidden); a narrower draft
    must too (speculators sizes it by the draft's width)."""
    from transformers import AutoConfig

    h = AutoConfig.from_pretrained(llama_target_dir).hidden_size
    for hidden in (None, h // 2):
        draft = _draft(llama_target_dir, norm_before_fc=True, hidden_size=hidden)
        assert draft.input_norm.weight.shape == (3 * h,) == (draft.fc.in_features,)
    assert _draft(llama_target_dir).input_norm is None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    return train_inputs(tmp_path_factory.mktemp("recipe"), llama_target_dir, n=16, shard_size=8)


def test_chosen_recipe_is_printed_saved_and_exported(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    run(stage.parse_args(inputs_argv(inputs, out, epochs=None, budget="5")))
    said = capsys.readouterr().out
    assert "recipe: 5 steps" in said and "--budget 5" in said and "muon lr 0.003" in said
    man = json.loads((out / "manifest.json").read_text())
    rec = man["recipe"]
    assert rec["total_steps"] == man["counts"]["steps"] == 5 and rec["optimizer"] == "muon"
    assert rec["norm_before_fc"] is True and rec["steps_per_epoch"] >= 1
    assert json.loads((out / "schedule.json").read_text()) == rec
    assert json.loads((out / "run.json").read_text())["config"]["budget"] == "5"
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["norm_before_fc"] is True  # what vLLM's Eagle3 Llama reads to apply input_norm
    assert "input_norm.weight" in load_file(str(out / "export" / "model.safetensors"))
    assert json.loads((out / "export" / "training_info.json").read_text())["recipe"] == rec


def test_default_lr_falls_with_the_width_by_the_ladders_exponent():
    assert B.default_lr(B.LR_REF_WIDTH) == B.LR_REF
    # the measured rule (docs/measurements.md, the ladder): the best lr falls as sqrt(width)
    assert B.default_lr(4 * B.LR_REF_WIDTH) == pytest.approx(B.LR_REF / 2)
    assert B.default_lr(7168) == pytest.approx(5.67e-4, rel=1e-2)  # Kimi-K2.5's hidden size
    widths = [16, 64, 256, 1024, 7168]
    lrs = [B.default_lr(w) for w in widths]
    assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == len(lrs)
    assert B.choose_lr(1e-3, 7168) == {"lr": 1e-3, "lr_why": "--lr"}  # a given lr is never rescaled
    auto = B.choose_lr(None, 7168)
    assert auto["lr"] == 5.67e-4 and "7168" in auto["lr_why"]
    assert auto["lr_why"].startswith("default")


def test_default_lr_is_chosen_for_the_drafts_width_recorded_and_kept(inputs, tmp_path, capsys):
    """No --lr: the rule for the draft's width (the target's, or --draft-hidden-size), printed, in
    schedule.json and the manifest, and used: the first logged lr follows it."""
    from transformers import AutoConfig

    width = AutoConfig.from_pretrained(inputs["target"]).hidden_size
    for out, hidden in ((tmp_path / "same", None), (tmp_path / "narrow", width // 2)):
        run(stage.parse_args(inputs_argv(inputs, out, lr=None, epochs=None, budget="3", draft_hidden_size=hidden,
                                         warmup_steps=0, schedule="constant")))
        want = B.choose_lr(None, hidden or width)
        assert f"muon lr {want['lr']:g} ({want['lr_why']})" in capsys.readouterr().out
        man = json.loads((out / "manifest.json").read_text())
        assert {k: man["recipe"][k] for k in want} == want
        assert man["config"]["lr"] is None
        assert {r["lr"] for r in read_metrics(out)["train"]} == {want["lr"]}
    assert B.choose_lr(None, width)["lr"] != B.choose_lr(None, width // 2)["lr"]


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_resume_restores_every_optimizer(inputs, tmp_path, optimizer):
    """Stopped after step 4 (checkpoint at 3), rerun: the same trajectory and weights as a run
    that was never stopped, with Muon + AdamW as with AdamW alone."""
    flags = dict(optimizer=optimizer, budget="6", epochs=None)
    ref = tmp_path / "ref"
    run(stage.parse_args(inputs_argv(inputs, ref, **flags)))
    out = tmp_path / "run"

    def stop(step):
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(stage.parse_args(inputs_argv(inputs, out, **flags)), on_step=stop)
    assert [s for s, _ in checkpoints(out)] == [3]
    if optimizer == "muon":
        osd = torch.load(checkpoints(out)[-1][1] / "optimizer.pt", weights_only=False)
        kinds = {k for st in osd["state"].values() for k in st}
        assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= kinds  # both optimizers' states
    run(stage.parse_args(inputs_argv(inputs, out, **flags)))
    a, b = read_metrics(ref)["train"], read_metrics(out)["train"]
    assert [(r["step"], r["loss"], r["lr"]) for r in a] == [(r["step"], r["loss"], r["lr"]) for r in b]
    wa, wb = load_file(str(ref / "export" / "model.safetensors")), load_file(str(out / "export" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_checkpoint_of_another_optimizer_is_refused(inputs, tmp_path):
    out = tmp_path / "run"

    def stop(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(stage.parse_args(inputs_argv(inputs, out, optimizer="adamw", budget="6", epochs=None)), on_step=stop)
    # run.json would refuse the changed flag first; an old record without the field reads as the default
    rj = json.loads((out / "run.json").read_text())
    del rj["config"]["optimizer"]
    (out / "run.json").write_text(json.dumps(rj))
    with pytest.raises(PipelineError, match="trained with --optimizer adamw, but this run uses muon"):
        run(stage.parse_args(inputs_argv(inputs, out, budget="6", epochs=None)))


def test_ce_loss_is_cross_entropy_on_the_targets_top_draft_token():
    from types import SimpleNamespace

    from eagle3_train.train.objective import Objective

    torch.manual_seed(0)
    logits, target = torch.randn(5, 8), torch.randn(5, 8)
    rows = torch.arange(5)
    want = -torch.log_softmax(logits, -1).gather(-1, target.argmax(-1, keepdim=True)).squeeze(-1)
    dense = Objective(torch.nn.Linear(1, 1), 1, [1.0], "eager", False, None, loss="ce")
    per, keep = dense.position_loss(logits, SimpleNamespace(targets=target), rows)
    torch.testing.assert_close(per, want)
    assert keep.all()
    # top-k targets are target-vocab ids: the first one inside the draft vocab is the label
    tgt2draft = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 7])  # target id 0 is outside the draft vocab
    ids = torch.tensor([[0, 3, 2]] * 5)  # sorted by log-prob; 0 (outside) is skipped -> draft id 2
    topk = Objective(torch.nn.Linear(1, 1), 1, [1.0], "eager", True, tgt2draft, loss="ce")
    per, keep = topk.position_loss(logits, SimpleNamespace(topk_ids=ids, topk_lp=torch.zeros(5, 3)), rows)
    torch.testing.assert_close(per, -torch.log_softmax(logits, -1)[:, 2])
    kl = Objective(torch.nn.Linear(1, 1), 1, [1.0], "eager", False, None)
    assert not torch.allclose(kl.position_loss(logits, SimpleNamespace(targets=target), rows)[0], want)


def test_a_time_budget_is_calibrated_once_and_kept_on_resume(inputs, tmp_path):
    out = tmp_path / "run"
    flags = dict(budget="3s", epochs=None, save_every=1)

    def stop(step):
        raise KeyboardInterrupt  # after the first step: the schedule is already fixed

    with pytest.raises(KeyboardInterrupt):
        run(stage.parse_args(inputs_argv(inputs, out, "--max-steps", "6", **flags)), on_step=stop)
    first = (out / "schedule.json").read_bytes()
    sched = json.loads(first)
    assert sched["seconds_per_step"] > 0 and "calibrated" in sched["why"]
    assert sched["total_steps"] == min(6, max(1, int(3 / sched["seconds_per_step"])))
    run(stage.parse_args(inputs_argv(inputs, out, "--max-steps", "6", **flags)))  # resumed: not re-measured
    assert (out / "schedule.json").read_bytes() == first
    assert json.loads((out / "manifest.json").read_text())["counts"]["steps"] == sched["total_steps"]


def test_step_norms_default_by_the_layer_and_the_flags_override():
    """None = measured per layer: on for Llama/Qwen3 (k = 7 holds), off for MLA (no gain there)."""
    from eagle3_train.train.draft import step_norms

    assert step_norms("llama", None, None) == (True, True)
    assert step_norms("qwen3", None, None) == (True, True)
    assert step_norms("mla", None, None) == (False, False)
    assert step_norms("llama", False, None) == (False, True)
    assert step_norms("mla", None, True) == (False, True)


def test_04_exports_the_step_norms_it_trained_with_and_says_so(inputs, tmp_path, capsys):
    """No flag: the Llama draft trains and exports norm_before_residual and norm_output on (what vLLM
    reads to run it as trained); --no-norm-output turns that one off, in the export too."""
    for out, extra, want in ((tmp_path / "default", {}, (True, True)),
                             (tmp_path / "off", {"no_norm_output": True}, (True, False))):
        run(stage.parse_args(inputs_argv(inputs, out, budget="2", epochs=None, **extra)))
        cfg = json.loads((out / "export" / "config.json").read_text())
        assert (cfg["norm_before_residual"], cfg["norm_output"]) == want
        said = capsys.readouterr().out
        assert f"norm_before_residual {'on' if want[0] else 'off'}, norm_output {'on' if want[1] else 'off'}" in said


def test_a_run_recorded_before_the_step_norm_default_resumes_where_it_is_unchanged(inputs, tmp_path):
    """The manifest records the resolved step norms, not None: a run whose record says False (the old
    default, written out) is resumed by the bare command where the layer's default is False too (here a
    DFlash draft), and refused naming the setting where it is now on (the Llama layer)."""
    out = tmp_path / "llama"
    run(stage.parse_args(inputs_argv(inputs, out, budget="2", epochs=None)))
    recorded = json.loads((out / "manifest.json").read_text())["config"]
    assert (recorded["norm_before_residual"], recorded["norm_output"]) == (True, True)
    for arch, refused in (("dflash", False), ("llama", True)):
        old = tmp_path / f"old-{arch}"
        flags = {"budget": "2", "epochs": None, "draft_arch": arch}
        run(stage.parse_args(inputs_argv(inputs, old, **flags, no_norm_before_residual=True, no_norm_output=True)))
        (old / "manifest.json").unlink()  # as if killed before its manifest: the rerun resumes or refuses
        again = stage.parse_args(inputs_argv(inputs, old, **flags))
        if refused:
            with pytest.raises(PipelineError, match="norm_before_residual"):
                run(again)
        else:
            run(again)
            done = json.loads((old / "manifest.json").read_text())["config"]
            assert (done["norm_before_residual"], done["norm_output"]) == (False, False)
