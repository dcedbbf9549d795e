"""Full-size model shapes (published configs) for benchmarks; weights are random or on the meta device."""
from transformers import AutoConfig

SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "gemma-2-9b": dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       max_position_embeddings=8192, sliding_window=4096),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768),
    # Hybrids (issue: recurrent state in the cache). Layer pattern as published; benches cut the layer count.
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                               num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               partial_rotary_factor=0.25, rope_theta=10000000.0, max_position_embeddings=262144,
                               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12),
    "nemotron-h-8b": dict(model_type="nemotron_h", vocab_size=131072, hidden_size=4096, intermediate_size=21504,
                          num_hidden_layers=52, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4,
                          chunk_size=128, max_position_embeddings=8192, mlp_hidden_act="relu2",
                          layers_block_type=[{"M": "mamba", "-": "mlp", "*": "attention"}[c] for c in
                                             "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"]),
}


def cut(name: str, layers: int) -> dict:
    """The shape's overrides for its first ``layers`` layers (layer pattern kept)."""
    kw = {"num_hidden_layers": layers}
    for key in ("layer_types", "layers_block_type"):
        if key in SHAPES[name]:
            kw[key] = SHAPES[name][key][:layers]
    return kw


def config(name: str, **overrides):
    kw = dict(SHAPES[name])
    kw.update(overrides)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)
