"""A Llama target made wider without changing what it computes: the width ladder behind 04's default
learning rate (issue 13: an lr that works from the tiny targets up to Kimi-K2.5's hidden 7168).

A draft's best lr depends on its width, and the only way to see how is to train drafts of several
widths on the same problem. Targets of different widths would be different problems (other weights,
other answers). So the one real target is lifted: its residual stream is mapped into `width`
dimensions by a random semi-orthogonal `Q` (width x hidden, QᵀQ = I) scaled by c = sqrt(width /
hidden), which keeps every RMS, and every weight is rewritten so that the wide model's residual
stream is exactly `c·Q·h` wherever the narrow one's is `h`:

- an RMSNorm of `c·Q·h` (unit weight) is `c·Q·norm(h)`, so each norm's weight is folded into the
  matrices that read it (SliceGPT/QuaRot's trick) and the norm becomes all ones;
- a matrix reading the residual becomes `W·diag(g)·Qᵀ / c`, one writing it `c·Q·W`;
- embed_tokens `c·E·Qᵀ`; lm_head `L·diag(g_final)·Qᵀ / c`.

Attention heads, rope and the MLP's inner width are the original's; the logits and the generated
tokens are the narrow target's (to rounding), and 02's hidden states are `c·Q` times its states. What
it does not copy from a real wide model: its states span only the narrow model's `hidden` directions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from eagle3_train.common.errors import PipelineError
from eagle3_train.common.store import TMP_PREFIX, atomic_dir_commit
from eagle3_train.common.target_layout import read_weights

READS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # after input_layernorm
MLP_READS = ("mlp.gate_proj", "mlp.up_proj")  # after post_attention_layernorm
WRITES = ("self_attn.o_proj", "mlp.down_proj")  # into the residual stream
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "config.json")


def lift_matrix(hidden: int, width: int, seed: int) -> torch.Tensor:
    """c·Q: a random width x hidden matrix with orthonormal columns, times sqrt(width / hidden)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(width, hidden, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))  # a unique Q for the seed, whatever the QR routine's signs
    return q * (width / hidden) ** 0.5


def widen_state_dict(sd: dict[str, torch.Tensor], num_layers: int, lift: torch.Tensor) -> dict[str, torch.Tensor]:
    """The wide model's weights (fp32) from the narrow one's; `lift` = c·Q from lift_matrix."""
    c2 = float((lift[:, 0] @ lift[:, 0]))  # c²: the columns of c·Q have squared norm c²
    down = lift.T / c2  # Qᵀ / c: (c·Q)ᵀ / c²
    f64 = {k: v.double() for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}

    def reads(w, g):
        return w * g[None, :] @ down

    for i in range(num_layers):
        p = f"model.layers.{i}."
        g1, g2 = f64[p + "input_layernorm.weight"], f64[p + "post_attention_layernorm.weight"]
        for name in READS:
            out[p + name + ".weight"] = reads(f64[p + name + ".weight"], g1)
        for name in MLP_READS:
            out[p + name + ".weight"] = reads(f64[p + name + ".weight"], g2)
        for name in WRITES:
            out[p + name + ".weight"] = lift @ f64[p + name + ".weight"]
        out[p + "input_layernorm.weight"] = torch.ones(lift.shape[0], dtype=torch.float64)
        out[p + "post_attention_layernorm.weight"] = torch.ones(lift.shape[0], dtype=torch.float64)
    embed = f64["model.embed_tokens.weight"]
    out["model.embed_tokens.weight"] = embed @ lift.T
    head = f64.get("lm_head.weight", embed)
    out["lm_head.weight"] = reads(head, f64["model.norm.weight"])
    out["model.norm.weight"] = torch.ones(lift.shape[0], dtype=torch.float64)
    missing = sorted(set(sd) - set(out) - {"lm_head.weight"})
    if missing:
        raise PipelineError(f"cannot widen weights a plain Llama does not have: {', '.join(missing[:4])}")
    return {k: v.float().contiguous() for k, v in out.items()}


def widen_target(src: str | Path, dst: str | Path, width: int, seed: int = 0) -> Path:
    """Write the target `src` (a Llama checkpoint) lifted to `width` into `dst`, fp32, with its
    tokenizer files; `dst` appears whole or not at all. Returns `dst`."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise PipelineError(f"{src}: only a Llama target can be widened, not model_type {cfg.get('model_type')!r}")
    hidden = int(cfg["hidden_size"])
    if width < hidden:
        raise PipelineError(f"--width {width} is below the target's hidden size {hidden}")
    wide = widen_state_dict(read_weights(src), int(cfg["num_hidden_layers"]), lift_matrix(hidden, width, seed))
    cfg.update(hidden_size=width, head_dim=int(cfg.get("head_dim") or hidden // cfg["num_attention_heads"]),
               tie_word_embeddings=False, dtype="float32",
               widened_from={"target": str(src), "hidden_size": hidden, "seed": seed})

    def fill(tmp: Path) -> None:
        for f in src.iterdir():
            if f.is_file() and f.name not in WEIGHT_FILES and not f.name.endswith(".safetensors"):
                shutil.copy2(f, tmp / f.name)
        save_file(wide, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(TMP_PREFIX + dst.name)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    fill(tmp)
    atomic_dir_commit(tmp, dst)
    return dst
