"""04's inputs: 02's hidden-state store, 03's vocab mapping and the target, checked to belong
together before any work, and what identifies them for a resume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_train.common.errors import PipelineError
from eagle3_train.common.formats import dflash_target_layers
from eagle3_train.common.hidden_checks import check_shards, read_sample
from eagle3_train.common.manifest import describe_target, manifest_identity, require_match, text_config
from eagle3_train.train.config import TrainConfig

TARGET_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


@dataclass
class Inputs:
    store: object  # hidden_store.HiddenStates
    mapping: object  # vocab.VocabMapping
    target: str  # as the export's verifier.name_or_path records it (a local path made absolute)
    target_cfg: object
    aux_ids: list[int]  # what the draft reads (a subset of the store's)
    aux_index: list[int]  # their positions in the store's aux axis
    topk: bool  # the store keeps the target's top-k instead of its last hidden state


def target_identity(desc: dict | None) -> dict:
    return {k: (desc or {}).get(k) for k in TARGET_KEYS}


def open_inputs(config: TrainConfig, dtype: torch.dtype = torch.float32) -> Inputs:
    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.common.target import load_target_config
    from eagle3_train.vocab import mapping as vocab

    if config.follow:  # a store still being written: its header now, its shards as they come
        from eagle3_train.train.follow import open_growing

        store = open_growing(config, dtype)
    else:
        store = HiddenStates(Path(config.hidden_states), dtype=dtype)
    mapping = vocab.read_mapping(Path(config.vocab_mapping))
    target_cfg = load_target_config(config.target)
    tc = text_config(target_cfg)
    config.check_target_vocab(tc.vocab_size)
    ours = target_identity(describe_target(target_cfg, config.target))
    sm, mm = store.manifest, mapping.manifest
    require_match("target model", ours, target_identity(sm.get("target")), source=str(store.directory))
    require_match("target model", ours, target_identity(mm.get("target")), source=str(config.vocab_mapping))
    fp = lambda m: (m.get("tokenizer") or {}).get("fingerprint")  # noqa: E731
    if fp(sm) != fp(mm):
        raise PipelineError(f"tokenizer fingerprint mismatch: {store.directory} was made with "
                            f"{fp(sm)!r}, but {config.vocab_mapping} with {fp(mm)!r}")
    require_match("target vocab size", tc.vocab_size, int(mapping.target_vocab_size),
                  source=str(config.vocab_mapping))
    require_match("hidden size", tc.hidden_size, store.hidden_size, source=str(store.directory))
    layer_ids = store.layer_ids
    require_match("last layer id", tc.num_hidden_layers, layer_ids[-1], source=str(store.directory))
    stored_aux = list(sm.get("aux_layer_ids") or layer_ids[:-1])
    if config.per_draft_layer:  # one target layer per draft layer, by the field's rule
        aux_ids = dflash_target_layers(tc.num_hidden_layers, config.draft_layers)
    else:
        aux_ids = aux_layers(config.aux_layer_ids, stored_aux, tc.num_hidden_layers, store.directory)
    missing = [i for i in aux_ids if i not in stored_aux]
    if missing and config.per_draft_layer:
        both = ",".join(str(i) for i in sorted(set(stored_aux) | set(aux_ids)))
        raise PipelineError(f"--target-layers per-draft-layer: a DFlash draft of {config.draft_layers} layers reads "
                            f"target layers {','.join(map(str, aux_ids))} (aux ids), but {store.directory} holds "
                            f"{','.join(map(str, stored_aux))}: extract a store that holds them with 02 "
                            f"--layers dflash:{config.draft_layers} (these only) or --layers {both} (these and the "
                            f"store's), or pass --target-layers aux")
    if missing:
        few = len(missing) == 1
        raise PipelineError(f"--aux-layer-ids {','.join(map(str, aux_ids))}: layer{'' if few else 's'} "
                            f"{', '.join(map(str, missing))} {'is' if few else 'are'} not in {store.directory}, which "
                            f"holds aux layers {stored_aux}: pass a subset of them, or extract the store again with "
                            "02 --layers")
    if config.follow:  # its shards come later (or are consumed already): the header says what they hold
        topk = not store.has_last
    else:
        if not store.ids:
            raise PipelineError(f"{store.directory} holds no samples")
        check_shards(store.directory)
        first = read_sample(store, store.ids[0])
        if first.last is None and first.topk_ids is None:
            raise PipelineError(f"{store.directory} has neither last hidden states nor top-k targets")
        topk = first.last is None  # 02's compact option keeps the target's top-k instead
    target = str(Path(config.target).resolve()) if Path(config.target).exists() else config.target
    return Inputs(store, mapping, target, target_cfg, aux_ids, [stored_aux.index(i) for i in aux_ids], topk)


def aux_layers(asked, stored: list[int], num_layers: int, where) -> list[int]:
    """The draft's aux layers in the order vLLM gathers them (ascending, each once): --aux-layer-ids
    is checked like 02's --layers; a store with a repeated id (an older 02's small-target default)
    is refused, since vLLM would hand the draft fewer states than its fc expects."""
    from eagle3_train.extract.stage import check_layers

    if asked:
        return check_layers(list(asked), num_layers, flag="--aux-layer-ids")
    if len(set(stored)) != len(stored) or 0 in stored:
        raise PipelineError(f"{where} holds aux layers {stored}, which vLLM cannot serve (a repeat or id 0: "
                            f"it gathers layers 1..N, each once); re-run 02 or pass --aux-layer-ids "
                            f"{','.join(str(i) for i in sorted(set(stored) - {0}))}")
    if stored != sorted(stored):
        print(f"{where} holds aux layers {stored}; the draft reads them as {sorted(stored)} "
              "(vLLM gathers them in ascending order)")
    return sorted(stored)


def input_identity(inp: Inputs, vocab_mapping: str) -> dict:
    """What a resumed run must find again: the inputs' manifests (by content) and the target."""
    def manifest(d):
        return {"manifest_identity": manifest_identity(d)}

    from eagle3_train.common.hidden_store import GrowingStore

    if isinstance(inp.store, GrowingStore):  # followed: its manifest comes last
        from eagle3_train.train.follow import follow_identity

        store = follow_identity(inp.store)
    else:
        store = manifest(inp.store.directory)
    return {"hidden_states": store, "vocab_mapping": manifest(vocab_mapping),
            "target": target_identity(describe_target(inp.target_cfg, inp.target))}
