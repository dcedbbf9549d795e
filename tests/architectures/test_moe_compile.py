"""ppsplit compile on MoE checkpoints in the layout transformers writes (per-expert tensors, renamed modules),
converted to the fused layout the model uses by transformers' own weight conversions, stage by stage."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit
from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import is_cache_buffer
from ppsplit.compile.writer import compile_model
from tests.support import VOCAB, decode, tiny_config

L = 4
_MOE = dict(num_experts_per_tok=2)
ARCHS = {  # arch: (config overrides, taps)
    "mixtral": (dict(_MOE, num_local_experts=4), "0,2,4"),
    "qwen2_moe": (dict(_MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48), "1,2,3"),
    "qwen3_moe": (dict(_MOE, num_experts=4, moe_intermediate_size=32, head_dim=16), "1,3,4"),
    "deepseek_v3": (dict(_MOE, n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                         topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16, n_shared_experts=1, num_key_value_heads=4), "0,2,4"),
    "olmoe": (dict(_MOE, num_experts=4), "0,1,3"),
    "gpt_oss": (dict(_MOE, num_local_experts=4, head_dim=16, layer_types=None, sliding_window=4), "1,2,4"),
}
_CHECKPOINTS: dict = {}


def moe_config(arch: str):
    overrides, _ = ARCHS[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_hidden_layers=L)
    return AutoConfig.for_model(arch, **dict(kw, **overrides))


def checkpoint(arch: str, tmp_path_factory):
    """A tiny random ``arch`` saved by save_pretrained in small shards, and the model from_pretrained loads from it
    (built once per arch, shared by its pp=2 and pp=3 compiles)."""
    if arch not in _CHECKPOINTS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(moe_config(arch)).eval()
        with torch.no_grad():
            for p in model.parameters():  # no weight left at exactly 0 or 1: a wrong or missing one shows
                p.add_(torch.randn_like(p) * 0.02)
        folder = tmp_path_factory.mktemp(arch) / "ckpt"
        model.save_pretrained(folder, max_shard_size="60KB")
        _CHECKPOINTS[arch] = folder, AutoModelForCausalLM.from_pretrained(folder).eval()
    return _CHECKPOINTS[arch]


@pytest.fixture(scope="module", params=[(arch, pp) for arch in ARCHS for pp in (2, 3)], ids=lambda p: f"{p[0]}-pp{p[1]}")
def compiled(request, tmp_path_factory):
    """(arch, checkpoint folder, compiled folder, pp, taps, the model from_pretrained loads from the folder)."""
    arch, pp = request.param
    folder, hf = checkpoint(arch, tmp_path_factory)
    taps = ARCHS[arch][1]
    out = compile_model(str(folder), str(folder.parent / f"out-pp{pp}"), pp=pp, aux=taps)
    return arch, folder, out, pp, [int(j) for j in taps.split(",")], hf


def test_checkpoint_is_in_the_stored_layout(compiled):
    """save_pretrained reverses the conversions: the folder holds what the hub holds, not the model's names."""
    arch, folder, _, _, _, _ = compiled
    with open(folder / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    names = set(weight_map)
    assert len(set(weight_map.values())) > 3  # sharded: a layer's experts are spread over several files
    if arch == "gpt_oss":  # transformers stores gpt-oss experts fused; there is nothing to convert
        assert "model.layers.1.mlp.experts.gate_up_proj" in names
    else:
        moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
        proj = "w1" if arch == "mixtral" else "gate_proj"
        assert f"model.layers.1.{moe}.experts.3.{proj}.weight" in names
        assert not any(n.endswith("experts.gate_up_proj") for n in names)


def test_logits_and_taps_equal_from_pretrained(compiled):
    arch, folder, out, pp, taps, hf = compiled
    split = ppsplit.load(out)
    assert split.plan.pp == pp and split.plan.taps == tuple(taps)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, aux = split(ids)
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    for slot, j in enumerate(taps):
        if j < L:  # HF's entry L is after the final norm
            torch.testing.assert_close(aux[slot], ref.hidden_states[j], atol=1e-5, rtol=1e-5)


def test_stage_files_hold_exactly_what_each_program_reads(compiled):
    arch, folder, out, pp, _, model = compiled
    hf = model.state_dict()
    plan = ppsplit.artifact.folder.CompiledFolder(out).plan
    for k in range(pp):
        stage = ppsplit.load_stage(out, k)
        read = {n.target for n in stage.graph.nodes if n.op == "get_attr" and not is_cache_buffer(n.target)}
        with safe_open(os.path.join(out, f"stage_{k}.safetensors"), framework="pt") as f:
            stored = set(f.keys())
            assert stored == read, (arch, k, sorted(stored ^ read)[:4])
            sp = plan.stages[k]
            experts = {n for n in stored if ".experts." in n}
            layers = {int(n.split(".")[2]) for n in experts}
            assert layers <= set(range(sp.start, sp.end)), (arch, k, layers)  # only its own experts
            params = {n for n, _ in stage.named_parameters(remove_duplicate=False)}
            assert params <= stored and params <= set(hf), (arch, k, sorted(params - set(hf))[:4])
            for name in params:  # renamed, merged, concatenated: what from_pretrained built, bit for bit
                assert torch.equal(f.get_tensor(name), hf[name]), (arch, name)
            assert any(n.endswith("experts.gate_up_proj") for n in stored) or k == 0 and sp.end == 1


def test_quantized_checkpoint_is_refused_naming_the_method(tmp_path):
    model = AutoModelForCausalLM.from_config(moe_config("qwen3_moe"))
    model.save_pretrained(tmp_path / "fp8")
    cfg_path = tmp_path / "fp8" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quant_method 'awq' is not supported; ppsplit compile reads block-scaled FP8"):
        compile_model(str(tmp_path / "fp8"), str(tmp_path / "out"), pp=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (dict(num_local_experts=5), r"block_sparse_moe\.gate\.weight has shape \(4, 64\), but model\.layers\.0\.mlp\."
                                r"gate\.weight needs shape \(5, 64\)"),
    (dict(intermediate_size=96), r"conversion of the checkpoint gives shape \(4, 64, 128\) for model\.layers\.0\.mlp"
                                 r"\.experts\.down_proj, the model needs shape \(4, 64, 96\)")])
