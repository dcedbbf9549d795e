"""Residual streams of several hidden vectors per token: Gemma 3n's AltUp stack ``[4, B, T, H]`` and a
hyper-connection stream ``[B, T, 4, H]`` (HY-V4) cross each stage boundary token-major in ``x`` and fill the aux
slots the same way (``plan.stream``). Oracle: the unsplit Hugging Face model (logits, ``output_hidden_states``,
greedy ``generate``)."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING

import ppsplit
from ppsplit import CacheConfig
from ppsplit.core.errors import CrossingError
from ppsplit.core.plan import Stream
from ppsplit.core.ragged import RaggedStep, Segment
from ppsplit.core.tensors import stream_rows
from tests.support import decode

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, num_hidden_layers=4, num_attention_heads=4)
GEMMA3N = dict(vocab_size_per_layer_input=V, intermediate_size=128, num_key_value_heads=2, head_dim=16,
               hidden_size_per_layer_input=8, laurel_rank=8, sliding_window=6,
               layer_types=["sliding_attention", "full_attention"] * 2,
               activation_sparsity_pattern=[0.0] * 4)  # >0 makes a traced constant the compile step cannot place yet
CONFIGS = {
    "gemma3n_text": dict(GEMMA3N, num_kv_shared_layers=2),  # the last two layers read the first two's KV
    "gemma3n_unshared": dict(GEMMA3N, num_kv_shared_layers=0),  # no KV sharing: the cache can be paged
    "hy_v4": dict(intermediate_size=128, moe_intermediate_size=64, num_key_value_heads=4, n_routed_experts=4,
                  n_shared_experts=1, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=16, index_head_dim=16, index_n_heads=4,
                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                  indexer_types=["full", "shared"] * 2),  # a shared layer reads the top-k of the layer before
}
STREAMS = {"gemma3n_text": Stream((4, 64), batch_dim=1, token_dim=2), "hy_v4": Stream((4, 64), 0, 1)}
IDS = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(1))
_models: dict = {}


def build(name: str):
    arch = "gemma3n_text" if name.startswith("gemma3n") else name
    if arch not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {arch}")
    if name not in _models:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **COMMON, **CONFIGS[name])).eval()
        with torch.no_grad():  # random weights large enough that greedy tokens vary
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        _models[name] = model
    return _models[name]


def greedy(name: str, new: int = 10) -> torch.Tensor:
    with torch.no_grad():
        out = build(name).generate(IDS, max_new_tokens=new, do_sample=False)
    assert len(set(out[:, 6:].flatten().tolist())) > 4, "degenerate reference: retune the weights"
    return out


def check_split(split, model, taps):
    """Logits and every tap equal Hugging Face's, the taps as ``output_hidden_states`` reports the stream."""
    with torch.no_grad():
        ref = model(IDS, output_hidden_states=True)
        logits, aux = split(IDS)
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
    assert aux.shape == (len(taps), 2, 6, 256)
    for slot, tap in enumerate(taps):
        torch.testing.assert_close(aux[slot], stream_rows(split.plan, ref.hidden_states[tap]), atol=1e-5, rtol=0)


_uncached: dict = {}


@pytest.mark.parametrize("pp", [2, 3])
def test_gemma3n_altup_stack_splits_with_taps_equal_to_hf(pp):
    model = build("gemma3n_text")
    if "gemma3n_text" not in _uncached:
        _uncached["gemma3n_text"] = ppsplit.trace_model(model)
    traced = _uncached["gemma3n_text"]
    split = ppsplit.split_model(traced, pp, aux=[1, 2, 3])
    plan = split.plan
    assert plan.stream == STREAMS["gemma3n_text"] and plan.hidden_size == 4 * 64 and plan.vector_size == 64
    assert "stream [4, B, T, 64]" in plan.describe()
    # Each boundary sends the stack token-major plus the carried per-layer inputs and shared keys / values.
    x = IDS
    for k, stage in enumerate(split.stages[:-1]):
        x, _ = stage(x, torch.arange(6), split.new_aux(2, 6))
        assert x.shape == (2, 6, plan.width(k + 1)) and plan.width(k + 1) > 256
    check_split(split, model, [1, 2, 3])
    assert ppsplit.SplitPlan.from_json(plan.to_json()) == plan


