"""Decoders whose attention needed more than the common form to be served from the paged cache: each one's split is
paged (no lockstep cache), a mixed ragged step equals Hugging Face on every sequence alone, and requests arriving at
different steps through the engine each give Hugging Face's greedy output (fp32, CPU, pp 1 and 2).

- Llama 4: chunked attention (each token over the keys of its own chunk) and, on its NoPE layers, an attention
  temperature computed from each token's own position (the model adds ``0 .. T-1`` to the first position).
- Granite-SWA, GraniteMoE-SWA: sinks applied after the attention's product (its output scaled by
  ``sigmoid(logsumexp - sink)``), so the attention ends at that scaling, not at the product.
- DiffLlama: ``softmax(q k) v1`` and ``softmax(q k) v2`` (``v1``, ``v2`` halves of the value heads, repeated)
  concatenated are one attention over ``[v1; v2]``, which the cache holds instead of ``v``.
- Doge: its dynamic mask adds a bias per KV head and key computed from the key's value; as ``scale * [q, 1] .
  [k, bias / scale]`` that is an attention over keys one dimension wider, which the cache holds instead of ``k``.
- JetMoe: K and V repeated whole for its mixture of attention heads (``repeat``, not ``repeat_interleave``), so
  the query heads are reordered around the attention.
- Gemma 3n, Gemma 4 with KV sharing: the last layers attend over the keys and values of an earlier layer, so they read
  its pools through the same block table (a later stage keeps a replica of those pools, written from the carried new
  keys and values).
- GLM-MoE-DSA with shared indexers: a "shared" layer's sparse attention reads the positions the indexer of the layer
  before picked (positions of the token's own sequence, so the same ones index the shared layer's own pools).
"""
import random

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import ppsplit
from ppsplit import CacheConfig
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from ppsplit.core.tensors import stream_rows
from tests.serve.test_ragged import FILL, MIXED, TAPS, run, sequences
from tests.support import decode, random_model

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    # chunks of 8 positions on layers 0-2; layer 3 NoPE with a temperature that changes every 4 positions
    "llama4_text": dict(head_dim=16, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                        attention_chunk_size=8, floor_scale=4, attn_scale=0.5, no_rope_layers=[1, 1, 1, 0],
                        layer_types=["chunked_attention"] * 3 + ["full_attention"], moe_layers=[1, 3]),
    # sliding windows of 6 on layers 0 and 2, sinks applied as a sigmoid of the log-sum-exp after the product
    "granite_swa": dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
                        attention_multiplier=0.3, residual_multiplier=0.7),
    "granitemoe_swa": dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
                           num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.3),
    # differential attention: two attentions over the same keys, each over half the value heads, concatenated
    "diffllama": {},
    # a bias per key from its value (exp(A * softplus(dt_proj(v)))) added to the scores
    "doge": {},
    # attention heads from a mixture of experts, K and V repeated whole (query head h reads KV head h % 2)
    "jetmoe": dict(kv_channels=16, num_local_experts=4, num_experts_per_tok=2),
    # KV sharing: layers 2 and 3 attend over the keys and values of layers 0 (sliding) and 1 (full)
    "gemma3n_text": dict(vocab_size_per_layer_input=V, head_dim=16, hidden_size_per_layer_input=8, laurel_rank=8,
                         sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
                         activation_sparsity_pattern=[0.0] * 4, num_kv_shared_layers=2),
    "gemma4_text": dict(head_dim=16, global_head_dim=16, sliding_window=6, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=V, layer_types=["sliding_attention", "full_attention"] * 2,
                        num_kv_shared_layers=2),
}
# Sparse attention (MLA + DSA) whose "shared" layers attend over the positions the layer before picked:
# tests.architectures.test_indexer's tie-free model.
INDEXED = {"glm_moe_dsa_shared": "glm_moe_dsa"}
# What the plan says of each model's attention (every layer paged).
DETAILS = {"llama4_text": "chunks of 8", "granite_swa": "scale 0.3, window 6, sinks",
           "granitemoe_swa": "scale 0.3, window 6, sinks", "jetmoe": "query head h on KV head h % kv_heads",
           "gemma3n_text": "over the keys and values of layer 1", "gemma4_text": "over the keys and values of layer 1",
           "glm_moe_dsa_shared": "sparse over 4 positions layer 0's indexer picks",
           "diffllama": "values joined from 2 parts", "doge": "a per-key bias from its values in the keys"}
ARCHS = [a for a in CONFIGS if a in CONFIG_MAPPING] + [a for a, base in INDEXED.items() if base in CONFIG_MAPPING]
CACHE = CacheConfig(batch_size=4, max_len=64, block_size=16, num_blocks=14)
_built: dict = {}

pytestmark = pytest.mark.usefixtures("one_thread")


def build(arch):
    if arch not in _built:
        if arch in INDEXED:
            from tests.architectures.test_indexer import indexed_model

            model = indexed_model(arch)
        else:
            model = random_model({"model_type": arch, **COMMON, **CONFIGS[arch]})
        if arch == "doge":  # A starts at zero: a bias that barely varies between keys would prove little
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.A.copy_(torch.randn(layer.self_attn.A.shape, generator=torch.Generator()
                                                        .manual_seed(layer.self_attn.layer_idx)) * 2)
        _built[arch] = model, ppsplit.trace_model(model, cache=CACHE)
    return _built[arch]


def references(model, seqs):
    with torch.no_grad():
        return {s: model(ids[None], output_hidden_states=True) for s, ids in seqs.items()}