def test_checkpoint_that_does_not_match_its_config_is_refused(tmp_path, change, message):
    """Tensors of the wrong shape, stored as they are (the router) or merged by transformers (the experts): one line
    naming the tensor, and no output folder."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("mixtral", 2, num_local_experts=4)).save_pretrained(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), **change)))
    with pytest.raises(ConfigError, match=message):
        compile_model(str(tmp_path / "m"), str(tmp_path / "out"), pp=2)
    assert not (tmp_path / "out").exists()


def test_fp32_moe_checkpoint_compiles_with_a_cache_and_decodes(tmp_path_factory):
    """torch's grouped_mm takes only bf16 on the meta device, where the compile traces: an fp32 MoE skeleton traces
    its experts with transformers' batched_mm instead, and the folder decodes like from_pretrained."""
    folder, hf = checkpoint("mixtral", tmp_path_factory)
    out = compile_model(str(folder), str(folder.parent / "out-cache"), pp=2, cache=ppsplit.CacheConfig(2, 32))
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(decode(ppsplit.load(out), ids, 8), expected)


def test_deepseek_v3_folder_pages_its_mla_latents(tmp_path_factory):
    """A DeepSeek-V3 compiled with the default cache (what ``ppsplit compile`` gives) holds a paged cache whose pools
    keep each position's latent and rotary key (not the expanded keys and values), and it generates prompts of
    different lengths like from_pretrained."""
    folder, hf = checkpoint("deepseek_v3", tmp_path_factory)
    out = compile_model(str(folder), str(folder.parent / "out-default"), pp=2, default_cache=True)
    split = ppsplit.load(out)
    assert split.plan.paged, split.plan.lockstep_reason
    widths = {tuple(b.shape[2:]) for stage in split.stages for n, b in stage.named_buffers() if is_cache_buffer(n)}
    assert widths == {(1, hf.config.kv_lora_rank), (1, hf.config.qk_rope_head_dim)}
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (4, 11)]
    for prompt, got in zip(prompts, decode(split, prompts, 8)):
        with torch.no_grad():
            assert torch.equal(got, hf.generate(prompt[None], max_new_tokens=8, do_sample=False)[0])
