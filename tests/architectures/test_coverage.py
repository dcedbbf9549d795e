"""Decoders beyond the core zoo that once crashed or decoded wrongly inside ppsplit: post-LayerNorm layers (openai-gpt,
OPT-350m's layout), a scalar input beside the attention (xglm), GPT-Neo's window mask over a cache and data-dependent
MoE routing sizes (jetmoe). Split with taps and cached greedy decoding against HF."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig
from tests.support import decode, random_model

V = 128
CONFIGS = {
    "openai-gpt": dict(vocab_size=V, n_embd=64, n_layer=4, n_head=4, n_positions=64),
    "opt-post-ln": dict(model_type="opt", vocab_size=V, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                        do_layer_norm_before=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # A scalar float input beside its attention (its embedding scale) once crashed the attention pass's ALiBi probe.
    "xglm": dict(vocab_size=V, d_model=64, ffn_dim=128, num_layers=4, attention_heads=4, max_position_embeddings=64,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Its window mask is a slice of a [max_positions, max_positions] table by key count minus query count; with a
    # window (4) shorter than the prompt it must be read at the queries' positions in the cache.
    "gpt_neo-window": dict(model_type="gpt_neo", vocab_size=V, hidden_size=64, num_layers=4, num_heads=4,
                           max_position_embeddings=64, attention_types=[[["global", "local"], 2]], window_size=4,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "jetmoe": dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, kv_channels=16, num_local_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


def build(name):
    return random_model({"model_type": name, **CONFIGS[name]})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_and_decode_match_hf(name):
    model = build(name)
    ids = torch.randint(3, V, (2, 6))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    traced = ppsplit.trace_model(model)
    for pp in (2, 3):
        split = ppsplit.split_model(traced, pp, aux=[1, 2, 3])
        logits, aux = split(ids)
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        for slot, tap in enumerate((1, 2, 3)):
            torch.testing.assert_close(aux[slot], ref.hidden_states[tap], atol=1e-5, rtol=0)
    if name == "openai-gpt":  # its forward takes no cache: refused up front, with the reason
        with pytest.raises(ppsplit.ConfigError, match="OpenAIGPTLMHeadModel.forward takes no cache"):
            ppsplit.trace_model(model, cache=CacheConfig(batch_size=2, max_len=24))
        return
    cached = ppsplit.trace_model(model, cache=CacheConfig(batch_size=2, max_len=24))
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    for pp in (2, 3):
        split = ppsplit.split_model(cached, pp, aux=[2])
        logits, _ = split(ids, torch.arange(6))  # the prefill step, through the cache
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        out = decode(split, ids, 8)
        assert torch.equal(out, expected), f"{name} pp={pp}:\n{out[:, 6:]}\n{expected[:, 6:]}"


# Families whose decoding state is not K/V at positions: a cache is refused up front, with the reason, before any
# trace; without a cache each call runs the whole sequence.
STATEFUL = {
    # The recurrences ppsplit routes keep their state in the cache (tests/architectures/test_recurrent_cache.py);
    # DeepSeek-V4's compressed KV (token windows pooled into entries) is not one of them.
    "deepseek_v4": ("compressed_attention layers keep a compressed KV state", {}),
}


@pytest.mark.parametrize("model_type", list(STATEFUL))
def test_state_space_and_indexer_caches_are_refused_up_front(model_type):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {model_type}")
    reason, kw = STATEFUL[model_type]
    config = AutoConfig.for_model(model_type, num_hidden_layers=3, **kw)
    if not any(str(v) in ("linear_attention", "hybrid", "recurrent", "indexed_attention") or "compressed" in str(v)
               for attr in ("layer_types", "block_types") for v in (getattr(config, attr, None) or ())):
        pytest.skip(f"this transformers' {model_type} config names no layer kinds")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ppsplit.ConfigError, match=reason) as err:
        ppsplit.trace_model(model, cache=CacheConfig(1, 32))
    assert "split it without cache=" in str(err.value) and "\n" not in str(err.value)
