"""The manifest chain: each stage's manifest records what it consumed (paths, hashes, tokenizer,
target config, layer ids, sizes, dtype), and the next stage refuses an input made with something
else, or not finished, in one line that names both values.

The chain is made by the real stages end to end (reliability.Chain): prompts -> 01b (against the
fake OpenAI server, with the tiny k25 tokenizer's ids) -> 01c -> 02 -> 03 -> 04 -> 05 (offline)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from eagle3_train.common.manifest import describe_target, manifest_identity, tokenizer_fingerprint
from eagle3_train.common.store import file_sha256
from helpers import make_training_set, stage_cli, train_argv
from reliability import CHAIN_TRAIN, HS_ARGS, assert_one_error_line, chain, fault_server, run_inprocess  # noqa: F401

pytestmark = pytest.mark.e2e  # stage processes, kill -9, real files: the slow part of the suite


def ok(script: str, argv) -> None:
    assert stage_cli(script).main([str(a) for a in argv]) == 0


def manifest(d: Path) -> dict:
    return json.loads((Path(d) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def real(chain):
    """Every stage's output, made by the stages themselves (reliability.Chain)."""
    return {"gen": chain.gen, "tok": chain.tokenized, "hs": chain.hs, "vocab": chain.vocab, "run": chain.run,
            "eval": chain.eval, "prompts": chain.prompts, "target": chain.target, "n": chain.N_PROMPTS}


# ----------------------------------------------------------------------------- what each consumed

