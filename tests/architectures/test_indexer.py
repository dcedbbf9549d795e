"""Sparse attention with an indexer cache (DeepSeek-V3.2's DSA): the indexer's keys live in each stage's cache beside
the MLA latents (``kv_cache.<layer>.indexer_keys``, a block pool), written at positions, so one stage serves prefill,
decode and verification. The oracle is Hugging Face's model and its own cache (``DynamicIndexedLayer``)."""
import pytest
import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

import ppsplit
from tests.support import decode
from ppsplit import CacheConfig

V = 128
TOPK = 4  # the indexer keeps 4 keys per query: a strict subset of every sequence below (10 + 12 tokens)
CACHE = CacheConfig(batch_size=2, max_len=32)
_SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, attention_bias=True, q_lora_rank=32, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, index_head_dim=16, index_n_heads=2,
              index_topk=TOPK, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
              first_k_dense_replace=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_EXTRA = {"deepseek_v32": {}, "glm_moe_dsa": dict(indexer_types=["full"] * 4),
          # "shared" layers have no indexer of their own: they reuse the previous layer's top-k indices
          "glm_moe_dsa_shared": dict(indexer_types=["full", "shared", "full", "shared"]),
          "axk2": dict(n_group=None, topk_group=None, gated_norm_rank=4)}
_MODELS: dict = {}


def build(model_type):
    """``(indexed_model(model_type), its trace with CACHE)``, built once."""
    if model_type not in _MODELS:
        model = indexed_model(model_type)
        _MODELS[model_type] = (model, ppsplit.trace_model(model, cache=CACHE))
    return _MODELS[model_type]


def indexed_model(model_type):
    """A tiny random DSA model whose indexer scores have no exact ties. The indexer scores keys with
    ``relu(q . k)``; random weights make many scores exactly 0, and ``topk`` breaks such ties differently in every
    implementation (HF's own cached and uncached forwards disagree). A constant positive part in q (a bias on
    ``q_a_proj`` feeding the indexer's non-rotary query dims) and in k (``k_norm``'s bias) keeps every score
    positive, so the selection is well defined and still data-dependent."""
    base = model_type.removesuffix("_shared")
    if base not in CONFIG_MAPPING:
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {base}")
    torch.manual_seed(0)
    config = AutoConfig.for_model(base, **dict(_SHAPE, **_EXTRA[model_type]))
    model = AutoModelForCausalLM.from_config(config).eval()
    rope = config.qk_rope_head_dim
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for layer in model.model.layers:
            attn, ix = layer.self_attn, layer.self_attn.indexer
            attn.q_a_proj.bias[0] = 10.0
            if ix is None:  # a "shared" layer
                continue
            ix.wq_b.weight.view(ix.n_heads, ix.head_dim, -1)[:, rope:, 0] = 1.0
            ix.k_norm.bias[rope:] = 2.0
    return model


