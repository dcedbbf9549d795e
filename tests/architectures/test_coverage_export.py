"""Models whose code torch.export balks at: MPT's cached trace goes through ppsplit's cache-length fallback and decodes
like HF; experts transformers lets a caller switch (`experts_implementation="eager"`'s loop) and a cache a model
makes for itself (GraniteMoeSWA) are switched while tracing; models with a data-dependent loop of their own (dbrx,
longcat_flash), a token-count-dependent path (deepseek_v4, cpmant) or decoder layers that run more than once (dory,
hrm_text) get one line naming the reason, before any split."""
import inspect
import sys

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig
from tests.support import decode, hf_greedy, tiny_model

V = 128
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "mpt": dict(vocab_size=V, d_model=64, n_layers=4, n_heads=4, max_seq_len=64, expansion_ratio=2),
    "dbrx": dict(vocab_size=V, d_model=64, n_layers=4, n_heads=4, max_seq_len=64,
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "longcat_flash": dict(vocab_size=V, hidden_size=64, num_layers=4, num_attention_heads=4, ffn_hidden_size=128,
                          expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
                          q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                          head_dim=8, max_position_embeddings=64),
    # One compressed-sparse-attention layer (windows of 4 tokens): the path that depends on the token count.
    "deepseek_v4": dict(vocab_size=V, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=16,
                        qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=16, o_groups=2, index_n_heads=2,
                        index_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        hc_mult=2, hc_sinkhorn_iters=2, max_position_embeddings=64,
                        layer_types=["compressed_sparse_attention"]),
    "cpmant": dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, dim_head=16,
                   dim_ff=128, prompt_length=4, position_bias_num_buckets=32, position_bias_max_distance=64),
    "granitemoe_swa": dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=4, max_position_embeddings=64),
    # Hyper-connection streams, a compressed-block indexer and experts; its indexer reads cache layers of its own.
    "qwen4_exp_text": dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                           linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                           moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2, hc_lowrank=8, max_position_embeddings=64, indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4),
    # max_position_embeddings is -1 (no limit); its memory `curr_out[-mem_len:]` depends on the token count
    "xlnet": dict(vocab_size=V, d_model=64, n_layer=2, n_head=4, d_inner=128),
    # A looped (recurrent-depth) section: layers 1..2 run twice per forward.
    "dory": dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"] * 2, n_input_layers=1, n_recurrent_layers=2,
                 n_output_layers=1),
    # Two stacks of 2 layers, run H_cycles * L_cycles and H_cycles times.
    "hrm_text": dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                     num_layers_per_stack=2, H_cycles=2, L_cycles=2, L_bp_cycles=[1], max_position_embeddings=64),
}


def build(name, device=None):
    if name not in CONFIG_MAPPING:
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {name}")
    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **CONFIGS[name], **_SPECIAL)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config).eval()
    if device is None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    return model


def test_mpt_with_a_cache_splits_and_decodes_like_hf():
    """MPT slices its ALiBi bias by `T + cache.get_seq_length()`; export proves that slice away once the cached
    length is a size in [0, max_len), and the stages keep no read of it (no host sync per step)."""
    model = build("mpt")
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    traced = ppsplit.trace_model(model, cache=CacheConfig(batch_size=2, max_len=24))
    reads = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)
    assert not [n for n in traced.gm.graph.nodes if n.target in reads]
    for pp in (2, 3):
        split = ppsplit.split_model(traced, pp, aux=[1, 2, 3])
        logits, aux = split(ids, torch.arange(6))
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        for slot, tap in enumerate((1, 2, 3)):
            torch.testing.assert_close(aux[slot], ref.hidden_states[tap], atol=1e-5, rtol=0)
        out = decode(split, ids, 8)
        assert torch.equal(out, expected), f"pp={pp}:\n{out[:, 6:]}\n{expected[:, 6:]}"


