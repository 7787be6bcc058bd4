"""00_plan --data: what a finished 01b output or tokenized set holds, measured: samples, tokens a
sample, the answers' length distribution and the mean prompt."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_train.common.errors import PipelineError
from eagle3_train.plan import gen as G

LENGTH_SAMPLE = 5000  # answers read for the length distribution: the file's first (the counts cover all)


def _stats_field(line: str) -> dict:
    """A tokenized record's "stats" (its last field) without parsing its id lists."""
    i = line.rfind('"stats"')
    if i < 0:
        return {}
    value, _ = json.JSONDecoder().raw_decode(line, line.index(":", i) + 1 + (line[line.index(":", i) + 1] == " "))
    return value if isinstance(value, dict) else {}


def measure_data(directory: str) -> dict:
    """A tokenized set's (01c) or an 01b output's counts: samples, mean tokens a sample, data.jsonl's
    bytes (tokenized only), mean prompt, and the answers' length stats (gen.length_stats) from the
    first LENGTH_SAMPLE records."""
    from eagle3_train.common.manifest import read_manifest
    from eagle3_train.common.store import read_jsonl
    from eagle3_train.common.layout import RAW

    d = Path(directory)
    manifest = read_manifest(d) if (d / "manifest.json").exists() else {}
    counts = manifest.get("counts") or {}
    lengths, prompts = [], []
    if (d / RAW).exists():  # 01b: each answer's generated ids
        answered = counts.get("answered")
        if not answered:
            raise PipelineError(f"--data {d}: no manifest with answer counts (a finished 01b output)")
        for i, rec in enumerate(read_jsonl(d / RAW)):
            if i >= LENGTH_SAMPLE:
                break
            lengths.append(len(rec.get("token_ids") or ()))
            prompts.append(len(rec.get("prompt_token_ids") or ()))
        total = (counts.get("prompt_tokens") or 0) + (counts.get("generated_tokens") or 0)
        out = {"samples": answered, "tokens_per_sample": total / answered, "tokenized_bytes": None}
    else:
        if not counts.get("samples"):
            raise PipelineError(f"--data {d}: no manifest with sample counts (a finished 01c or 01b output)")
        with open(d / "data.jsonl") as fh:
            for i, line in enumerate(fh):
                if i >= LENGTH_SAMPLE:
                    break
                st = _stats_field(line)
                if st.get("num_supervised") is not None:
                    lengths.append(int(st["num_supervised"]))
                    prompts.append(int(st.get("prompt_len") or 0))
        out = {"samples": counts["samples"], "tokens_per_sample": counts["tokens"] / counts["samples"],
               "tokenized_bytes": (d / "data.jsonl").stat().st_size}
    shown = f"{len(lengths):,} of {out['samples']:,}" if out["samples"] > len(lengths) else f"{len(lengths):,}"
    answers = G.length_stats(lengths, f"measured: --data {d}, {shown} answers")
    return out | {"answers": answers, "prompt_tokens": round(sum(prompts) / len(prompts)) if prompts else None}
