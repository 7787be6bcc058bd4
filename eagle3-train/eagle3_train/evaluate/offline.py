"""05 offline (no server): the draft runs over held-out samples of the 02 store exactly as vLLM
runs it (target features at t and token t+1 in, K chained proposals out; a DFlash draft's K from
one block of K + 1 queries) and each proposal is
compared with the target's own greedy token; acceptance is the chain rule of
`acceptance.chain_acceptance`, counted where vLLM drafts (its walk: after the prefill token, then
accepted + 1 on), so the offline AL is the figure vLLM reports; `al_all_positions` is the
every-position average. At a temperature above 0 a proposal is accepted with the target's
probability of it instead (acceptance.sampled_walk: vLLM's verification of a greedy draft), and
the same walk of an oracle draft (the target's own greedy token at every depth) gives the reach:
the AL the target's entropy leaves to any draft, overall and by position."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3_train.common import positions
from eagle3_train.common.acceptance import (chain_acceptance, draft_correctness, merge, proposal_probs, sampled_walk,
                                            summarize)
from eagle3_train.common.config import TRAIN
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.hidden_checks import read_sample  # the same damaged-shard / NaN checks as training
from eagle3_train.common.manifest import require_match
from eagle3_train.common.progress import Progress
from eagle3_train.common.split import is_heldout
from eagle3_train.train.draft_core import draft_to_target, unroll


def heldout_ids(store_ids: Sequence[str], draft: dict) -> tuple[list[str], str]:
    """The store's samples the draft was not trained on, by the split 04 recorded in its manifest:
    an explicit id list, or the fixed by-id rule with its fraction. Without either, every
    sample (and the report says so)."""
    found = draft.get("manifest") or {}
    man = json.loads(Path(found["path"]).read_text()) if found.get("stage") == TRAIN else {}
    split = man.get("split") or {}
    ids = split.get("heldout_ids") or split.get("val_ids") or man.get("val_ids")
    if ids or "val_ids" in split:  # exactly 04's validation ids: its other held-out samples were trained on
        ids = ids or []
        keep = set(ids)
        return [i for i in store_ids if i in keep], "04 manifest (held-out ids)"
    fraction = split.get("heldout_fraction", split.get("val_fraction"))
    if fraction:
        return [i for i in store_ids if is_heldout(i, float(fraction))], f"by-id split, fraction {fraction}"
    return list(store_ids), "all samples (the draft's manifest records no held-out split)"


def _store_aux_ids(store) -> list[int]:
    """02 records `aux_layer_ids`, and `layer_ids` = aux + [N] (the last layer's output)."""
    if store.manifest.get("aux_layer_ids") is not None:
        return list(store.manifest["aux_layer_ids"])
    ids = list(store.layer_ids)
    n = (store.manifest.get("target") or {}).get("num_hidden_layers")
    return ids[:-1] if n is not None and ids and ids[-1] == n else ids


def check_store(store, cfg: dict, target_desc: dict) -> list[int] | None:
    """Refuse a store made for another target, or without the layers the draft reads; the positions
    of those layers in the store's aux axis when it holds more (None: all of them, in order)."""
    theirs = store.manifest.get("target") or {}
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if key in theirs:
            require_match(f"target {key}", target_desc[key], theirs[key], source=str(store.directory))
    from eagle3_train.evaluate.draft import aux_layer_ids

    want, stored = aux_layer_ids(cfg), _store_aux_ids(store)
    if not want or list(want) == stored:
        return None
    if set(want) <= set(stored):  # a store made for several drafts (04 reads such a subset too)
        return [stored.index(i) for i in want]
    require_match("auxiliary layer ids", list(want), stored, source=str(store.directory))
    return None


def _batches(ids: Sequence[str], lengths: dict[str, int], tokens_per_batch: int):
    batch, n = [], 0
    for sid in ids:
        if batch and n + lengths[sid] > tokens_per_batch:
            yield batch
            batch, n = [], 0
        batch.append(sid)
        n += lengths[sid]
    if batch:
        yield batch


@torch.no_grad()
def draft_step_tokens(model, samples: list, k: int, aux_index: list[int] | None = None) -> list[list[torch.Tensor]]:
    """Run the draft over several samples packed into one sequence and return, per sample, the
    K proposals (target vocabulary) at each drafting position, in the frame of
    `acceptance.draft_correctness`: position j holds token t = j + 1 and the features of j.

    vLLM drafts from (features of t-1, token t) and proposes t+1, t+2, ...; the proposal at depth
    k > 0 is fed the earlier ones. The forward feeds the true tokens instead (teacher forcing),
    which is the same thing whenever the earlier proposals were right, the only case the chain
    rule counts. A DFlash draft (`is_dflash`) drafts the k tokens in one block of k + 1 queries
    anchored at each position, as vLLM runs it at num_speculative_tokens k (block_draft_tokens)."""
    hs, ids, docs, pos = [], [], [], []
    for d, s in enumerate(samples):
        n = s.input_ids.shape[0] - 1
        hs.append((s.aux[:-1] if aux_index is None else s.aux[:-1, aux_index]).flatten(1))
        ids.append(s.input_ids[1:])
        docs.append(torch.full((n,), d, dtype=torch.long))
        pos.append(torch.arange(1, n + 1))
    w = next(model.parameters()) if isinstance(model, torch.nn.Module) else torch.empty(0)  # where it runs
    on = lambda t: t.to(w.device, non_blocking=True)  # noqa: E731
    hs, ids, docs, pos = on(torch.cat(hs)[None].to(w.dtype)), on(torch.cat(ids)[None]), on(torch.cat(docs)), \
        on(torch.cat(pos)[None])
    if getattr(model, "is_dflash", False):
        from eagle3_train.train.draft_dflash import block_draft_tokens

        out = [t[None] for t in block_draft_tokens(model, hs, ids, pos, docs, k)]
    else:
        # training's unroll (as 04 validates): the same masks, a --draft-window included, as vLLM runs it
        out = [lg.argmax(-1) for lg in unroll(model, hs, ids, pos, docs, k)]
    to_target = draft_to_target(model)
    steps = [to_target(t[0]).cpu() for t in out]
    per_sample, a = [], 0
    for s in samples:
        n = s.input_ids.shape[0] - 1
        per_sample.append([t[a:a + n] for t in steps])
        a += n
    return per_sample


def first_drafted(n: int) -> torch.Tensor:
    """[n] the sequence position of the first token drafted at each position of the frame of
    draft_step_tokens: position j holds token j + 1, so its draft proposes token j + 2 first."""
    return torch.arange(n) + 2


def offline_eval(model, head, store, ids: Sequence[str], k: int, *,
                 tokens_per_batch: int = 4096, log_path: Path | None = None, every_s: float = 10.0,
                 edges: Sequence[int] = positions.EDGES, temperature: float = 0.0, top_p: float = 1.0,
                 repeats: int = 32, seed: int = 0, aux_index: list[int] | None = None) -> dict:
    """Chain acceptance of the draft against the target's greedy tokens over `ids`, also by the
    position of each draft in its sequence (`edges`: the buckets' boundaries; `aux_index`: the
    store's aux layers the draft reads, check_store's). With `temperature`
    > 0, the figures are the sampled walk's (`sampled_figures`) and the greedy ones go under
    "greedy"; "walk" says which."""
    lengths = {sid: store.length(sid) for sid in ids}
    stats, tokens, same, supervised = [], 0, 0, 0
    parts = []  # the sampled walk's (p, valid, first position) per sample
    with Progress("05 offline", len(ids), log_path=log_path, every_s=every_s, unit="sample") as prog:
        for batch in _batches(ids, lengths, tokens_per_batch):
            samples = [s for s in (read_sample(store, sid) for sid in batch) if s.input_ids.shape[0] >= 2]
            drafts = draft_step_tokens(model, samples, k, aux_index) if samples else []
            for s, d in zip(samples, drafts):
                if s.last is not None and head is not None:
                    # Over the full vocab in chunks of tokens: [T, V] logits never exist at once.
                    greedy = head.greedy(s.last.to(head.full.device)).cpu()
                elif s.topk_ids is not None:
                    greedy = s.topk_ids[:, 0]
                else:
                    raise PipelineError(f"{store.directory} keeps neither the last hidden state nor "
                                        "top-k, so the target's greedy tokens are unknown")
                # Shifted frame (see draft_step_tokens): reference for token j+1 is greedy at j+1.
                ref = greedy[1:]
                ids_s, mask_s = s.input_ids[1:], s.loss_mask[1:]
                correct, valid = draft_correctness(d, ids_s, mask_s, ref)
                stats.append(chain_acceptance(correct, valid, first_drafted(len(ids_s)), edges))
                positions.one_answer(stats[-1]["by_position"])
                if temperature > 0:  # the draft's p and the oracle's (its proposals are `ref`) from the same rows
                    p, p_reach = accept_probs(s, d, head, temperature, top_p, greedy=ref)
                    parts.append((p, valid, first_drafted(len(ids_s)), p_reach))
                tokens += int(s.input_ids.shape[0])
                m = s.loss_mask[1:].bool()
                same += int((greedy[:-1][m] == s.input_ids[1:][m]).sum())
                supervised += int(m.sum())
            prog.update(len(batch), tokens=sum(lengths[i] for i in batch))
    if not stats:
        raise PipelineError(f"no held-out samples with at least 2 tokens in {store.directory}")
    counts = merge(stats)
    by_position = positions.block(counts.pop("by_position"))
    out = {**summarize(counts), "counts": counts, "k": k, "samples": len(stats), "tokens": tokens,
           "by_position": by_position, "walk": "greedy",
           # How far the data is from the target's greedy choice: 1.0 = greedily generated.
           "data_matches_greedy": same / supervised if supervised else None}
    return sampled_figures(out, parts, temperature, top_p, repeats, seed, edges) if temperature > 0 else out


def accept_probs(s, draft_tokens: list[torch.Tensor], head, temperature: float, top_p: float,
                 greedy: torch.Tensor | None = None):
    """p [K, n] in draft_step_tokens' frame: vLLM's acceptance probability of each proposal, the
    target's probability of it at `temperature` / `top_p` (acceptance.proposal_probs), from the last
    hidden state through the target's head (full vocabulary, in chunks) or the stored top-k.
    With `greedy` [n] (the target's greedy token in the same frame, offline_eval's `ref`): (p, the
    oracle's p), the oracle proposing greedy[j + i] at frame position j, depth i."""
    if s.last is not None and head is not None:
        last = s.last[1:]  # frame row j = the target's distribution for token j + 2: its state at j + 1

        def rows(a, b):
            return head.normed(last[a:b].to(head.full.device)) @ head.full.T, None
    elif s.topk_ids is not None:
        def rows(a, b):
            return s.topk_logprobs[1 + a:1 + b], s.topk_ids[1 + a:1 + b]
    else:
        raise PipelineError(f"sample {s.id} keeps neither the last hidden state nor top-k: the target's "
                            "probabilities for the sampled walk are unknown")
    return proposal_probs(draft_tokens, rows, temperature, top_p, greedy=greedy)


def sampled_figures(greedy: dict, parts: list, temperature: float, top_p: float, repeats: int, seed: int,
                    edges: Sequence[int]) -> dict:
    """The offline result with the sampled walk's figures (acceptance.sampled_walk) in place of the
    greedy walk's, which stay under "greedy". Its counts (and by_position's) are sums over the
    draws; `drafts` is one draw's mean, the number vLLM would make. `parts`: (p, valid, first
    position, the oracle's p) per sample; `reach_al` is the oracle's AL over the same draws and
    `share_of_reach` the draft's share of it, by position too (positions.with_reach)."""
    counts, mc = sampled_walk([x[:3] for x in parts], seed=seed, repeats=repeats, edges=edges,
                              reach=[x[3] for x in parts])
    reach = mc.pop("reach")
    walked, reached = counts.pop("by_position"), reach.pop("by_position")
    if "answers" in greedy["by_position"]["counts"]:  # the same answers, walked once greedily
        walked["answers"] = reached["answers"] = greedy["by_position"]["counts"]["answers"]
    by_position = positions.with_reach(positions.block(walked), reached)
    keep = ("k", "samples", "tokens", "data_matches_greedy")
    rates = {**summarize(counts), "drafts": round(counts["drafts"] / max(mc["repeats"], 1))}
    reach_al = summarize(reach)["acceptance_length"]
    rates |= {"reach_al": reach_al, "share_of_reach": rates["acceptance_length"] / reach_al}
    return {**rates, "counts": counts, "by_position": by_position, **{x: greedy[x] for x in keep},
            "walk": "sampled", "temperature": temperature, "top_p": top_p, "seed": seed, **mc,
            "greedy": {x: v for x, v in greedy.items() if x not in keep and x != "walk"}}
