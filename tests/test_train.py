"""04_train in one process on CPU: outputs, resume = uninterrupted, input checks, top-k targets,
packing / split / alignment, and a run on inputs made by the real 02 and 03 stages."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from eagle3_train.common.errors import PipelineError
from eagle3_train.train import run
from eagle3_train.train.checkpoint import checkpoints
from eagle3_train.train.config import METRICS, STAGE
from eagle3_train.train.data import collate, pack, split_ids
from eagle3_train.train.dist import Dist
from eagle3_train.train.inputs import aux_layers, open_inputs
from eagle3_train.train.metrics import read_metrics, validation_series
from eagle3_train.train.model import build_model
from eagle3_train.train.objective import Objective, alignment, prepare
from helpers import inputs_argv, stage_cli
from helpers_train import build_store, tgt2draft, train_inputs
from safetensors.torch import load_file

stage = stage_cli("04_train")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    return train_inputs(tmp_path_factory.mktemp("train"), llama_target_dir, n=20, shard_size=7)


def argv(inputs, out, *extra):
    return inputs_argv(inputs, out, *extra)


def train(inputs, out, *extra, on_step=None):
    return run(stage.parse_args(argv(inputs, out, *extra)), on_step=on_step)


@pytest.fixture(scope="module")
def reference(inputs):
    """One uninterrupted run, shared by the tests that compare against it."""
    out = inputs["root"] / "ref"
    train(inputs, out)
    return out


def test_run_writes_checkpoints_metrics_curves_export_and_manifest(reference, inputs, capsys):
    from eagle3_train.common.manifest import read_manifest

    man = read_manifest(reference, STAGE)
    steps = man["counts"]["steps"]
    assert steps >= 6
    m = read_metrics(reference)
    assert [r["step"] for r in m["train"]] == list(range(1, steps + 1))
    rec = m["train"][-1]
    assert len(rec["loss_by_step"]) == 3 and len(rec["acc_cond"]) == 3 and len(rec["acc_cum"]) == 3
    assert rec["tokens_per_s"] > 0 and rec["lr"] >= 0 and rec["acceptance_length"] >= 1
    assert m["train"][-1]["loss"] < m["train"][0]["loss"]  # it learns
    val_steps = [r["step"] for r in m["val"]]
    assert val_steps == sorted({*range(3, steps + 1, 3), steps})
    assert all(1 <= r["acceptance_length"] <= 4 and len(r["al_by_depth"]) == 3 for r in m["val"])
    # The reported AL is vLLM's walk at full depth; the every-position figure is kept beside it.
    assert all(r["al_by_depth"][-1] == r["acceptance_length"] and 1 <= r["al_all_positions"] <= 4
               for r in m["val"])
    assert man["best"]["acceptance_length"] == max(r["acceptance_length"] for r in m["val"])
    # Acceptance by position (--position-buckets, default): every validation record, all its drafts in
    # the buckets; the last one in the manifest and its plot
    for r in m["val"]:
        bp = r["by_position"]
        assert set(bp) == {"edges", "counts", "rows"} and bp["edges"] == [0, 512, 2048, 8192, 16384]
        assert sum(bp["counts"]["drafts"]) == r["drafts"] > 0 == sum(bp["counts"]["drafts"][1:])  # short samples
        assert bp["rows"][0]["acceptance_length"] == pytest.approx(r["acceptance_length"])
    assert man["by_position"] == m["val"][-1]["by_position"] and man["config"]["position_buckets"] == "512,2k,8k,16k"
    assert (reference / "al_by_position.png").read_bytes()[:4] == b"\x89PNG"
    for k in (3, 7):  # one line per statistic, each named once
        labels = [label for label, _, _ in validation_series(m["val"], k)]
        assert len(set(labels)) == len(labels) == (2 if k == 3 else 3)
    kept = [s for s, _ in checkpoints(reference)]
    best = man["best"]["step"]
    assert kept[-2:] == sorted({*range(3, steps + 1, 3), steps})[-2:] and best in kept
    assert len(kept) <= 3
    ck = checkpoints(reference)[-1][1]
    assert {p.name for p in ck.iterdir()} >= {"weights.pt", "optimizer.pt", "trainer.pt", "state.json",
                                              "rng", "COMPLETE"}
    assert (reference / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "04_train" in (reference / "progress.log").read_text()
    export = reference / "export"
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert man["split"]["val_ids"] and man["counts"]["exported_step"] == best
    # The export holds the best checkpoint's trained tensors.
    w = load_file(str(export / "model.safetensors"))
    ckpt = torch.load(dict(checkpoints(reference))[best] / "weights.pt", weights_only=True)
    assert w["fc.weight"].dtype == torch.bfloat16  # --export-dtype bf16, the default
    assert torch.equal(w["fc.weight"], ckpt["draft.fc.weight"].to(torch.bfloat16))

    # Rerunning the finished command does nothing and says so.
    n_lines = len((reference / METRICS).read_text().splitlines())
    capsys.readouterr()
    train(inputs, reference)
    assert "is complete" in capsys.readouterr().out
    assert len((reference / METRICS).read_text().splitlines()) == n_lines


def test_interrupted_run_resumes_to_the_same_trajectory(reference, inputs, tmp_path):
    """Killed between checkpoints (step 5; last checkpoint at 3), rerun: steps 4-5 are redone and
    every logged loss and the final weights equal the uninterrupted run's."""
    out = tmp_path / "run"

    def stop(step):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(inputs, out, on_step=stop)
    assert not (out / "manifest.json").exists()
    assert [s for s, _ in checkpoints(out)] == [3]
    train(inputs, out)
    ref, got = read_metrics(reference), read_metrics(out)
    assert [r["step"] for r in got["train"]] == [r["step"] for r in ref["train"]]
    for a, b in zip(ref["train"], got["train"]):
        assert (a["loss"], a["loss_by_step"], a["acc_cum"], a["lr"]) == \
            (b["loss"], b["loss_by_step"], b["acc_cum"], b["lr"])
    assert [r["acceptance_length"] for r in ref["val"]] == [r["acceptance_length"] for r in got["val"]]
    assert any(r.get("kind") == "resume" for r in map(json.loads, (out / METRICS).read_text().splitlines()))
    wa = load_file(str(reference / "export" / "model.safetensors"))
    wb = load_file(str(out / "export" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_changed_settings_are_refused_unless_overwrite(reference, inputs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    with pytest.raises(PipelineError, match="lr=0.003.*lr=0.001"):
        train(inputs, out, "--lr", "1e-3", "--max-steps", "2")
    train(inputs, out, "--lr", "1e-3", "--max-steps", "2", "--overwrite")
    moved = [p for p in out.iterdir() if p.name.startswith("replaced-")]
    assert len(moved) == 1 and (moved[0] / "manifest.json").exists() and (moved[0] / "export").is_dir()
    assert json.loads((out / "manifest.json").read_text())["counts"]["steps"] == 2


def test_mismatched_inputs_are_refused_naming_both_values(inputs, tmp_path, deepseek_target_dir):
    bad_map = tmp_path / "map"
    shutil.copytree(inputs["map"], bad_map)
    man = json.loads((bad_map / "manifest.json").read_text())
    man["tokenizer"]["fingerprint"] = "0123456789abcdef"
    (bad_map / "manifest.json").write_text(json.dumps(man))
    fp = json.loads((inputs["store"] / "manifest.json").read_text())["tokenizer"]["fingerprint"]
    with pytest.raises(PipelineError, match=f"tokenizer fingerprint mismatch.*{fp}.*0123456789abcdef"):
        stage.main(argv({**inputs, "map": bad_map}, tmp_path / "a"))

    with pytest.raises(PipelineError, match="target model mismatch.*llama.*deepseek_v3"):
        stage.main(argv({**inputs, "target": deepseek_target_dir}, tmp_path / "b"))

    with pytest.raises(PipelineError, match=r"--aux-layer-ids 1,4,5: layer 1 is not in .*\[2, 4, 5\]"):
        stage.main(argv(inputs, tmp_path / "c", "--aux-layer-ids", "1,4,5"))

    # A mapping over another vocabulary size (its manifest otherwise fine).
    from eagle3_train.vocab.mapping import save_mapping

    small = tmp_path / "map-small"
    shutil.copytree(inputs["map"], small)
    t2d = torch.zeros(400, dtype=torch.bool)
    t2d[:96] = True
    save_mapping(small / "vocab_mapping.safetensors", torch.zeros(96, dtype=torch.long).numpy(), t2d.numpy())
    with pytest.raises(PipelineError, match="target vocab size mismatch.*400.*500"):
        stage.main(argv({**inputs, "map": small}, tmp_path / "d"))

    incomplete = tmp_path / "store-incomplete"
    shutil.copytree(inputs["store"], incomplete)
    (incomplete / "manifest.json").unlink()
    with pytest.raises(PipelineError, match="incomplete"):
        stage.main(argv({**inputs, "store": incomplete}, tmp_path / "e"))
    assert not (tmp_path / "e" / "checkpoints").exists()


def test_damaged_shards_are_refused_naming_the_shard(inputs, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    truncated = tmp_path / "truncated"
    shutil.copytree(inputs["store"], truncated)
    shard = truncated / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(PipelineError, match="shard shard-00001.safetensors .*truncated"):
        stage.main(argv({**inputs, "store": truncated}, tmp_path / "a"))

    nan = tmp_path / "nan"
    shutil.copytree(inputs["store"], nan)
    shard = nan / "shard-00002.safetensors"
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    t = load_file(str(shard))
    t["aux"].view(-1)[5] = float("nan")
    save_file(t, str(shard), metadata=meta)
    from eagle3_train.common.hidden_store import committed_shards

    sid = committed_shards(nan)[2]["ids"][0]
    with pytest.raises(PipelineError, match=f"sample {sid} in shard shard-00002.safetensors .* NaN/inf in aux"):
        stage.main(argv({**inputs, "store": nan}, tmp_path / "b"))
    assert not (tmp_path / "b" / "manifest.json").exists()


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_topk_targets_give_the_same_loss_as_hidden_states(inputs, tmp_path, llama_target_dir, loss):
    """A store keeping the target's full top-k (k = vocab) instead of its last hidden state trains
    on the same distribution: the loss of one batch matches the dense path's, for either loss."""
    from eagle3_train.common.hidden_store import HiddenStates

    topk_store = build_store(tmp_path / "topk", llama_target_dir, n=20, shard_size=7, topk=500)
    dense, sparse = HiddenStates(inputs["store"]), HiddenStates(topk_store)
    config = stage.parse_args(argv(inputs, tmp_path / "x", "--loss", loss))
    inp = open_inputs(config)
    model = build_model(config, inp, Dist())
    draft, head, core = model.draft, model.head, model.objective
    assert not inp.topk and core.loss == loss
    ids = dense.ids[:3]
    b1 = prepare(collate(dense, ids, 256, [0, 1, 2]), head, 3)
    _, loss1, m1 = core(b1)
    core_topk = Objective(draft, 3, [1.0] * 3, "eager", True, tgt2draft(draft), loss=loss)
    b2 = prepare(collate(sparse, ids, 256, [0, 1, 2]), None, 3)
    assert b2.last is None and b2.topk_ids.shape[1] == 500
    _, loss2, m2 = core_topk(b2)
    assert torch.equal(m1["loss_cnt"], m2["loss_cnt"])
    torch.testing.assert_close(loss2, loss1, rtol=2e-3, atol=2e-3)
    # ... and a run on the top-k store trains end to end.
    man = run(stage.parse_args(argv({**inputs, "store": topk_store}, tmp_path / "run", "--max-steps", "3")))
    assert man["counts"]["steps"] == 3 and (tmp_path / "run" / "export" / "model.safetensors").exists()


def test_packing_is_deterministic_and_respects_the_budget():
    import random

    lengths = {f"s{i}": 3 + (i * 37) % 200 for i in range(300)}
    ids = sorted(lengths)
    a = pack(ids, lengths, 512, random.Random("0:0"))
    b = pack(ids, lengths, 512, random.Random("0:0"))
    c = pack(ids, lengths, 512, random.Random("0:1"))
    assert a == b and a != c
    assert sorted(i for batch in a for i in batch) == ids
    assert all(sum(min(lengths[i] - 1, 512) for i in batch) <= 512 for batch in a)
    fill = sum(lengths[i] - 1 for i in ids) / (512 * len(a))
    assert fill > 0.9  # first-fit decreasing wastes little


def test_split_is_fixed_by_id_and_matches_03_rule():
    from eagle3_train.common.split import is_heldout

    ids = [f"x{i}" for i in range(1000)]
    lengths = dict.fromkeys(ids, 10)
    lengths["x0"] = 2  # too short to train on
    train, val, dropped = split_ids(ids, lengths, 0.1, None)
    assert dropped == 1 and not set(train) & set(val)
    assert val == [i for i in ids[1:] if is_heldout(i, 0.1)] and 60 < len(val) < 140
    train2, val2, _ = split_ids(list(reversed(ids)), lengths, 0.1, None)
    assert set(val2) == set(val) and set(train2) == set(train)


def test_held_out_samples_beyond_val_max_go_back_to_training():
    from eagle3_train.common.split import is_heldout

    ids = [f"x{i}" for i in range(400)]
    lengths = dict.fromkeys(ids, 10)
    held = [i for i in ids if is_heldout(i, 0.1)]
    train, val, _ = split_ids(ids, lengths, 0.1, 5)
    assert val == held[:5] and sorted(train + val) == sorted(ids) and not set(train) & set(val)
    assert set(held[5:]) <= set(train)


def test_a_sample_longer_than_a_batch_is_trained_whole(inputs, tmp_path):
    """--max-tokens-per-batch below the longest sample: it gets a batch of its own and every one
    of its tokens (and supervised positions) is in that step; nothing is reported cut."""
    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.train.data import Loader, make_plan

    hs = HiddenStates(inputs["store"])
    lengths = {i: hs.length(i) for i in hs.ids}
    cap = sorted(lengths.values())[len(lengths) // 2]  # half the samples are longer
    config = stage.parse_args(argv(inputs, tmp_path / "run", "--max-tokens-per-batch", str(cap)))
    plan = make_plan(hs, config, 1)
    assert plan.cut["train"]["samples"] == plan.cut["val"]["samples"] == 0
    assert plan.cut["own_batch"] == sum(n - 1 > cap for n in lengths.values()) > 0
    loader = Loader(hs, plan, config, [0, 1, 2], 0, 1, "sdpa")
    seen = set()
    for step in range(plan.steps_in(0)):
        (batch,), = [loader.step(step)]
        ids = plan.epochs[0][step]
        assert batch.tokens == sum(lengths[i] - 1 for i in ids)
        assert int(batch.full_mask.sum()) == sum(int(hs.get(i).loss_mask.sum()) for i in ids)
        if any(lengths[i] - 1 > cap for i in ids):
            assert len(ids) == 1
        seen |= set(ids)
    assert seen == set(plan.train)
    # flex compiles per length: a batch longer than the padded cap is padded to a multiple of it
    long_id = max(plan.train, key=lengths.get)
    padded = collate(hs, [long_id], None, [0, 1, 2], pad_to=16)
    assert padded.aux.shape[1] % 16 == 0 and padded.aux.shape[1] - 16 < lengths[long_id] - 1 <= padded.aux.shape[1]


def test_samples_cut_by_max_sample_tokens_are_reported_loudly(inputs, tmp_path, capsys):
    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.common.manifest import read_manifest

    hs = HiddenStates(inputs["store"])
    lengths = sorted(hs.length(i) for i in hs.ids)
    limit = lengths[len(lengths) // 2]
    out = tmp_path / "run"
    train(inputs, out, "--max-sample-tokens", str(limit), "--max-steps", "2", "--save-every", "2",
          "--export-dtype", "fp32", "--val-max-samples", "1", "--position-buckets", "8,16")
    text = capsys.readouterr().out
    man = read_manifest(out, STAGE)
    # the last validation's acceptance by position, printed once at the end, as the manifest keeps it
    from eagle3_train.common.positions import table

    assert man["by_position"]["edges"] == [0, 8, 16] and man["config"]["position_buckets"] == "8,16"
    assert text.count("validation acceptance by position") == 1 and table(man["by_position"]["rows"], 3) in text
    # One held-out sample validates, the others train; 05's offline set is exactly that one.
    from eagle3_train.common.split import is_heldout
    from eagle3_train.evaluate.draft import describe_draft
    from eagle3_train.evaluate.offline import heldout_ids

    assert len(man["split"]["val_ids"]) == 1 and sum(is_heldout(i, 0.25) for i in hs.ids) > 1
    assert man["counts"]["train_samples"] == len(hs.ids) - 1 - man["counts"]["dropped_short"]
    assert heldout_ids(hs.ids, describe_draft(out / "export"))[0] == man["split"]["val_ids"]
    cut = man["cut"]["train"]
    assert cut["samples"] > 0 and cut["max_sample_tokens"] == limit and 0 < cut["token_share"] < 1
    assert man["counts"]["cut_train_samples"] == cut["samples"]
    assert f"warning: {cut['samples']} of {man['counts']['train_samples']} train samples are longer than " \
           f"--max-sample-tokens {limit} and cut: {cut['tokens']:,} tokens ({cut['token_share']:.1%}" in text
    # --export-dtype fp32: the export is the checkpoint's tensors bit for bit
    w = load_file(str(out / "export" / "model.safetensors"))
    ckpt = torch.load(dict(checkpoints(out))[man["counts"]["exported_step"]] / "weights.pt", weights_only=True)
    assert w["fc.weight"].dtype == torch.float32 and torch.equal(w["fc.weight"], ckpt["draft.fc.weight"])


def test_collate_aligns_steps_within_documents(inputs):
    """Step k drafting after token t targets token t+1+k of the same document, supervised only."""
    from eagle3_train.common.hidden_store import HiddenStates

    hs = HiddenStates(inputs["store"])
    ids = hs.ids[:3]
    b = collate(hs, ids, 1024, [0, 1, 2])
    lens = [hs.length(i) for i in ids]
    assert b.aux.shape[1] == b.ids.shape[1] == sum(n - 1 for n in lens) and b.n_docs == 3
    valid = alignment(b, 4)
    starts = [0, lens[0], lens[0] + lens[1]]
    for k in range(4):
        expect = 0
        for d, (s, n) in enumerate(zip(starts, lens)):
            mask = hs.get(ids[d]).loss_mask
            expect += int(mask[1 + 1 + k:].sum())  # drafts start at t >= 1, target t+1+k supervised
        assert int(valid[k].sum()) == expect
    # no step reaches across a document boundary
    doc = b.full_doc
    for k in range(4):
        t = valid[k].nonzero().squeeze(1)
        assert (doc[t] == doc[t + 1 + k]).all() and (doc[t] >= 0).all()


def test_trains_on_inputs_from_the_real_02_and_03_stages(tmp_path, llama_target_dir, k25_tokenizer_dir):
    from helpers import make_training_set

    data = make_training_set(tmp_path / "tok", k25_tokenizer_dir, n=10)
    stage_cli("02_extract_hidden_states").main(
        ["--input", str(data), "--output", str(tmp_path / "hs"), "--model", str(llama_target_dir),
         "--storage", "fp32"])
    stage_cli("03_build_vocab_mapping").main(
        ["--data", str(data), "--target", str(llama_target_dir), "--out", str(tmp_path / "vocab"),
         "--draft-vocab-size", "80"])
    inp = {"store": tmp_path / "hs", "map": tmp_path / "vocab", "target": llama_target_dir}
    man = run(stage.parse_args(argv(inp, tmp_path / "run", "--max-steps", "2", "--val-fraction", "0.2")))
    assert man["counts"]["steps"] == 2
    cfg = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 80


@pytest.mark.gpu
def test_cuda_fast_paths_follow_the_eager_paths(inputs, tmp_path):
    """On CUDA the defaults are compiled flex attention + (with --loss kl) speculators' fused Triton KL in bf16;
    on the same batches they follow sdpa + eager KL. CPU twins: the runs above (sdpa + eager) and
    test_draft's flex-vs-sdpa logits check."""
    train(inputs, tmp_path / "fast", "--device", "cuda", "--loss", "kl", "--max-steps", "4")
    train(inputs, tmp_path / "eager", "--device", "cuda", "--loss", "kl", "--attn", "sdpa", "--loss-impl", "eager",
          "--max-steps", "4")
    fast = [r["loss"] for r in read_metrics(tmp_path / "fast")["train"]]
    eager = [r["loss"] for r in read_metrics(tmp_path / "eager")["train"]]
    assert len(fast) == len(eager) == 4
    assert fast[0] == pytest.approx(eager[0], rel=2e-2)
    assert fast == pytest.approx(eager, rel=1e-1)
    assert (tmp_path / "fast" / "export" / "model.safetensors").exists()


def test_aux_layers_are_read_in_vllms_order(capsys):
    # A store written in another order is read ascending (collate picks the columns by index).
    assert aux_layers(None, [4, 2, 5], 8, "hs") == [2, 4, 5]
    assert "[4, 2, 5]" in capsys.readouterr().out
    assert aux_layers([5, 2], [2, 4, 5], 8, "hs") == [2, 5]
    for asked, stored, needle in [([2, 2], [2, 4, 5], "more than once"), ([0, 2], [2, 4, 5], "id 0"),
                                  (None, [2, 4, 4], "--aux-layer-ids 2,4")]:
        with pytest.raises(PipelineError, match=needle):
            aux_layers(asked, stored, 8, "hs")
