"""The draft (eagle3_train.train.draft): built on speculators' Eagle3DraftModel, our TTT unroll equals
speculators' own forward, the target head reproduces the target's logits from the stored last
hidden state, and the export loads back with speculators' from_pretrained with identical logits."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_train.common.hidden_store import HiddenStates
from eagle3_train.train import draft as D
from eagle3_train.train import draft_core as core
from helpers_train import build_mapping, build_store
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_target_dir):
    root = tmp_path_factory.mktemp("draft")
    store = build_store(root / "store", llama_target_dir, n=6, shard_size=3)
    mapping = build_mapping(root / "map", store, llama_target_dir, 96)
    m = load_file(str(mapping / "vocab_mapping.safetensors"))
    return {"target": llama_target_dir, "cfg": AutoConfig.from_pretrained(llama_target_dir),
            "store": HiddenStates(store), "d2t": m["d2t"], "t2d": m["t2d"],
            "weights": core.load_target_weights(llama_target_dir)}


def make(inputs, **kw):
    return D.build_draft(str(inputs["target"]), inputs["cfg"], aux_layer_ids=inputs["store"].layer_ids[:-1],
                         d2t=inputs["d2t"], t2d=inputs["t2d"], weights=inputs["weights"], **kw)


def packed(store, ids):
    """Two documents packed EAGLE-3 style (aux of token j with token j+1, positions from 1)."""
    parts = [store.get(i) for i in ids]
    aux = torch.cat([p.aux[:-1].flatten(1) for p in parts])[None]
    tok = torch.cat([p.input_ids[1:] for p in parts])[None]
    pos = torch.cat([torch.arange(1, len(p.input_ids)) for p in parts])[None]
    doc = torch.cat([torch.full((len(p.input_ids) - 1,), d) for d, p in enumerate(parts)])
    last = torch.cat([p.last[1:] for p in parts])[None]
    mask = torch.cat([p.loss_mask[1:] for p in parts])[None]
    return aux, tok, pos, doc, last, mask


def test_draft_is_speculators_eagle3_with_explicit_config(inputs):
    from speculators.models.eagle3 import Eagle3DraftModel

    model = make(inputs)
    assert isinstance(model, Eagle3DraftModel)
    cfg = model.config
    assert cfg.eagle_aux_hidden_state_layer_ids == inputs["store"].layer_ids[:-1]
    assert cfg.target_hidden_size == inputs["cfg"].hidden_size
    assert cfg.draft_vocab_size == 96 and model.use_draft_vocab
    assert model.fc.weight.shape == (128, 3 * 128)
    # The target's embeddings and its lm_head rows for the draft vocab, frozen (as speculators does).
    assert torch.equal(model.embed_tokens.weight, inputs["weights"]["embed"])
    assert torch.equal(model.lm_head.weight, inputs["weights"]["lm_head"][inputs["t2d"]])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "lm_head.weight" not in trainable
    assert {"fc.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= trainable
    assert model.layers[0].self_attn.q_proj.weight.shape[1] == 2 * 128  # [embeds, hidden]


def test_unroll_equals_speculators_forward(inputs):
    """Our unroll over a packed batch gives speculators' own forward's draft tokens and, with
    speculators' masking and decay, its loss: same modules, same order, same masks."""
    from speculators.losses import resolve_loss_config
    from speculators.losses.eager import kl_div_loss

    store = inputs["store"]
    model = make(inputs, attn_impl="sdpa").eval()
    ids = inputs["t2d"].nonzero().squeeze(1)
    head = core.target_head(inputs["cfg"], inputs["weights"], ids, "cpu", torch.float32)
    aux, tok, pos, doc, last, mask = packed(store, store.ids[:2])
    steps, gamma = 3, 0.8
    with torch.no_grad():
        mine = list(core.unroll(model, aux, tok, pos, doc, steps))

    class Norm(torch.nn.Module):
        def forward(self, x):
            return head.normed(x)

    class Head(torch.nn.Module):
        def forward(self, x):
            return x @ head.rows.T

    model.verifier_norm, model.verifier_lm_head = Norm(), Head()
    with torch.no_grad():
        tokens, loss, _ = model(hidden_states=aux, input_ids=tok, document_ids=doc[None], loss_mask=mask,
                                position_ids=pos, verifier_last_hidden_states=last, ttt_steps=steps,
                                ttt_step_loss_decay=gamma, loss_config=resolve_loss_config("kl_div", "eager"))
    targets = head.draft_logits(last[0])
    ours = 0.0
    for k, logits in enumerate(mine):
        assert torch.equal(logits.argmax(-1), tokens[k])
        n = logits.shape[1] - k
        per = kl_div_loss(logits[:, :n], targets[None, k:])
        m = mask[:, k:].float()
        ours += gamma ** k * float((per * m).sum() / (m.sum() + 1e-5))
    assert ours == pytest.approx(float(loss), rel=1e-5)


