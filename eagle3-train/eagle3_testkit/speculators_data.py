"""Our 02 store in speculators 0.9.0's offline training format, so its own Trainer reads the very
samples 04 trains on (scripts/bench/quality.py, `scripts/bench/train.py speed`).

What speculators.train.data.ArrowDataset reads (its data generation writes the same):
  <out>/                     a `datasets` dataset (save_to_disk): input_ids, loss_mask, seq_len per row
  <out>/hidden_states/hs_<row>.safetensors
                             hidden_states [T, n_aux + 1, H] (the aux layers ascending, then the
                             last layer's output), token_ids [T]
Its train/val split is by row: the first int(n * train_data_ratio) rows train. Rows are written
with our held-out ids (split.is_heldout at `val_fraction`, 04's rule) last, so passing the
returned `train_data_ratio` gives both trainers the same validation samples.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_train.common.split import is_heldout
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit, atomic_write_text

DONE = "eagle3_conversion.json"  # written last: the conversion is complete only with it


def speculators_row_order(ids, val_fraction: float) -> tuple[list[str], int]:
    """Training ids (sorted), then held-out ids (sorted); and how many train."""
    train = sorted(i for i in ids if not is_heldout(i, val_fraction))
    val = sorted(i for i in ids if is_heldout(i, val_fraction))
    return train + val, len(train)


def convert_store(store_dir: Path, out: Path, *, val_fraction: float = 0.05, dtype: str = "bfloat16",
                  progress: bool = True) -> dict:
    """Write (or reuse, if already complete for the same store and split) the speculators copy."""
    import torch
    from datasets import Dataset
    from eagle3_train.common.hidden_store import HiddenStates
    from eagle3_train.common.progress import Progress
    from safetensors.torch import save_file

    out = Path(out)
    key = {"store": str(Path(store_dir).resolve()), "val_fraction": val_fraction, "dtype": dtype}
    if (out / DONE).exists():
        info = json.loads((out / DONE).read_text())
        if {k: info.get(k) for k in key} == key:
            return info
    store = HiddenStates(store_dir)
    if not store.has_last:
        raise ValueError(f"{store_dir} keeps the target's top-k, not the last hidden state "
                         "speculators' KL loss needs")
    order, n_train = speculators_row_order(store.ids, val_fraction)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}"
    (tmp / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    bar = Progress("to-speculators", len(order), unit="sample", disable=not progress or None)
    for row, sid in enumerate(order):
        s = store.get(sid)
        hs = torch.cat([s.aux, s.last[:, None]], 1).to(getattr(torch, dtype)).contiguous()
        save_file({"hidden_states": hs, "token_ids": s.input_ids.long().contiguous()},
                  str(tmp / "hidden_states" / f"hs_{row}.safetensors"))
        rows["input_ids"].append(s.input_ids.tolist())
        rows["loss_mask"].append(s.loss_mask.long().tolist())
        rows["seq_len"].append(len(s.input_ids))
        bar.update(1, tokens=len(s.input_ids))
    bar.close()
    ds = Dataset.from_dict(rows)
    ds.set_format("torch")
    ds.save_to_disk(str(tmp))
    info = {**key, "samples": len(order), "train_samples": n_train, "ids": order,
            # speculators splits at int(n * ratio): half a row of slack keeps float rounding off it
            "train_data_ratio": (n_train + 0.5) / len(order), "tokens": sum(rows["seq_len"]),
            "layer_ids": store.layer_ids}
    atomic_write_text(tmp / DONE, json.dumps(info) + "\n")
    atomic_dir_commit(tmp, out)
    return info


def write_vocab_npy(vocab_dir: Path, out: Path) -> tuple[Path, Path]:
    """03's d2t / t2d as the .npy files speculators' --d2t-path / --t2d-path take."""
    import numpy as np
    from eagle3_train.vocab.mapping import read_mapping

    m = read_mapping(vocab_dir)
    paths = (Path(out) / "d2t.npy", Path(out) / "t2d.npy")
    for path, arr in zip(paths, (m.d2t, m.t2d)):
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
        with open(tmp, "wb") as f:
            np.save(f, arr)
        tmp.replace(path)
    return paths