@pytest.mark.parametrize("name,line", [("dbrx", "modeling_dbrx.py:"), ("longcat_flash", "modeling_longcat_flash.py:")])
def test_data_dependent_expert_loops_name_the_model_line(name, line):
    """`for expert_idx in expert_hit:` loops as many times as experts were routed to: no graph can hold that. A
    model that no longer runs that loop by default (transformers 5.25's LongCat, through its experts implementation)
    must split exactly instead."""
    model = build(name)
    try:
        traced = ppsplit.trace_model(model)
    except ppsplit.TraceError as err:
        msg = str(err)
        assert "\n" not in msg and line in msg and "in expert_hit" in msg, msg
        assert "the model's own code, not ppsplit" in msg and "GuardOnDataDependentSymNode" in msg
        return
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ppsplit.split_model(traced, 2)(ids, torch.arange(6))[0]
        torch.testing.assert_close(got, model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,why", [
    ("longcat_flash", "the model writes cache layer 4 but has 4 decoder layers"),  # two attentions per layer
    ("qwen4_exp_text", "Qwen4ExpForCausalLM reads 'indexer_position_ids' from its cache")])
def test_caches_indexed_or_shaped_otherwise_are_refused_in_one_line(name, why):
    """A model whose cache is not one attention per decoder layer, or whose cache layers are a kind of its own, is
    refused with the reason, not an IndexError or AttributeError from inside transformers."""
    model = build(name)
    if name == "qwen4_exp_text" and "indexer_position_ids" not in inspect.getsource(sys.modules[type(model).__module__]):
        pytest.skip(f"transformers {transformers.__version__}'s Qwen4-Exp reads no indexer_position_ids from its cache")
    with pytest.raises(ppsplit.ConfigError) as err:
        ppsplit.trace_model(model, cache=CacheConfig(1, 32))
    msg = str(err.value)
    assert "\n" not in msg and why in msg and msg.endswith("split it without cache="), msg


def test_token_count_dependent_path_names_the_model_line():
    """deepseek_v4 compresses windows of 4 tokens and branches on whether any window is complete; export pins the
    token count to the example's. The error names that branch; a cache is refused up front (compressed state)."""
    with pytest.raises(ppsplit.ConfigError, match="compressed_sparse_attention layers keep a compressed KV state"):
        ppsplit.trace_model(build("deepseek_v4", device="meta"), cache=CacheConfig(1, 32))
    with pytest.raises(ppsplit.TraceError) as err:
        ppsplit.trace_model(build("deepseek_v4"))
    msg = str(err.value)
    assert "\n" not in msg and "could not keep the token count of DeepseekV4ForCausalLM dynamic" in msg, msg
    assert "modeling_deepseek_v4.py:" in msg and "if chunk_kv.shape[1] > 0:" in msg, msg
    assert "the model's own code, not ppsplit" in msg


def test_a_token_count_fixed_by_a_python_loop_is_refused_at_trace():
    """A layer that loops over the tokens in Python (as RecurrentGemma's RG-LRU scan and Mamba's did before ppsplit
    routed them to its own ops): export unrolls it for the example's 8 tokens and fixes the token count. That used to
    pass the trace and fail at the first other length (an IndexError in the stage); the trace says so."""
    from tests.support import tiny_model

    model = tiny_model("llama")
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: torch.stack([type(mlp).forward(mlp, x[:, t]) for t in range(x.shape[1])], dim=1)
    with pytest.raises(ppsplit.TraceError, match=r"could not keep the token count of LlamaForCausalLM "
                                                 r"dynamic.* would take only token counts 8\.\.8"):
        ppsplit.trace_model(model)


def test_a_model_without_a_position_limit_traces_up_to_its_own_code():
    """XLNet says max_position_embeddings=-1; that means no limit (it crashed ppsplit's example input), and the trace
    then names the line of its own that depends on the token count, its memory of the last mem_len states."""
    with pytest.raises(ppsplit.TraceError) as err:
        ppsplit.trace_model(build("xlnet"))
    msg = str(err.value)
    assert "\n" not in msg and "could not keep the token count of XLNetLMHeadModel dynamic" in msg, msg
    assert "modeling_xlnet.py:" in msg, msg


