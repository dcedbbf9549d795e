"""Which architectures ppsplit splits and decodes, checked against Hugging Face on tiny random models (CPU).

    python bench/arch_survey.py                  # every architecture below
    python bench/arch_survey.py falcon bloom     # a few

For each: split pp=2 with taps (0, 1, L) and compare logits and taps with the unsplit model (cacheless), then
split pp=2 with a static KV cache and compare greedy decoding (16 new tokens) with ``model.generate``.
"""
import sys
import time
import traceback
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit

warnings.filterwarnings("ignore")
L, H, V = 4, 64, 128
BASE = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
EXTRA = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=16), "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=4), "gemma3_text": dict(head_dim=16, sliding_window=4),
    "phi3": {}, "phi": {}, "gpt2": dict(n_embd=H, n_layer=L, n_head=4, n_positions=256),
    "gpt_neox": {}, "opt": dict(ffn_dim=128, word_embed_proj_dim=H), "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "falcon": dict(new_decoder_architecture=False, multi_query=True), "bloom": dict(n_layer=L, n_head=4),
    "gpt_bigcode": dict(n_embd=H, n_layer=L, n_head=4, n_positions=256), "gptj": dict(n_embd=H, n_layer=L, n_head=4, rotary_dim=8, n_positions=256),
    "codegen": dict(n_embd=H, n_layer=L, n_head=4, rotary_dim=8, n_positions=256, n_ctx=256),
    "starcoder2": {}, "stablelm": {}, "olmo": {}, "olmo2": {}, "cohere": {}, "cohere2": dict(sliding_window=4),
    "granite": {}, "smollm3": {}, "biogpt": {}, "xglm": dict(d_model=H, ffn_dim=128, num_layers=L, attention_heads=4),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
                        n_group=1, topk_group=1, num_key_value_heads=4),
    "nemotron": dict(head_dim=16), "glm": dict(head_dim=16), "helium": dict(head_dim=16), "exaone4": dict(sliding_window=4),
}


def tiny(arch):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, **{**BASE, **EXTRA[arch]})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def check(arch):
    model = tiny(arch)
    n = ppsplit.passes.annotate.find_layers(model).num_layers
    ids = torch.randint(3, V, (2, 9))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    split = ppsplit.split_model(model, 2, aux=[0, 1, n - 1])
    with torch.no_grad():
        logits, aux = split(ids)
    err = max((logits - ref.logits).abs().max().item(),
              *((aux[k] - ref.hidden_states[t]).abs().max().item() for k, t in enumerate((0, 1, n - 1))))
    split_ok = "ok" if err < 1e-4 else f"MISMATCH {err:.1e}"
    try:
        cached = ppsplit.split_model(model, 2, cache=ppsplit.CacheConfig(2, 64))
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=16, do_sample=False)
        got = cached.generate(ids, 16)
        decode_ok = "ok" if torch.equal(got, expected) else f"MISMATCH at token {int((got != expected).any(0).nonzero()[0])}"
    except Exception as e:
        decode_ok = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return split_ok, decode_ok


def main():
    archs = [a for a in sys.argv[1:] if not a.startswith("-")] or list(EXTRA)
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}")
    print(f"{'arch':<13} {'split (pp=2, taps)':<22} decode (pp=2, static cache, 16 tokens)")
    for arch in archs:
        start = time.perf_counter()
        try:
            split_ok, decode_ok = check(arch)
        except Exception as e:
            split_ok, decode_ok = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:150]}", "-"
            if "-v" in sys.argv:
                traceback.print_exc()
        print(f"{arch:<13} {split_ok:<22} {decode_ok}  ({time.perf_counter() - start:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