def test_hyper_connection_stream_splits_and_decodes_like_hf():
    """HY-V4 keeps four streams per token ``[B, T, 4, H]``. A cut before a layer whose sparse indexer shares the
    previous layer's top-k indices would carry them, ``[B, T, min(index_topk, T)]`` wide without a cache: refused,
    naming them."""
    model = build("hy_v4")
    traced = ppsplit.trace_model(model)
    split = ppsplit.split_model(traced, 2, aux=[1, 2, 3])
    assert split.plan.stream == STREAMS["hy_v4"]
    check_split(split, model, [1, 2, 3])
    with pytest.raises(CrossingError, match=r"per-token shape \[Min\(2048, s\d+\)\] is not fixed"):
        ppsplit.split_model(traced, 3, balance=[1, 1, 2])
    cached = ppsplit.split_model(model, 2, cache=CacheConfig(2, 32))
    assert torch.equal(decode(cached, IDS, 10), greedy("hy_v4"))


_cached: dict = {}


def cached(name: str):
    if name not in _cached:
        _cached[name] = ppsplit.trace_model(build(name), cache=CacheConfig(2, 32))
    return _cached[name]


@pytest.mark.parametrize("pp", [2, 3])
def test_gemma3n_cached_greedy_decoding_equals_hf(pp):
    split = ppsplit.split_model(cached("gemma3n_text"), pp)
    assert torch.equal(decode(split, IDS, 10), greedy("gemma3n_text"))


def test_gemma3n_verify_pass_with_rejected_drafts_then_decoding_equals_hf():
    from tests.support import decode_through_rejected_drafts

    split = ppsplit.split_model(cached("gemma3n_text"), 2)
    want = greedy("gemma3n_text")[:, 6:]
    assert torch.equal(decode_through_rejected_drafts(split, IDS, want), want)


def test_gemma3n_compiles_to_a_folder_that_loads_and_decodes_like_hf(tmp_path):
    build("gemma3n_text").save_pretrained(tmp_path / "ckpt")
    folder = ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "pp2"), pp=2, aux=[1, 3],
                                   cache=CacheConfig(2, 32))
    loaded = ppsplit.load(folder)
    assert loaded.plan.stream == STREAMS["gemma3n_text"]
    assert torch.equal(decode(loaded, IDS, 10), greedy("gemma3n_text"))


def test_gemma3n_ragged_step_over_the_paged_cache_equals_each_sequence_alone():
    """Prefill chunks, a decode token and a verify window of three sequences in one ragged step: the stack travels
    as ``[N, 4 * H]`` rows, and every token's logits and taps equal Hugging Face run on its sequence alone."""
    model = build("gemma3n_unshared")
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(4, 48, block_size=16)), 2, aux=[1, 3])
    assert split.plan.paged, split.plan.lockstep_reason
    seqs = {s: torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(s)) for s, n in
            ((0, 7), (1, 21), (2, 16))}
    tables = {0: [5, 0], 1: [3, 1], 2: [2, 4]}
    with torch.no_grad():
        refs = {s: model(ids[None], output_hidden_states=True) for s, ids in seqs.items()}
        for segments in ([Segment(1, 0, 20), Segment(2, 0, 12)], [Segment(0, 0, 7), Segment(1, 20, 1),
                                                                   Segment(2, 12, 4)]):
            step = RaggedStep.build(segments, tables, split.layout, pad_to=sum(s.count for s in segments) + 2)
            tokens = torch.cat([seqs[s.slot][s.position:s.position + s.count] for s in segments]
                               + [torch.zeros(2, dtype=torch.long)])
            logits, aux = split.step(tokens, step)
            at = 0
            for s in segments:
                rows, where = slice(at, at + s.count), slice(s.position, s.position + s.count)
                torch.testing.assert_close(logits[rows], refs[s.slot].logits[0, where], atol=1e-4, rtol=0)
                for slot, tap in enumerate([1, 3]):
                    want = stream_rows(split.plan, refs[s.slot].hidden_states[tap])
                    torch.testing.assert_close(aux[slot, rows], want[0, where], atol=1e-4, rtol=0)
                at += s.count