def prompt(seed=0, batch=2, tokens=10):
    return torch.randint(3, V, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def test_split_taps_match_hf():
    """A prefill through the cached stages: logits and taps equal HF's ``output_hidden_states``."""
    model, traced = build("deepseek_v32")
    ids = prompt()
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    for pp in (2, 3):
        logits, aux = ppsplit.split_model(traced, pp, aux=[1, 2, 3])(ids, torch.arange(ids.shape[1]))
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        for slot, tap in enumerate((1, 2, 3)):
            torch.testing.assert_close(aux[slot], ref.hidden_states[tap], atol=1e-5, rtol=0)


def test_cached_generate_matches_hf_and_holds_its_indexer_keys():
    model, traced = build("deepseek_v32")
    ids = prompt()
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
        # The sparse selection decides the tokens: the same model attending to every key decodes otherwise.
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = 10_000
        dense = model.generate(ids, max_new_tokens=12, do_sample=False)
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = TOPK
    assert not torch.equal(dense, hf.sequences)
    hf_cache = hf.past_key_values if hasattr(hf, "past_key_values") else hf.cache
    for pp in (2, 3):
        split = ppsplit.split_model(traced, pp, aux=[2])
        out = decode(split, ids, 12)
        assert torch.equal(out, hf.sequences), f"pp={pp}:\n{out[:, 10:]}\n{hf.sequences[:, 10:]}"
        # Each stage's cache holds the indexer keys HF's cache holds, position for position: in block pools, where a
        # lockstep call (here a prefill of the generated sequences) gives row b the blocks b * M .. (b + 1) * M - 1.
        assert split.plan.paged, split.plan.lockstep_reason
        written = hf_cache.layers[0].indexer_keys.shape[1]
        split(hf.sequences[:, :written], torch.arange(written))
        buffers = {}
        for stage in split.stages:
            buffers.update((n, b) for n, b in stage.named_buffers() if n.endswith(".indexer_keys"))
        assert sorted(buffers) == [f"kv_cache.{i}.indexer_keys" for i in range(4)]
        per_row = split.layout.blocks_per_seq
        for i in range(4):
            expected = hf_cache.layers[i].indexer_keys
            rows = buffers[f"kv_cache.{i}.indexer_keys"][:2 * per_row].reshape(2, -1, expected.shape[-1])
            torch.testing.assert_close(rows[:, :expected.shape[1]], expected, atol=1e-5, rtol=0)


def test_verify_with_rejected_drafts_then_decode():
    """One stage program serves prefill, a K=4 verification step whose last two drafts are wrong, and decoding on
    from the accepted position: the stale indexer keys of the rejected drafts are overwritten, never rolled back."""
    model, traced = build("deepseek_v32")
    split = ppsplit.split_model(traced, 3, aux=[0, 2])
    ids = prompt(seed=1, batch=1)
    T = ids.shape[1]
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=12, do_sample=False)[0, T:]
    logits, _ = split(ids, torch.arange(T))
    first = logits[0, -1].argmax()
    assert first == reference[0]
    drafts = torch.cat([reference[1:3], (reference[3:5] + 1) % V])
    verify_in = torch.cat([first[None], drafts])[None]
    logits, aux = split(verify_in, torch.arange(T, T + 5))
    with torch.no_grad():
        full = model(torch.cat([ids, verify_in], 1), output_hidden_states=True)
    torch.testing.assert_close(logits[0], full.logits[0, T:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux[1, 0], full.hidden_states[2][0, T:], atol=1e-4, rtol=1e-4)
    preds = logits[0].argmax(-1)
    assert torch.equal(preds[:2], drafts[:2]) and preds[2] != drafts[2] and preds[2] == reference[3]
    tokens, pos = [first, *drafts[:2], preds[2]], T + 3
    while len(tokens) < len(reference):
        logits, _ = split(tokens[-1].view(1, 1), torch.tensor([pos]))
        tokens.append(logits[0, -1].argmax())
        pos += 1
    assert torch.equal(torch.stack(tokens), reference)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa"])
def test_other_indexer_models_decode_like_hf(model_type):
    model, traced = build(model_type)
    ids = prompt(seed=2)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    out = decode(ppsplit.split_model(traced, 2, aux=[1, 3]), ids, 12)
    assert torch.equal(out, expected), f"{model_type}:\n{out[:, 10:]}\n{expected[:, 10:]}"


def test_shared_indexer_top_k_is_carried_across_a_boundary():
    """A "shared" layer reads the top-k indices its previous layer's indexer chose; cut between them, the indices
    ([B, T, top-k] integers) are carried beside the residual stream, and decoding still equals HF."""
    model, traced = build("glm_moe_dsa_shared")
    ids = prompt(seed=2)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    split = ppsplit.split_model(traced, 2, balance=[1, 3])  # layer 0 (full) | layer 1 (shared) ...
    assert [(c.shape, c.stages) for c in split.plan.carries] == [((TOPK,), (1,))]
    assert split.plan.carries[0].dtype.startswith("int")
    assert torch.equal(decode(split, ids, 12), expected)