def test_token_count_fixed_by_python_names_the_model_line():
    """CPM-Ant builds a mask from `list(range(seqlen - prompt_length))`: export fixes the token count to the example's,
    and the guard that fixed it names that line."""
    with pytest.raises(ppsplit.TraceError) as err:
        ppsplit.trace_model(build("cpmant", device="meta"))
    msg = str(err.value)
    assert "\n" not in msg and "would take only token counts 8..8" in msg, msg
    assert "modeling_cpmant.py:" in msg and "list(range(seqlen - self.prompt_length))" in msg, msg


@pytest.mark.parametrize("name,layers,traced", [
    ("dory", None, "runs decoder layers 1..2 of model.layers up to 2 times per forward"),
    ("hrm_text", "model.L_module.layers", "runs decoder layers 0..1 of model.L_module.layers up to 4 times"),
    ("hrm_text", "model.H_module.layers", "runs decoder layers 0..1 of model.H_module.layers up to 2 times")])
def test_decoder_layers_that_run_more_than_once_are_refused(name, layers, traced):
    """A pipeline cut along the layer list needs each layer to run once; a looped section is named (from the graph),
    not a node dump, and with a cache before the export (from the cache's recording run, which the loop trips up)."""
    model = build(name, device="meta")
    with pytest.raises(ppsplit.TraceError) as err:
        ppsplit.trace_model(model, layers=layers)
    msg = str(err.value)
    assert "\n" not in msg and traced in msg and "%" not in msg, msg
    if layers == "model.H_module.layers":  # HRM's L stack runs first and addresses cache slots this stack lacks
        return
    with pytest.raises(ppsplit.TraceError, match=rf"runs decoder layers \d+\.\.\d+ of {layers or 'model.layers'} up to "
                                                 r"\d+ times per forward \(a looped section\)"):
        ppsplit.trace_model(model, layers=layers, cache=CacheConfig(1, 32))


def test_experts_switched_from_their_eager_loop_split_and_decode_like_hf():
    """`experts_implementation="eager"` loops over the experts a batch routed to; the trace runs them through
    grouped_mm instead (switched back after), and the split equals HF's eager loop."""
    model = tiny_model("mixtral", num_layers=3)
    model.set_experts_implementation("eager")
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    expected = hf_greedy(model, ids, 6)
    split = ppsplit.split_model(model, 2, aux=[1, 2], cache=CacheConfig(2, 16))
    assert model.config._experts_implementation == "eager"
    logits, aux = split(ids, torch.arange(6))
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
    for slot, tap in enumerate((1, 2)):
        torch.testing.assert_close(aux[slot], ref.hidden_states[tap], atol=1e-5, rtol=0)
    assert torch.equal(decode(split, ids, 6), expected)
    gm = split.stages[0]
    assert any("grouped_mm" in str(n.target) for n in gm.graph.nodes), "the experts did not go through grouped_mm"


def test_a_cache_the_model_makes_for_itself_is_off_while_tracing():
    """GraniteMoeSWA's forward takes use_cache only from its config and would build a sliding-window cache of its own,
    whose `keys[:, :, -window + 1:]` narrows the token count; traced with its config's use_cache off, it splits for every
    token count and decodes like HF."""
    model = build("granitemoe_swa")
    assert model.config.use_cache
    split = ppsplit.split_model(model, 2, aux=[1, 3])
    for tokens in (1, 3, 7):
        ids = torch.randint(3, V, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            ref = model(ids, output_hidden_states=True)
        logits, aux = split(ids)
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(aux[1], ref.hidden_states[3], atol=1e-5, rtol=0)
    assert model.config.use_cache
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(decode(ppsplit.split_model(model, 2, cache=CacheConfig(2, 16)), ids, 6), hf_greedy(model, ids, 6))