def test_dense_mask_equals_speculators_mask(inputs):
    model = make(inputs, attn_impl="sdpa")
    doc = torch.tensor([0] * 5 + [1] * 7 + [2] * 3 + [-1] * 4)
    assert torch.equal(core.dense_mask(doc), model._build_attn_mask(doc, doc.shape[0], "cpu"))


def test_target_head_reproduces_target_logits(inputs, llama_target_dir):
    """The store's `last` (pre-norm) through the head = the target's own logits."""
    from transformers import AutoModelForCausalLM

    store = inputs["store"]
    s = store.get(store.ids[0])
    target = AutoModelForCausalLM.from_pretrained(llama_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = target(s.input_ids[None]).logits[0]
    ids = inputs["t2d"].nonzero().squeeze(1)
    head = core.target_head(inputs["cfg"], inputs["weights"], ids, "cpu", torch.float32)
    torch.testing.assert_close(head.draft_logits(s.last), logits[:, ids], atol=1e-4, rtol=1e-4)
    assert torch.equal(head.greedy(s.last, chunk=7), logits.argmax(-1))
    dl, greedy = head.targets(s.last)
    assert torch.equal(dl, head.draft_logits(s.last)) and torch.equal(greedy, logits.argmax(-1))


def test_export_loads_in_speculators_with_identical_logits(inputs, tmp_path):
    from speculators.model import SpeculatorModel

    store = inputs["store"]
    model = make(inputs, attn_impl="sdpa")
    with torch.no_grad():  # move away from the initialisation so the check means something
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    out = D.export_draft(model.eval(), tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == store.layer_ids[:-1]
    assert cfg["target_hidden_size"] == 128 and cfg["draft_vocab_size"] == 96
    assert cfg["norm_before_residual"] is False
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("d2t"), inputs["d2t"]) and torch.equal(f.get_tensor("t2d"), inputs["t2d"])
    assert not any(k.startswith("verifier") for k in keys)

    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "sdpa"  # not serialized; flex needs CUDA
    loaded = SpeculatorModel.from_pretrained(str(out), config=config)
    assert type(loaded) is type(model)
    aux, tok, pos, doc, _, _ = packed(store, store.ids[:2])
    with torch.no_grad():
        a = list(core.unroll(model, aux, tok, pos, doc, 4))
        b = list(core.unroll(loaded.eval(), aux, tok, pos, doc, 4))
        tokens = loaded(hidden_states=aux, input_ids=tok, document_ids=doc[None], position_ids=pos, ttt_steps=4)
    for x, y, t in zip(a, b, tokens):
        assert torch.equal(x, y)
        assert torch.equal(y.argmax(-1), t)


def test_bf16_export_is_bf16_on_disk_and_loads_back_identical_in_bf16(inputs, tmp_path):
    """04's default --export-dtype: half the bytes of fp32, every weight the bf16 rounding of the
    trained one; loaded back (in fp32, as 05 on CPU loads it) it gives the logits of the draft with
    its weights rounded to bf16, bit for bit."""
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    store = inputs["store"]
    model = make(inputs, attn_impl="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    fp32 = D.export_draft(model.eval(), tmp_path / "fp32")
    with torch.no_grad():  # what 04 does: the draft cast to bf16 (parameters and buffers alike)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        buffers = {n: b.clone() for n, b in model.named_buffers()}  # rope's inv_freq is rebuilt on load
        out = D.export_draft(model.to(torch.bfloat16), tmp_path / "bf16")
        model.float()
        for n, p in model.named_parameters():  # the trained fp32 weights, rounded to bf16
            p.copy_(params[n].to(torch.bfloat16).float())
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        floats = {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()}
        assert floats == {torch.bfloat16} and f.get_tensor("d2t").dtype == inputs["d2t"].dtype
        assert torch.equal(f.get_tensor("fc.weight"), params["fc.weight"].to(torch.bfloat16))
    assert (out / "model.safetensors").stat().st_size < 0.6 * (fp32 / "model.safetensors").stat().st_size
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "sdpa"
    loaded = SpeculatorModel.from_pretrained(str(out), config=config, torch_dtype=torch.float32).eval()
    assert loaded.fc.weight.dtype == torch.float32
    aux, tok, pos, doc, _, _ = packed(store, store.ids[:2])
    with torch.no_grad():
        a = list(core.unroll(model.eval(), aux, tok, pos, doc, 3))
        b = list(core.unroll(loaded, aux, tok, pos, doc, 3))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_narrow_draft_learns_its_own_embeddings_and_exports_them(inputs, tmp_path):
    """Draft width 64 under a 128-wide target: fc reads 3 x 128, embed_tokens/lm_head are the
    draft's own (trainable) and the export carries embed_tokens, as vLLM needs."""
    model = make(inputs, hidden_size=64, num_heads=2, num_kv_heads=1, attn_impl="sdpa")
    assert model.fc.weight.shape == (64, 3 * 128)
    assert model.embed_tokens.weight.shape == (500, 64) and model.embed_tokens.weight.requires_grad
    assert model.lm_head.weight.shape == (96, 64) and model.lm_head.weight.requires_grad
    assert not model.embed_tokens.weight.isnan().any()
    store = inputs["store"]
    aux, tok, pos, doc, _, _ = packed(store, store.ids[:1])
    logits = list(core.unroll(model, aux, tok, pos, doc, 2))
    assert logits[0].shape == (1, tok.shape[1], 96)
    out = D.export_draft(model, tmp_path / "narrow")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["target_hidden_size"] == 128 and cfg["transformer_layer_config"]["hidden_size"] == 64
    w = load_file(str(out / "model.safetensors"))
    assert w["embed_tokens.weight"].shape == (500, 64) and w["fc.weight"].shape == (64, 384)


def test_speculators_own_model_cannot_build_a_narrow_draft(inputs):
    """Why build_draft rebuilds fc: speculators 0.9.0 sizes fc by the draft's width, so its own
    from_pretrained cannot load a narrow draft (vLLM sizes it by target_hidden_size)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    model = make(inputs, hidden_size=64, num_heads=2, num_kv_heads=1)
    plain = Eagle3DraftModel(model.config)
    assert plain.fc.weight.shape == (64, 3 * 64) != model.fc.weight.shape


def test_qwen3_style_draft(inputs, tmp_path):
    model = make(inputs, arch="qwen3", attn_impl="sdpa")
    assert type(model.layers[0]).__name__ == "Qwen3DecoderEagle3FirstLayer"
    store = inputs["store"]
    aux, tok, pos, doc, _, _ = packed(store, store.ids[:1])
    assert next(core.unroll(model, aux, tok, pos, doc, 1)).shape[-1] == 96
    cfg = json.loads((D.export_draft(model, tmp_path / "q") / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"


def test_layer_config_follows_the_target(inputs, deepseek_target_dir):
    lc = D.layer_config(inputs["cfg"])
    tc = inputs["cfg"]
    assert (lc.hidden_size, lc.num_attention_heads, lc.num_key_value_heads, lc.intermediate_size) == \
        (tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, tc.intermediate_size)
    assert lc.vocab_size == tc.vocab_size and lc.num_hidden_layers == 1
    ds = AutoConfig.from_pretrained(deepseek_target_dir)
    lc = D.layer_config(ds)  # MLA + MoE target: a plain Llama layer of the same width, plain rope
    assert lc.hidden_size == ds.hidden_size and lc.rope_parameters["rope_type"] == "default"
    assert lc.hidden_size % lc.num_attention_heads == 0


def test_lr_schedule():
    f = lambda s, **kw: D.lr_lambda(s, warmup=10, total=110, min_ratio=0.1, **kw)  # noqa: E731
    assert f(0, schedule="cosine") == pytest.approx(0.1) and f(9, schedule="cosine") == 1.0
    assert f(60, schedule="cosine") == pytest.approx(0.55)
    assert f(110, schedule="cosine") == pytest.approx(0.1) and f(110, schedule="linear") == pytest.approx(0.1)
    assert f(60, schedule="linear") == pytest.approx(0.55) and f(100, schedule="constant") == 1.0


@pytest.mark.parametrize("impl", ["eager", "simple_flex_attention"])
def test_other_attention_paths_give_the_sdpa_logits(inputs, impl):
    """The GPU path (flex attention with block masks, padded to a multiple of 128) and the eager
    path (float masks) compute what the CPU sdpa path does; flex runs forward-only on CPU."""
    store = inputs["store"]
    aux, tok, pos, doc, _, _ = packed(store, store.ids[:2])
    pad = -(-aux.shape[1] // 128) * 128 - aux.shape[1]
    z = lambda t, v=0: torch.cat([t, t.new_full((*t.shape[:-2], pad, t.shape[-1]) if t.dim() == 3  # noqa: E731
                                                  else (*t.shape[:-1], pad), v)], dim=-2 if t.dim() == 3 else -1)
    aux, tok, pos, doc = z(aux), z(tok), z(pos), z(doc, -1)
    ref = make(inputs, attn_impl="sdpa").eval()
    other = make(inputs, attn_impl=impl).eval()
    other.load_state_dict(ref.state_dict())
    n = aux.shape[1] - pad
    with torch.no_grad():
        for a, b in zip(core.unroll(ref, aux, tok, pos, doc, 3), core.unroll(other, aux, tok, pos, doc, 3)):
            torch.testing.assert_close(b[:, :n], a[:, :n], atol=2e-5, rtol=1e-4)
