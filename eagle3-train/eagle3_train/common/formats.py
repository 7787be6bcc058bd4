"""The option names several stages must agree on, in one place and torch-free, so that a CLI can
offer them in --help without importing torch."""

# 02's --storage (and 00's): the aux layers in one of the plain dtypes or fp8 with a per-row scale;
# fp8-topk keeps the target's top-k next-token log-probs in place of the last layer's state.
PLAIN_STORAGES = ("bf16", "fp16", "fp32")
STORAGES = (*PLAIN_STORAGES, "fp8", "fp8-topk")
TOPK_STORAGE = "fp8-topk"

# 04's --draft-arch (and 00's): the draft's decoder layer; auto = mla for an MLA target, else llama.
# dflash is a block drafter (vLLM's `method: dflash`), not an EAGLE-3 layer: train/draft_dflash.py.
DRAFT_LAYERS = ("llama", "qwen3", "mla")
DRAFT_ARCHS = ("auto", *DRAFT_LAYERS, "dflash")

# 04's --attn (and 00's): auto = flex on CUDA, sdpa on CPU.
ATTNS = ("auto", "flex", "sdpa", "eager")
