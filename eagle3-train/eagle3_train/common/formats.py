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

# 04's --target-layers (and 00's): which of the target's layers a DFlash draft reads. aux: the store's
# aux layers (EAGLE-3's three) through one fc; per-draft-layer: one target layer per draft layer, spread
# over the target's depth by dflash_target_layers (the DFlash drafts published with 5-6 layers).
TARGET_LAYERS = ("aux", "per-draft-layer")


def dflash_target_layers(num_layers: int, draft_layers: int, *, flag: str = "--target-layers per-draft-layer"
                         ) -> list[int]:
    """The aux ids a DFlash draft of `draft_layers` layers reads from a target of `num_layers`, by the
    field's rule (z-lab's DFlash `build_target_layer_ids`, as SpecForge and SGLang use it): one draft
    layer reads the output of layer N // 2; more read the outputs of layers spread evenly over 1 .. N - 3,
    rounded. That rule counts a layer's output; an aux id here (and in the export's
    aux_hidden_state_layer_ids) is the residual stream entering layer i, which vLLM turns into
    target_layer_ids i - 1: hence the + 1. Ascending, each once, in 1..N, or a PipelineError naming `flag`
    and the most draft layers the target allows."""
    from eagle3_train.common.errors import PipelineError

    def rule(n: int) -> list[int]:
        if n == 1:
            return [num_layers // 2 + 1]
        span = num_layers - 4  # from the output of layer 1 to that of layer N - 3
        return [int(round(1 + i * span / (n - 1))) + 1 for i in range(n)]

    def fits(ids: list[int]) -> bool:
        return len(set(ids)) == len(ids) and all(1 <= i <= num_layers for i in ids)

    ids = rule(draft_layers) if draft_layers >= 1 else []
    if not ids or not fits(ids):
        most = max((n for n in range(1, num_layers + 1) if fits(rule(n))), default=0)
        fewer = f"--draft-layers {most}" + (" or fewer" if most > 1 else "") if most else "--target-layers aux"
        raise PipelineError(f"{flag}: a draft of {draft_layers} layers reads {draft_layers} distinct target layers, "
                            f"which a target of {num_layers} layers lacks (the rule, outputs of layers 1 .. N-3 "
                            f"evenly, picks aux ids {ids}): pass {fewer}")
    return sorted(ids)
