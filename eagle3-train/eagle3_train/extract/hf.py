"""02's `hf` backend: the target in transformers, with forward pre-hooks that capture exactly the
tensors EAGLE-3 needs (DESIGN.md's layer convention: id i = the residual stream entering decoder
layer i, HF `hidden_states[i]`; id N = the last layer's output before the final norm), so no other
layer's states are kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch

from eagle3_train.common import hidden_store as hs
from eagle3_train.common.errors import PipelineError


def find_stack(model, num_layers: int):
    """(decoder module, its layer list, its final norm) of the language model inside `model`
    (works through multimodal wrappers such as Kimi-K2.5's)."""
    found = []
    for name, mod in model.named_modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers and hasattr(mod, "norm"):
            found.append((name, mod))
    if not found:
        raise PipelineError(f"cannot find a stack of {num_layers} decoder layers with a final norm "
                            f"in {type(model).__name__}")
    # A multimodal wrapper may have a vision tower with the same shape; prefer the language model.
    found.sort(key=lambda nm: ("vision" in nm[0] or "visual" in nm[0], len(nm[0])))
    mod = found[0][1]
    return mod, mod.layers, mod.norm


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return hs.DTYPES[name]


class HFTarget:
    """The target in transformers, with pre-hooks that keep only the layers EAGLE-3 needs."""

    def __init__(self, path: str, *, num_layers: int, aux_ids: Sequence[int], storage: str, topk: int,
                 dtype: torch.dtype, device: str, device_map: str | None = None):
        from eagle3_train.common.target_layout import load_model

        kw = {"dtype": dtype, "trust_remote_code": True}
        if device_map:
            kw["device_map"] = device_map
        try:
            model = load_model(path, **kw)
        except (OSError, ValueError) as e:
            raise PipelineError(f"cannot load target {path!r}: {str(e).splitlines()[0]}") from None
        if not device_map:
            model.to(device)
        self.model = model.eval()
        self.num_layers = num_layers
        self.aux_ids = list(aux_ids)
        self.topk = topk if storage == "fp8-topk" else 0
        self.base, layers, self.norm = find_stack(model, num_layers)
        self.lm_head = model.get_output_embeddings().weight if self.topk else None
        self.layers = layers
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        self.install_hooks()
        self.input_device = model.get_input_embeddings().weight.device

    def install_hooks(self) -> None:
        """One pre-hook per needed id: on layer i (its input) and, for id N, on the final norm."""
        self.remove_hooks()
        need = set(self.aux_ids) | (set() if self.topk else {self.num_layers})
        for i in sorted(need):
            mod = self.norm if i == self.num_layers else self.layers[i]
            self._handles.append(mod.register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, layer_id: int):
        def pre_hook(module, args, kwargs):
            self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        return pre_hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @staticmethod
    def pad(records: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        lens = [len(r["input_ids"]) for r in records]
        T = max(lens)
        ids = torch.zeros(len(records), T, dtype=torch.long)
        valid = torch.zeros(len(records), T, dtype=torch.bool)
        for b, r in enumerate(records):
            ids[b, : lens[b]] = torch.tensor(r["input_ids"], dtype=torch.long)
            valid[b, : lens[b]] = True
        return ids, (None if bool(valid.all()) else valid.long()), valid

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None):
        return self.base(input_ids=ids.to(self.input_device),
                         attention_mask=None if mask is None else mask.to(self.input_device),
                         use_cache=False)

    @torch.inference_mode()
    def run(self, records: Sequence[dict]) -> dict:
        """{'aux' [M, n_aux, H], 'last' [M, H] or 'topk' (ids, logprobs)} on the CPU, M = the
        records' tokens concatenated in order (padding removed)."""
        ids, mask, valid = self.pad(records)
        self._captured.clear()
        try:
            out = self.forward(ids, mask)
            rows = {i: t[valid.to(t.device)].cpu() for i, t in self._captured.items()}
            result = {"aux": torch.stack([rows[i] for i in self.aux_ids], dim=1)}
            if self.topk:
                post = out.last_hidden_state[valid.to(out.last_hidden_state.device)]
                result["topk"] = topk_logprobs(post, self.lm_head, self.topk)
            else:
                result["last"] = rows[self.num_layers]
        finally:
            self._captured.clear()
        return result


def topk_logprobs(h: torch.Tensor, weight: torch.Tensor, k: int, budget: int = 1 << 28
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of log_softmax(h @ weight.T) per row, in row chunks so that a 160K vocabulary never
    needs more than `budget` logits at once. `h` is the *normed* final hidden state."""
    step = max(1, budget // weight.shape[0])
    ids, lps = [], []
    for a in range(0, h.shape[0], step):
        logits = torch.nn.functional.linear(h[a: a + step].to(weight.device, weight.dtype), weight).float()
        v, i = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        ids.append(i.cpu())
        lps.append(v.cpu())
    return torch.cat(ids), torch.cat(lps)


def token_batches(records: Sequence[dict], batch_tokens: int, max_batch_size: int) -> Iterator[list[dict]]:
    """Consecutive records grouped so that batch size x longest length <= batch_tokens."""
    batch: list[dict] = []
    longest = 0
    for r in records:
        n = len(r["input_ids"])
        if batch and (len(batch) >= max_batch_size or (len(batch) + 1) * max(longest, n) > batch_tokens):
            yield batch
            batch, longest = [], 0
        batch.append(r)
        longest = max(longest, n)
    if batch:
        yield batch


class HFBackend:
    name = "hf"

    def __init__(self, cfg, *, num_layers: int, aux_ids: Sequence[int], max_len: int | None = None):
        device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, device)
        self.cfg = cfg
        self.target = HFTarget(cfg.model, num_layers=num_layers, aux_ids=aux_ids, storage=cfg.storage,
                               topk=cfg.topk, dtype=self.dtype, device=device, device_map=cfg.device_map)

    def batches(self, records):
        return token_batches(records, self.cfg.batch_tokens, self.cfg.max_batch_size)

    def run(self, records):
        return self.target.run(records)

    def close(self):
        self.target.remove_hooks()