def assert_matches(plan, segments, logits, aux, refs):
    at = 0
    for s in segments:
        rows, where = slice(at, at + s.count), slice(s.position, s.position + s.count)
        torch.testing.assert_close(logits[rows], refs[s.slot].logits[0, where], atol=1e-4, rtol=0)
        for slot, tap in enumerate(TAPS):
            want = stream_rows(plan, refs[s.slot].hidden_states[tap])[0, where]
            torch.testing.assert_close(aux[slot, rows], want, atol=1e-4, rtol=0)
        at += s.count


def hf(model, prompt, params: SamplingParams):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_split_is_paged_and_a_mixed_step_equals_each_sequence_alone(arch):
    model, traced = build(arch)
    seqs = sequences({0: 7, 1: 31, 2: 16, 3: 25})
    refs = references(model, seqs)
    for pp in (1, 2):
        split = ppsplit.split_model(traced, pp, aux=list(TAPS))
        assert split.plan.paged, split.plan.lockstep_reason
        for k in range(pp):
            layers = split.plan.stages[k].end - split.plan.stages[k].start
            assert split.plan.attention_lines(k)[0].startswith(f"attention: {layers} of {layers} -> paged_attention")
        assert DETAILS[arch] in split.plan.describe()
        blocks = list(range(split.layout.num_blocks))
        random.Random(pp).shuffle(blocks)
        tables = {s: blocks[3 * s:3 * s + 3] for s in range(4)}
        for segments in (FILL, MIXED):
            logits, aux = run(split, seqs, segments, tables)
            assert_matches(split.plan, segments, logits, aux, refs)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_requests_arriving_at_different_steps_each_equal_hf_alone(arch, pp):
    model, traced = build(arch)
    engine = Engine(ppsplit.split_model(traced, pp), max_num_batched_tokens=24)
    rng = random.Random(pp)
    lengths = (3, 29, 11, 20, 6, 40)  # prompts of different lengths, across chunk and block boundaries
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 8, 10, 6, 9, 11)]
    outputs, ids, step = {}, {}, 0
    while len(outputs) < len(prompts):
        for i in (2 * step, 2 * step + 1):  # two new requests every step
            if i < len(prompts):
                ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            if out.finished:
                outputs[ids[out.request_id]] = out
        step += 1
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        assert outputs[i].token_ids == hf(model, prompt, p), i
    assert engine.blocks_in_use == 0


@pytest.mark.parametrize("arch", [a for a in ("gemma3n_text", "gemma4_text") if a in ARCHS])
def test_kv_sharing_layers_read_the_owners_pools(arch):
    """The layers that share another layer's keys and values hold no pools of their own: their ``paged_attention``
    reads the owner's. On a later stage the owner's pools are replicas (counted in the plan at their pooled size),
    written by that stage from the carried new keys and values."""
    _, traced = build(arch)
    ops = torch.ops.ppsplit
    for pp in (1, 2):
        split = ppsplit.split_model(traced, pp)
        read = set()
        for stage in split.stages:
            for node in stage.graph.nodes:
                if node.target is ops.paged_attention.default and node.meta.get("ppsplit.layer") in (2, 3):
                    read.add((node.meta["ppsplit.layer"], node.args[1].target, node.args[2].target))
        assert read == {(2, "kv_cache.0.keys", "kv_cache.0.values"), (3, "kv_cache.1.keys", "kv_cache.1.values")}
        pools = [{n: b.numel() * b.element_size() for n, b in stage.named_buffers() if n.startswith("kv_cache.")}
                 for stage in split.stages]
        assert not any(n.startswith(("kv_cache.2.", "kv_cache.3.")) for p in pools for n in p)
        if pp == 2:
            assert sorted((s, n) for s, n, _ in split.plan.replicas) == [(1, f"kv_cache.{i}.{kind}")
                                                                        for i in (0, 1) for kind in ("keys", "values")]
            assert all(size == pools[1][n] for _, n, size in split.plan.replicas)


@pytest.mark.skipif("doge" not in CONFIG_MAPPING, reason="this transformers has no doge")
def test_doge_past_its_keep_window_keeps_a_lockstep_cache_equal_to_hf():
    """With a cache longer than ``keep_window_size``, Doge's mask keeps only each query's top keys (a top-k over the
    whole cache), which no paged attention computes: the stand-in cache is traced that long, so the top-k shows and
    the split stays lockstep, saying why (generation refuses it); its forward steps' greedy tokens past the window still
    equal Hugging Face's."""
    model = random_model({"model_type": "doge", **COMMON, "keep_window_size": 16})
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.copy_(torch.randn(layer.self_attn.A.shape, generator=torch.Generator().manual_seed(3)))
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CACHE), 2)
    assert not split.plan.paged and "layer 0's attention stays as traced" in split.plan.lockstep_reason
    ids = torch.randint(3, V, (1, 20), generator=torch.Generator().manual_seed(0))
    assert torch.equal(decode(split, ids, 12), model.generate(ids, max_new_tokens=12, do_sample=False))


def test_joined_values_and_key_biases_widen_the_pools():
    """DiffLlama's value pools hold both halves' values per KV head (twice the head dim); Doge's key pools one more
    dimension (the bias over the scale)."""
    for arch, kind, width in (("diffllama", "values", 32), ("doge", "keys", 17)):
        if arch not in ARCHS:
            continue
        _, traced = build(arch)
        split = ppsplit.split_model(traced, 1)
        pools = {n: tuple(b.shape) for n, b in split.stages[0].named_buffers() if n.startswith("kv_cache.")}
        layout = split.layout
        assert pools[f"kv_cache.0.{kind}"] == (layout.num_blocks, layout.block_size, 2, width), pools
        other = "keys" if kind == "values" else "values"
        assert pools[f"kv_cache.0.{other}"] == (layout.num_blocks, layout.block_size, 2, 16), pools
