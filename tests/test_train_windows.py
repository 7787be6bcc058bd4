"""04 --window-tokens (issue 15): a sample longer than a window trains as consecutive windows that
carry context; every supervised position is trained once an epoch, the context carries no loss,
validation stays on whole samples, and the setting is part of the recipe a resume must keep."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from eagle3_train.common.errors import PipelineError
from eagle3_train.train import run
from eagle3_train.train.data import Loader, collate, make_plan, pieces, windows
from eagle3_train.train.dist import Dist
from eagle3_train.train.inputs import open_inputs
from eagle3_train.train.model import build_model
from eagle3_train.train.objective import alignment, prepare
from helpers import inputs_argv, stage_cli
from helpers_train import train_inputs

stage = stage_cli("04_train")
AUX = [0, 1, 2]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    return train_inputs(tmp_path_factory.mktemp("windows"), llama_target_dir, n=16, shard_size=8)


@pytest.fixture(scope="module")
def store(inputs):
    from eagle3_train.common.hidden_store import HiddenStates

    return HiddenStates(inputs["store"])


def test_windows_tile_the_draft_positions_with_context_before_each():
    assert windows(10, 4, 2) == [(1, 5, 1), (3, 9, 5), (7, 10, 9)]
    assert windows(10, 4, 0) == [(1, 5, 1), (5, 9, 5), (9, 10, 9)]
    assert windows(5, 4, 2) == [(1, 5, 1)]  # 4 draft positions: one window, no context
    for length in (3, 7, 64, 65, 66, 301):
        for n, c in ((64, 0), (64, 32), (5, 4), (1, 0)):
            w = windows(length, n, c)
            loss = [t for _, stop, lo in w for t in range(lo, stop)]
            assert loss == list(range(1, length))  # each draft position carries the loss once
            assert all(0 < stop - lo <= n and start == max(1, lo - c) for start, stop, lo in w)


def test_pieces_carry_a_lookahead_and_respect_max_sample_tokens():
    lengths = {"a": 20, "b": 6}
    ps, sizes = pieces(["a", "b"], lengths, 8, 3, 2)
    # tokens [a, b) with draft positions [loss_from, loss_to) trained; 2 tokens past for the TTT steps
    assert ps == [("a", 0, 11, 1, 9), ("a", 5, 19, 9, 17), ("a", 13, 20, 17, 20), ("b", 0, 6, 1, 6)]
    assert sizes[ps[1]] == 14
    cut, _ = pieces(["a"], lengths, 8, 3, 2, max_sample=10)  # 11 tokens left, 10 draft positions
    assert cut == [("a", 0, 11, 1, 9), ("a", 5, 11, 9, 11)]


def trained(store, batches, steps: int) -> Counter:
    """(sample, position t, step k) of every draft step that carries a loss in `batches`."""
    out = Counter()
    for units in batches:
        b = collate(store, units, None, AUX)
        valid = alignment(b, steps) & (b.live if b.live is not None else True)
        off = 0
        for u in units:
            sid, a, end = (u, 0, store.length(u)) if isinstance(u, str) else u[:3]
            for k, t in valid[:, off:off + end - a].nonzero().tolist():
                out[(sid, a + t, k)] += 1
            off += end - a
    return out


@pytest.mark.parametrize("context", [0, 3])
def test_an_epoch_of_windows_trains_every_supervised_position_once(inputs, store, tmp_path, context):
    base = inputs_argv(inputs, tmp_path / "run", max_tokens_per_batch=64)
    whole = make_plan(store, stage.parse_args(base), 1)
    config = stage.parse_args([*base, "--window-tokens", "8", "--window-context", str(context)])
    plan = make_plan(store, config, 1)
    assert plan.train == whole.train and plan.val == whole.val
    assert plan.cut["windows"] > len(plan.train)  # the test samples are longer than 8 positions
    assert all(not isinstance(u, str) for batch in plan.epochs[0] for u in batch)
    assert all(sum(u[2] - u[1] - 1 for u in batch) <= 64 for batch in plan.epochs[0])
    a, b = trained(store, whole.epochs[0], 3), trained(store, plan.epochs[0], 3)
    assert sum(a.values()) > 0 and set(a.values()) == {1}
    assert b == a  # the same (sample, position, step) triples, each once
    # validation batches stay whole samples
    loader = Loader(store, plan, config, AUX, 0, 1, "sdpa")
    assert sorted(i for batch in loader.val_batches for i in batch) == sorted(plan.val)


@pytest.fixture(scope="module")
def model(inputs, tmp_path_factory):
    config = stage.parse_args(inputs_argv(inputs, tmp_path_factory.mktemp("m") / "x"))
    return build_model(config, open_inputs(config), Dist())


def losses(model, store, units) -> tuple[torch.Tensor, torch.Tensor]:
    b = prepare(collate(store, units, None, AUX), model.head, 3)
    with torch.no_grad():
        _, _, m = model.objective(b)
    return m["loss_sum"], m["loss_cnt"]


def test_windows_seeing_their_whole_prefix_give_the_whole_sample_loss(model, store):
    """Context back to the sample's start (and the lookahead): the same loss, position by position,
    as the whole sample, so the windows change only what the draft attends to."""
    sid = max(store.ids, key=store.length)
    ps, _ = pieces([sid], {sid: store.length(sid)}, 8, 10**6, 3)
    assert len(ps) > 2
    s_whole, n_whole = losses(model, store, [sid])
    s_win, n_win = losses(model, store, ps)
    assert torch.equal(n_win, n_whole)
    torch.testing.assert_close(s_win, s_whole, rtol=1e-4, atol=1e-4)


def test_context_positions_carry_no_loss(model, store):
    sid = max(store.ids, key=store.length)
    ps, _ = pieces([sid], {sid: store.length(sid)}, 8, 4, 3)
    for p in ps[1:]:  # a window with supervised positions (the first may be all prompt)
        b = prepare(collate(store, [p], None, AUX), model.head, 3)
        if all(r.numel() for r in b.rows):
            break
    ctx = p[3] - p[1] - 1  # shifted rows of the context
    assert ctx == 4 and all(int(r.min()) >= ctx for r in b.rows)
    assert not b.live[:p[3] - p[1]].any() and b.live[p[3] - p[1]:p[4] - p[1]].all()
    # the target at a context position changes nothing; at a trained one it changes the loss
    base = model.objective(b)[1]
    for rows, same in ((slice(0, ctx), True), (slice(ctx, p[4] - p[1] - 1), False)):
        c = prepare(collate(store, [p], None, AUX), model.head, 3)
        c.targets = c.targets.clone()
        c.targets[rows] = c.targets[rows].flip(-1)
        with torch.no_grad():
            assert torch.equal(model.objective(c)[1], base) == same


def test_window_flags_are_checked(inputs, tmp_path):
    base = inputs_argv(inputs, tmp_path / "run")
    assert stage.parse_args([*base, "--window-tokens", "64"]).context_tokens == 16
    assert stage.parse_args(base).context_tokens == 0
    for bad, msg in ((["--window-tokens", "8", "--window-context", "8"], "--window-context must be in"),
                     (["--window-context", "2"], "needs --window-tokens"),
                     (["--window-tokens", "-1"], "--window-tokens must be at least 0")):
        with pytest.raises(PipelineError, match=msg):
            stage.parse_args([*base, *bad])


def test_windows_are_in_the_recipe_and_a_resume_keeps_them(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    flags = dict(epochs=None, budget="3", window_tokens=8, window_context=2)
    man = run(stage.parse_args(inputs_argv(inputs, out, **flags)))
    assert "windows of 8 positions after up to 2 of context" in capsys.readouterr().out
    assert man["recipe"]["window_tokens"] == 8 and man["recipe"]["window_context"] == 2
    assert json.loads((out / "run.json").read_text())["config"]["window_tokens"] == 8
    with pytest.raises(PipelineError, match="window.context"):
        run(stage.parse_args(inputs_argv(inputs, out, **{**flags, "window_context": 3})))
