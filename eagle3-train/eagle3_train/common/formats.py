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

# 04's (and 00's) --block-size / --num-speculative-tokens defaults. A DFlash step drafts its whole
# block in one forward, so a longer block costs little: block 8 matched block 4 at K = 3 (3.749 vs
# 3.736 on the DeepSeek-V3 bench) and reached 6.686 at K = 7 (docs/measurements.md, issue 28); an
# EAGLE-3 draft runs one forward per drafted token and is trained to TTT 3.
DFLASH_BLOCK, EAGLE3_K = 8, 3


def dflash_block(block_size: int | None, k: int | None) -> int:
    """A DFlash draft's block: --block-size, else 8, or K + 1 when a larger K is asked for."""
    return block_size or max(DFLASH_BLOCK, (k or 0) + 1)


def speculative_tokens(arch: str, block_size: int | None, k: int | None) -> int:
    """K the export records: --num-speculative-tokens, else the block's mask slots (dflash) or 3."""
    return k or (dflash_block(block_size, k) - 1 if arch == "dflash" else EAGLE3_K)

# 04's --attn (and 00's): auto = flex on CUDA, sdpa on CPU.
ATTNS = ("auto", "flex", "sdpa", "eager")