def test_each_manifest_records_what_it_consumed(real, k25_tokenizer, llama_target_dir):
    from transformers import AutoConfig

    fp = tokenizer_fingerprint(k25_tokenizer)
    target = {k: v for k, v in describe_target(AutoConfig.from_pretrained(llama_target_dir), "").items()
              if k != "name_or_path"}
    same_target = lambda m: {k: m["target"][k] for k in target} == target  # noqa: E731
    data = real["tok"] / "data.jsonl"

    gen = manifest(real["gen"])
    assert gen["inputs"]["prompts"]["sha256"] == file_sha256(real["prompts"])
    assert gen["target"]["model"] == "fake" and gen["counts"]["answered"] == real["n"]

    tok = manifest(real["tok"])
    assert tok["stage"] == "01c_tokenize"
    assert tok["inputs"]["raw_responses"]["sha256"] == file_sha256(real["gen"] / "raw_responses.jsonl")
    assert tok["tokenizer"]["fingerprint"] == fp and tok["tokenizer"]["vocab_size"] == len(k25_tokenizer)
    assert {"think_start_id", "think_end_id", "end_of_turn_id"} <= set(tok["chat_format"])

    hs = manifest(real["hs"])
    assert hs["inputs"]["training_set"]["sha256"] == file_sha256(data)
    assert hs["tokenizer"]["fingerprint"] == fp and same_target(hs)
    assert hs["layer_ids"] == [2, 4, 5, 8] and hs["hidden_size"] == 128
    assert hs["storage"]["format"] == "fp8" and "float8" in hs["storage"]["aux"]

    voc = manifest(real["vocab"])
    assert voc["inputs"]["data"]["sha256"] == file_sha256(data)
    assert voc["inputs"]["data_manifest"]["sha256"] == file_sha256(real["tok"] / "manifest.json")
    assert voc["tokenizer"]["fingerprint"] == fp and same_target(voc)
    assert voc["target_vocab_size"] == 500 and voc["draft_vocab_size"] == 100

    run = manifest(real["run"])  # inputs by manifest content (an identical rerun upstream is the same input)
    assert run["inputs"]["hidden_states"]["manifest_identity"] == manifest_identity(real["hs"])
    assert run["inputs"]["vocab_mapping"]["manifest_identity"] == manifest_identity(real["vocab"])
    assert run["tokenizer"]["fingerprint"] == fp and same_target(run)
    assert run["layer_ids"] == [2, 4, 5]
    assert run["draft"]["target_hidden_size"] == 128 and run["draft"]["draft_vocab_size"] == 100
    export = json.loads((real["run"] / "export" / "config.json").read_text())
    assert export["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and export["draft_vocab_size"] == 100

    ev = manifest(real["eval"])
    assert ev["inputs"]["store"]["sha256"] == file_sha256(real["hs"] / "manifest.json")
    draft = ev["inputs"]["draft"]  # the export by its files' hashes, and the run it came from
    for name in ("config.json", "model.safetensors"):
        assert draft["files"][name]["sha256"] == file_sha256(real["run"] / "export" / name)
    assert Path(draft["manifest"]["path"]) == (real["run"] / "manifest.json").resolve()
    assert ev["tokenizer"]["fingerprint"] == fp and same_target(ev)


# ----------------------------------------------------------------------------- made with something else

@pytest.fixture(scope="module")
def other_tokenizer_data(tmp_path_factory, thinking_first_tokenizer_dir):
    """A tokenized set made with another tokenizer (the K2-Thinking-style template)."""
    return make_training_set(tmp_path_factory.mktemp("tf") / "tok", thinking_first_tokenizer_dir, n=4, seed=2)


def test_02_refuses_data_tokenized_with_another_tokenizer(real, other_tokenizer_data, tmp_path, capfd, k25_tokenizer):
    theirs = manifest(other_tokenizer_data)["tokenizer"]["fingerprint"]
    res = run_inprocess("02_extract_hidden_states", ["--input", other_tokenizer_data, "--model", real["target"],
                                                "--output", tmp_path / "hs", *HS_ARGS], capfd)
    assert_one_error_line(res, "tokenizer", theirs, tokenizer_fingerprint(k25_tokenizer))
    assert not (tmp_path / "hs" / "manifest.json").exists()


def test_03_refuses_data_tokenized_with_another_tokenizer(real, other_tokenizer_data, tmp_path, capfd, k25_tokenizer):
    theirs = manifest(other_tokenizer_data)["tokenizer"]["fingerprint"]
    res = run_inprocess("03_build_vocab_mapping", ["--data", other_tokenizer_data, "--target", real["target"],
                                              "--out", tmp_path / "v"], capfd)
    assert_one_error_line(res, "tokenizer", theirs, tokenizer_fingerprint(k25_tokenizer))


def test_04_refuses_a_vocab_mapping_built_for_another_target(real, tmp_path, capfd, deepseek_target_dir):
    other = tmp_path / "vocab-deepseek"
    ok("03_build_vocab_mapping", ["--data", real["tok"], "--target", deepseek_target_dir, "--out", other,
                                  "--draft-vocab-size", "100"])
    res = run_inprocess("04_train", train_argv(real["hs"], other, real["target"], tmp_path / "run",
                                               preset=CHAIN_TRAIN), capfd)
    assert_one_error_line(res, "target", "deepseek_v3", "llama", str(other))
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_04_refuses_layer_ids_the_store_does_not_hold(real, tmp_path, capfd):
    res = run_inprocess("04_train", train_argv(real["hs"], real["vocab"], real["target"], tmp_path / "run",
                                               preset=CHAIN_TRAIN, aux_layer_ids="1,3,6"), capfd)
    assert_one_error_line(res, "--aux-layer-ids 1,3,6", "layers 1, 3, 6 are not in", "[2, 4, 5]", "02 --layers")


def test_05_refuses_a_store_with_other_layers_than_the_draft_reads(real, tmp_path, capfd):
    other = tmp_path / "hs-136"
    small = tmp_path / "tok"
    shutil.copytree(real["tok"], small, ignore=shutil.ignore_patterns(".lock", "progress.log"))
    ok("02_extract_hidden_states", ["--input", small, "--model", real["target"], "--output", other,
                                    *HS_ARGS, "--layers", "1,3,6"])
    res = run_inprocess("05_evaluate", ["--draft", real["run"] / "export", "--store", other,
                                        "--output-dir", tmp_path / "ev"], capfd)
    assert_one_error_line(res, "layer", "[2, 4, 5]", "[1, 3, 6]")


def test_05_refuses_a_draft_for_another_target(real, tmp_path, capfd, deepseek_target_dir):
    res = run_inprocess("05_evaluate", ["--draft", real["run"] / "export", "--target", deepseek_target_dir,
                                        "--store", real["hs"], "--output-dir", tmp_path / "ev"], capfd)
    assert_one_error_line(res, "mismatch", "64", "128")  # deepseek's hidden size vs the draft's target's


def test_05_refuses_heldout_prompts_the_draft_trained_on(real, tmp_path, capfd):
    """The chain read back (04's manifest -> its store -> the store's ids, less 04's validation
    ids) is what 01b answered and 04 trained on; 05 refuses those as --prompts before any server."""
    from eagle3_train.common.lineage import draft_trained_ids
    from eagle3_train.common.prompts import load_prompts
    from helpers_generate import write_prompts

    asked = load_prompts(str(real["prompts"])).ids
    val = set(manifest(real["run"])["split"]["val_ids"])
    assert val and draft_trained_ids(real["run"] / "export") == set(asked) - val
    trained = [i for i in asked if i not in val]
    prompts = write_prompts(tmp_path / "p.jsonl", ["new question", "old question"], ids=["unseen", trained[0]])
    res = run_inprocess("05_evaluate", ["--draft", real["run"] / "export", "--prompts", prompts, "--arms", "eagle3",
                                        "--output-dir", tmp_path / "ev", "--num-prompts", "1"], capfd)
    assert_one_error_line(res, f"1 of 2 --prompts ids were in the draft's training set (e.g. {trained[0]!r})",
                          "01_split_prompts.py")
    assert not (tmp_path / "ev").exists() and "vllm" not in res.stdout.lower()


# ----------------------------------------------------------------------------- not finished

def unfinished(src: Path, dst: Path) -> Path:
    """What a killed stage leaves: its outputs without the manifest."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock", "manifest.json"))
    return dst


@pytest.mark.parametrize("link", ["01b->01c", "tokenize->02", "tokenize->03", "02->04", "03->04", "02->05", "04->05"])
def test_the_next_stage_refuses_an_unfinished_output(link, real, tmp_path, capfd, k25_tokenizer_dir):
    up, down = link.split("->")
    src = {"01b": "gen", "tokenize": "tok", "02": "hs", "03": "vocab", "04": "run"}[up]
    d = {k: real[k] for k in ("gen", "tok", "hs", "vocab", "run")}
    d[src] = unfinished(real[src], tmp_path / f"{src}-killed")
    out = tmp_path / "out"
    argv = {
        "01c": ("01c_tokenize", ["--raw-dir", d["gen"], "--output-dir", out, "--tokenizer", k25_tokenizer_dir]),
        "02": ("02_extract_hidden_states", ["--input", d["tok"], "--model", real["target"], "--output", out, *HS_ARGS]),
        "03": ("03_build_vocab_mapping", ["--data", d["tok"], "--target", real["target"], "--out", out]),
        "04": ("04_train", train_argv(d["hs"], d["vocab"], real["target"], out, preset=CHAIN_TRAIN)),
        "05": ("05_evaluate", ["--draft", d["run"] / "export", "--store", d["hs"], "--output-dir", out]),
    }[down]
    res = run_inprocess(*argv, capfd)
    assert_one_error_line(res, str(d[src]), ("incomplete", "not finish", "did not finish", "unfinished"))
    assert not (out / "manifest.json").exists()
