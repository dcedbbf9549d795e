"""`ppsplit compile` of decoders whose code reads values on the meta device, where the compile traces their skeleton:
a constant made from Python data (a list index, `torch.tensor(finfo.min)`), HF's padding-token check, MoE routing's
`.tolist()`, and a tied head that registers before the embedding it shares. Each folder decodes like HF."""
import pytest
import torch
import transformers
from packaging.version import Version

import ppsplit
from ppsplit import CacheConfig
from tests.support import decode, hf_greedy, random_model

V = 128
_SPECIAL = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_BERT = dict(_SPECIAL, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64, is_decoder=True)
CONFIGS = {
    # `qkv[:, :, :, [-2]]` (grouped KV heads) and `fused_qkv[..., [-2], :]` (multi-query): list indices
    "falcon-gqa": dict(_SPECIAL, model_type="falcon", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_kv_heads=2, new_decoder_architecture=True),
    "falcon-mqa": dict(_SPECIAL, model_type="falcon", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                       new_decoder_architecture=False, multi_query=True),
    # `torch.tensor(torch.finfo(dtype).min, device=...)` in its attention; its window mask `bias[:, :, K - T : K]`
    # (4 tokens, shorter than the prompt) read at the queries' positions
    "gpt_neo": dict(_SPECIAL, hidden_size=64, num_layers=3, num_heads=4, max_position_embeddings=64,
                    attention_types=[[["global", "local"], 1], [["global"], 1]], window_size=4),
    # `lm_head.decoder.weight` registers before the embedding it is tied to; the checkpoint stores the embedding
    "camembert": dict(_BERT),
    # HF's `pad_token_id in input_ids[:, [-1, 0]]` padding check runs in the cache's recording run
    "megatron-bert": dict(_BERT),
    # `expert_size.tolist()` in its MoE routing, in the same run
    "jetmoe": dict(_SPECIAL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, kv_channels=16, num_local_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64),
}
# Models whose export lifts tensors built from Python data (transformers 5.25's Falcon builds none)
CONSTANTS = {"gpt_neo"} | ({"falcon-gqa", "falcon-mqa"} if Version(transformers.__version__) < Version("5.25") else set())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_folder_decodes_like_hf(name, tmp_path):
    config = dict(CONFIGS[name])
    config.setdefault("model_type", name)
    model = random_model(config)
    ids = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if not torch.allclose(model(ids[:, :3]).logits, model(ids).logits[:, :3], atol=1e-5):
            pytest.skip(f"transformers {transformers.__version__}'s {name} is not causal (later tokens change earlier "
                        "logits): its generate disagrees with its own forward, so no split can match both")
    expected = hf_greedy(model, ids, 6)
    model.save_pretrained(tmp_path / "ckpt")
    folder = ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "out"), pp=2, cache=CacheConfig(2, 16))
    loaded = ppsplit.load(folder)
    assert torch.equal(decode(loaded, ids, 6), expected)
    if name in CONSTANTS:  # the constants made from Python data are in the folder, with the values it decodes by
        assert any("lifted_tensor" in buf for stage in loaded.stages for buf, _ in stage.named_buffers())
