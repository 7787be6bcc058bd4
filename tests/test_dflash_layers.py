"""A DFlash draft of N layers reading one target layer per draft layer (04 --target-layers
per-draft-layer): the field's rule for which layers (one function, common/formats.py, used by 02's
--layers dflash:N, 04 and 00_plan), the export vLLM reads, 05 over a store holding more layers than
the draft reads, 00's figures for N layers, and the refusals. vLLM serving this shape is checked in
test_dflash.py's served test (its draft is 2 layers reading 2 target layers)."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.formats import dflash_target_layers
from eagle3_train.train import run
from helpers import inputs_argv, stage_cli
from helpers_train import build_mapping, build_store
from safetensors import safe_open

train_stage, plan_stage = stage_cli("04_train"), stage_cli("00_plan")
STORED = [2, 4, 5, 6]  # the tiny Llama's (8 layers) default aux layers 2,4,5 and dflash:2's 2,6
PER_LAYER = {"draft_arch": "dflash", "block_size": 4, "draft_layers": 2, "target_layers": "per-draft-layer"}


def test_the_rule_picks_the_layers_the_published_drafts_read():
    """z-lab's rule (target_layer_ids = outputs of layers 1 .. N-3 evenly; one layer: N // 2), + 1 for
    the residual-stream ids vLLM's aux_hidden_state_layer_ids take (it reads target_layer_ids = id - 1)."""
    target_layer_ids = lambda n, d: [i - 1 for i in dflash_target_layers(n, d)]  # noqa: E731
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B DFlash (5 layers) config
    assert target_layer_ids(36, 1) == [18]
    assert dflash_target_layers(61, 5) == [2, 16, 31, 45, 59]  # Kimi-K2.5
    assert len(dflash_target_layers(61, 6)) == 6
    assert dflash_target_layers(8, 2) == [2, 6]  # the tiny targets'
    with pytest.raises(PipelineError, match="--draft-layers 5 or fewer"):
        dflash_target_layers(8, 6)  # two draft layers would read one target layer
    from eagle3_train.extract.stage import parse_layers

    # 02's preset is the same function
    assert parse_layers("dflash:5", 61) == dflash_target_layers(61, 5)
    with pytest.raises(PipelineError, match="--layers 'dflash:x': dflash:N takes"):
        parse_layers("dflash:x", 61)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    root = tmp_path_factory.mktemp("dflash_layers")
    store = build_store(root / "store", llama_target_dir, n=16, shard_size=8, layer_ids=STORED)
    return {"store": store, "map": build_mapping(root / "map", store, llama_target_dir, 96),
            "target": llama_target_dir, "root": root}


def test_a_draft_of_two_layers_reads_two_target_layers_as_vllm_loads_it(inputs, llama_target_dir):
    """Trained on a store holding more layers than it reads: the export names the two it reads
    (vLLM's target_layer_ids = id - 1), fc takes 2 x H, two Qwen3 layers; 00's parameter count is
    the export's; 05 reads that store too (its aux axis picked as 04 picks it): the draft proposes
    the very tokens it proposes over a store of exactly its two layers."""
    out = inputs["root"] / "run"
    run(train_stage.parse_args(inputs_argv(inputs, out, **PER_LAYER, epochs=2, val_fraction=0.25)))
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["aux_hidden_state_layer_ids"] == [2, 6]
    layer = cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 2 and len(layer["layer_types"]) == 2
    with safe_open(str(out / "export" / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    H = cfg["target_hidden_size"]
    assert shapes["fc.weight"] == [layer["hidden_size"], 2 * H] and "layers.1.mlp.down_proj.weight" in shapes
    man = json.loads((out / "manifest.json").read_text())
    assert man["config"]["target_layers"] == "per-draft-layer" and man["layer_ids"] == [2, 6]

    from eagle3_train.plan import planner

    shape = planner.Shape.from_config(json.loads((llama_target_dir / "config.json").read_text()))
    flags = planner.Flags(samples=16, tokens_per_sample=100, draft_vocab_size=96, n_aux=2, draft_layers=2,
                          draft_arch="dflash")
    p = planner.draft_params(shape, flags)
    numel = sum(_numel(s) for k, s in shapes.items() if k not in ("d2t", "t2d"))
    assert sum(p.values()) - p["embed"] == numel + H  # + the mask embedding, shipped beside

    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.evaluate.draft import describe_draft, load_draft, load_target_head
    from eagle3_train.common.hidden_checks import read_sample
    from eagle3_train.evaluate.offline import check_store, draft_step_tokens, heldout_ids, offline_eval

    store = HiddenStates(inputs["store"])
    index = check_store(store, cfg, store.manifest["target"])
    assert index == [STORED.index(2), STORED.index(6)]
    ids, how = heldout_ids(store.ids, describe_draft(out / "export"))
    assert ids and not how.startswith("all"), how
    draft, head = load_draft(out / "export", llama_target_dir), load_target_head(llama_target_dir)
    off = offline_eval(draft, head, store, ids, 3, aux_index=index)
    assert off["drafts"] > 0 and off["samples"] == len(ids)
    # the proposals are those over a store of exactly the draft's two layers (the same samples)
    exact = HiddenStates(build_store(inputs["root"] / "exact", llama_target_dir, n=16, shard_size=8,
                                     layer_ids=[2, 6]))
    assert check_store(exact, cfg, exact.manifest["target"]) is None
    samples = lambda st: [read_sample(st, i) for i in ids]  # noqa: E731
    picked, whole = draft_step_tokens(draft, samples(store), 3, index), draft_step_tokens(draft, samples(exact), 3)
    assert all(torch.equal(a, b) for p, w in zip(picked, whole) for a, b in zip(p, w))
    wrong = draft_step_tokens(draft, samples(store), 3, [0, 2])  # layers 2, 5: the proposals tell them apart
    assert not all(torch.equal(a, b) for p, w in zip(wrong, whole) for a, b in zip(p, w))
    assert offline_eval(draft, head, exact, ids, 3)["counts"] == off["counts"]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_bad_inputs_are_one_error_line_before_any_work(inputs, tmp_path, capsys):
    """04: one `error:` line naming the flag and the fix, exit 2, nothing written."""
    bad = [({"draft_arch": "llama", "target_layers": "per-draft-layer", "block_size": None}, "--target-layers"),
           ({"draft_layers": 6}, "--draft-layers 5 or fewer"),  # 6 layers over the target's 8: a repeat
           ({"draft_layers": 5}, "--layers dflash:5"),  # reads 2,3,4,5,6: the store lacks 3
           ({"aux_layer_ids": "2,6"}, "--aux-layer-ids")]
    out = tmp_path / "x"
    for flags, msg in bad:
        assert run_main(train_stage.main, inputs_argv(inputs, out, **{**PER_LAYER, **flags})) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], (flags, err)
        assert not out.exists()
    with pytest.raises(SystemExit) as e:  # argparse's own refusal of a value it does not list
        train_stage.main(inputs_argv(inputs, out, **{**PER_LAYER, "target_layers": "every"}))
    assert e.value.code == 2 and "--target-layers" in capsys.readouterr().err and not out.exists()
    # the store-lacking line names both 02 commands that make a store this draft can read
    run_main(train_stage.main, inputs_argv(inputs, tmp_path / "y", **{**PER_LAYER, "draft_layers": 5}))
    assert "--layers 2,3,4,5,6 (these and the store's)" in capsys.readouterr().err


def test_00_plans_n_layers_reading_n_target_layers(tmp_path, capsys):
    """00's 02 store grows with the layers stored (one per draft layer), 04's draft with its layers
    (weights, checkpoint, export; the assumed tok/s falls with them); the refusals match 04's."""
    from pathlib import Path

    from eagle3_train.plan import planner

    kimi = str(Path(__file__).parents[1] / "docs" / "kimi-k2.5-text-config.json")
    common = ["--target", kimi, "--gpu-memory-gb", "96", "--json", "--draft-arch", "dflash"]

    def plan(*extra):
        assert run_main(plan_stage.main, [*common, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    one, five = plan(), plan("--draft-layers", "5", "--target-layers", "per-draft-layer")
    assert five["flags"]["n_aux"] == 5 and five["flags"]["draft_layers"] == 5
    s1, s5 = one["stages"], five["stages"]
    shape = planner.Shape.from_config(json.loads(Path(kimi).read_text()))
    per_token = lambda n: planner.bytes_per_token("bf16", n, shape.hidden, 0)  # noqa: E731
    assert s5["02"]["disk"] / s1["02"]["disk"] == pytest.approx(per_token(5) / per_token(3), rel=1e-3)
    layer = planner.layer_params(shape, planner.Flags(samples=1, tokens_per_sample=1, draft_arch="dflash"))
    grown = s5["04"]["memory_parts"]["params"] - s1["04"]["memory_parts"]["params"]
    assert grown == 4 * layer + 2 * shape.hidden ** 2  # four more layers; fc over 5 target layers, not 3
    assert s5["04"]["checkpoint"] > 3 * s1["04"]["checkpoint"] and s5["04"]["export_bf16"] > s1["04"]["export_bf16"]
    assert s5["04"]["rate_tok_s"] < s1["04"]["rate_tok_s"] / 2 and "5 layers" in s5["04"]["rate_source"]
    # the same 5 layers reading the store's 3 aux layers: the same store as one layer's
    assert plan("--draft-layers", "5")["stages"]["02"]["disk"] == s1["02"]["disk"]
    for extra, msg in ((["--draft-layers", "60", "--target-layers", "per-draft-layer"], "--draft-layers 58 or fewer"),
                       (["--target-layers", "per-draft-layer", "--n-aux", "4"], "--n-aux"),
                       (["--draft-arch", "llama", "--target-layers", "per-draft-layer"], "--target-layers")):
        assert run_main(plan_stage.main, [*common, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], err
