"""Ragged steps over the paged cache: one call holds prefill chunks, decode tokens and verify windows of different
sequences, and every token's logits and taps equal Hugging Face run on that sequence alone (fp32, CPU)."""
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import ppsplit
from ppsplit import CacheConfig, ConfigError
from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "llama": {},
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=6),  # sliding window + soft-cap
    "qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "gemma4_text": dict(head_dim=16, global_head_dim=16, sliding_window=6, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=V),  # per-layer inputs carried beside the stream
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2),  # short convolutions
    "qwen3_next": dict(head_dim=16, layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=20,
                        qk_nope_head_dim=12, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),  # MLA latents
    "nemotron_h": dict(head_dim=16, layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=8,
                       mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=16),  # Mamba-2
}
INDEXED = ("deepseek_v32",)  # sparse attention (MLA + DSA): tests.architectures.test_indexer's tie-free model
ARCHS = [a for a in (*CONFIGS, *INDEXED) if a in CONFIG_MAPPING]
CACHE = CacheConfig(batch_size=4, max_len=48, block_size=16)
TAPS = (1, 3)
_built: dict = {}


def build(arch):
    if arch not in _built:
        if arch in INDEXED:
            from tests.architectures.test_indexer import indexed_model

            model = indexed_model(arch)
        else:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**COMMON, **CONFIGS[arch]})).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
        _built[arch] = (model, ppsplit.trace_model(model, cache=CACHE))
    return _built[arch]


def sequences(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {s: torch.randint(3, V, (n,), generator=gen) for s, n in lengths.items()}


def references(model, seqs):
    out = {}
    with torch.no_grad():
        for s, ids in seqs.items():
            o = model(ids[None], output_hidden_states=True)
            out[s] = (o.logits[0], [h[0] for h in o.hidden_states])
    return out


def run(split, seqs, segments, tables, pad=3):
    step = RaggedStep.build(segments, tables, split.layout, pad_to=sum(s.count for s in segments) + pad)
    tokens = torch.zeros(step.num_tokens, dtype=torch.long)
    at = 0
    for s in segments:
        tokens[at:at + s.count] = seqs[s.slot][s.position:s.position + s.count]
        at += s.count
    with torch.no_grad():
        return split.step(tokens, step)


def assert_matches(segments, logits, aux, refs):
    at = 0
    for s in segments:
        ref_logits, hidden = refs[s.slot]
        rows = slice(at, at + s.count)
        where = slice(s.position, s.position + s.count)
        torch.testing.assert_close(logits[rows], ref_logits[where], atol=1e-4, rtol=0)
        for slot, tap in enumerate(TAPS):
            torch.testing.assert_close(aux[slot, rows], hidden[tap][where], atol=1e-4, rtol=0)
        at += s.count


FILL = [Segment(1, 0, 30), Segment(2, 0, 12), Segment(3, 0, 20)]  # the prefixes the mixed call continues
MIXED = [Segment(0, 0, 7), Segment(1, 30, 1), Segment(2, 12, 4), Segment(3, 20, 5)]  # prefill, decode, verify, chunk


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mixed_step_equals_each_sequence_alone(arch):
    model, traced = build(arch)
    seqs = sequences({0: 7, 1: 31, 2: 16, 3: 25})
    refs = references(model, seqs)
    for pp in (1, 2, 3):
        split = ppsplit.split_model(traced, pp, aux=list(TAPS))
        assert split.plan.paged, split.plan.lockstep_reason
        blocks = list(range(split.layout.num_blocks))
        random.Random(pp).shuffle(blocks)  # non-contiguous, shuffled blocks
        tables = {s: blocks[3 * s:3 * s + 3] for s in range(4)}
        for segments in (FILL, MIXED):
            logits, aux = run(split, seqs, segments, tables)
            assert logits.shape == (sum(s.count for s in segments) + 3, V) and aux.shape[:2] == (2, logits.shape[0])
            assert_matches(segments, logits, aux, refs)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma4_text"])
def test_rope_write_folds_each_layers_rotations_and_writes_and_changes_nothing(arch):
    """``fuse_pointwise`` on a paged split folds each layer's query and key rotations and its key and value writes
    into one ``ppsplit::rope_write`` (CUDA stages do by default; forced here on the CPU, its torch path): the mixed
    step's logits and taps equal the split without it bit for bit, and Hugging Face's. Gemma-4 rotates
    ``[1, N, H, D]`` before moving the heads forward, with a ``cos`` unsqueezed apart for the query and the keys."""
    model, traced = build(arch)
    seqs = sequences({0: 7, 1: 31, 2: 16, 3: 25})
    tables = {s: list(range(3 * s, 3 * s + 3)) for s in range(4)}
    fused = ppsplit.split_model(traced, 2, aux=list(TAPS), fuse_pointwise=True)
    plain = ppsplit.split_model(traced, 2, aux=list(TAPS), fuse_pointwise=False)
    assert [stage.meta["ppsplit.pointwise"]["rope_write"] for stage in fused.stages] == [2, 2]
    assert [stage.meta["ppsplit.pointwise"]["rope"] for stage in fused.stages] == [0, 0]
    targets = {n.target for stage in fused.stages for n in stage.graph.nodes}
    assert torch.ops.ppsplit.rope_write.default in targets
    assert not targets & {torch.ops.ppsplit.paged_write_pair.default, torch.ops.ppsplit.rope.default}
    for segments in (FILL, MIXED):
        (a, a_aux), (b, b_aux) = run(fused, seqs, segments, tables), run(plain, seqs, segments, tables)
        assert torch.equal(a, b) and torch.equal(a_aux, b_aux)
    assert_matches(MIXED, a, a_aux, references(model, seqs))


@pytest.mark.parametrize("arch", [a for a in ("llama", "qwen3_next", "deepseek_v3", "deepseek_v32") if a in ARCHS])
def test_a_reused_slot_and_reused_blocks_read_nothing_stale(arch):
    """A slot freed and given to a new sequence, with blocks another sequence used: the new sequence's tokens equal a
    fresh run (its keys, ring states and convolution inputs are overwritten before they are read)."""
    model, traced = build(arch)
    split = ppsplit.split_model(traced, 2, aux=list(TAPS))
    old = sequences({0: 40, 1: 20}, seed=3)
    run(split, old, [Segment(0, 0, 40), Segment(1, 0, 20)], {0: [0, 1, 2], 1: [3, 4]})
    # Slot 0's sequence ends; a new one takes slot 0 and two of its blocks, in another order, while slot 1 goes on.
    seqs = {0: sequences({0: 9}, seed=4)[0], 1: torch.cat([old[1], torch.tensor([7])])}
    refs = references(model, seqs)
    segments = [Segment(0, 0, 9), Segment(1, 20, 1)]
    logits, aux = run(split, seqs, segments, {0: [2, 0], 1: [3, 4]})
    assert_matches(segments, logits, aux, refs)


def test_lockstep_calls_and_equal_length_generate_still_work():
    model, traced = build("llama")
    split = ppsplit.split_model(traced, 2, aux=list(TAPS))
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    logits, aux = split(ids)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(aux[0], ref.hidden_states[TAPS[0]], atol=1e-4, rtol=0)
    assert torch.equal(split.generate(ids, 8), model.generate(ids, max_new_tokens=8, do_sample=False))


@pytest.mark.parametrize("arch", [a for a in ("qwen3", "deepseek_v3") if a in ARCHS])
def test_prompts_of_different_lengths_generate_like_each_alone(arch):
    model, traced = build(arch)
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(4, 64, num_blocks=12)), 2)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, V, (n,), generator=gen) for n in (3, 10, 17, 24, 33, 40)]
    outs = split.generate(prompts, 12)
    for prompt, out in zip(prompts, outs):
        assert torch.equal(out, model.generate(prompt[None], max_new_tokens=12, do_sample=False)[0])


@pytest.mark.parametrize("arch", [a for a in ("deepseek_v3", "deepseek_v32") if a in ARCHS])
def test_mla_pages_its_latents_not_expanded_keys(arch):
    """DeepSeek-V3 and V3.2: each layer's pools hold the latent (kv_lora_rank) and the rotary key (qk_rope_head_dim)
    of every position, one head (V3.2: and its indexer's key), and the plan's cache bytes are those pools; the
    attention reads them as ``paged_latent_attention`` (V3.2: over the positions ``paged_indexer_topk`` picks), and
    no projection reads the cache (no key or value is expanded)."""
    model, traced = build(arch)
    cfg = model.config
    split = ppsplit.split_model(traced, 2)
    layout = split.layout
    widths = {"keys": (1, cfg.kv_lora_rank), "values": (1, cfg.qk_rope_head_dim)}
    ops = torch.ops.ppsplit
    readers = {ops.paged_write_pair.default, ops.paged_latent_attention.default}
    if arch == "deepseek_v32":
        widths["indexer_keys"] = (cfg.index_head_dim,)
        readers |= {ops.paged_indexer_topk.default, ops.paged_write.default}  # the indexer's keys: a write alone
    for k, stage in enumerate(split.stages):
        pools = {n: b for n, b in stage.named_buffers() if n.startswith("kv_cache.")}
        layers = range(split.plan.stages[k].start, split.plan.stages[k].end)
        assert {n: tuple(b.shape) for n, b in pools.items()} == {
            f"kv_cache.{i}.{kind}": (layout.num_blocks, layout.block_size, *width)
            for i in layers for kind, width in widths.items()}
        assert split.plan.stages[k].cache_bytes == sum(b.numel() * b.element_size() for b in pools.values())
        nodes = list(stage.graph.nodes)
        assert sum(n.target is ops.paged_latent_attention.default for n in nodes) == len(layers)
        assert {u.target for n in nodes if n.op == "get_attr" and n.target in pools for u in n.users} == readers
        assert not any(n.target is torch.ops.aten.topk.default and n.meta.get("ppsplit.layer") in layers
                       and "indexer" in str(n.meta.get("nn_module_stack")) for n in nodes)
        assert split.plan.attention_lines(k)[0].startswith(f"attention: {len(layers)} of {len(layers)} -> paged")
    assert f"MLA: latent {cfg.kv_lora_rank} + rotary {cfg.qk_rope_head_dim} per position" in split.plan.describe()


def test_bad_metadata_is_refused_before_anything_runs():
    _, traced = build("llama")
    split = ppsplit.split_model(traced, 1)
    layout = split.layout
    before = [b.clone() for n, b in split.stages[0].named_buffers() if n.startswith("kv_cache.")]
    cases = [
        ([Segment(0, 40, 10)], {0: [0, 1, 2]}, None, "do not fit a sequence of the cache"),
        ([Segment(0, 20, 1)], {0: [0]}, None, "lies past the blocks its block table assigns"),
        ([Segment(1, 0, 2)], {0: [0]}, None, "lies past the blocks"),  # a slot without blocks
        ([Segment(0, 0, 2), Segment(0, 2, 1)], {0: [0]}, None, "appears twice in one step"),  # two writes, one slot
        ([Segment(0, 0, 2), Segment(1, 0, 2)], {0: [3], 1: [3]}, None, "block 3 is owned by sequence slots 0 and 1"),
        ([Segment(0, 0, 9)], {0: [0]}, 8, "more than its bucket of 8"),
        ([Segment(5, 0, 1)], {0: [0]}, None, "sequence slot 5 does not exist"),
        ([Segment(0, 0, 1)], {0: [layout.num_blocks]}, None, f"block {layout.num_blocks} does not exist"),
    ]
    for segments, tables, pad, message in cases:
        with pytest.raises(ConfigError, match=message):
            RaggedStep.build(segments, tables, layout, pad_to=pad)
    after = [b for n, b in split.stages[0].named_buffers() if n.startswith("kv_cache.")]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing half-written
    step = RaggedStep.build([Segment(0, 0, 2)], {0: [0]}, layout)
    with pytest.raises(ConfigError, match="takes ids \\[2\\]"):
        split.step(torch.zeros(3, dtype=torch.long), step)


def test_models_whose_cache_cannot_be_paged_keep_a_lockstep_cache_and_say_why():
    """HY-V4 (MLA whose attention adds learned sinks, which ``latent_attention`` does not have): the paged pass does
    not serve it, so the split keeps a lockstep cache, the plan says why, its forward equals Hugging Face's, and
    generation (the engine) and ragged steps are refused with the reason."""
    from tests.architectures.test_streams import IDS, build as build_streamed

    model = build_streamed("hy_v4")
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(2, 32)), 2)
    assert not split.plan.paged and "layer 0's attention stays as traced" in split.plan.lockstep_reason
    assert "its cache holds MLA latents, but no scale/window/soft-cap makes latent_attention equal it" \
        in split.plan.lockstep_reason
    assert "lockstep: no ragged steps" in split.plan.describe()
    with torch.no_grad():
        torch.testing.assert_close(split(IDS)[0], model(IDS).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="needs a paged cache, and this split keeps a lockstep one because layer 0"):
        split.generate(IDS, 6)
    with pytest.raises(ConfigError, match="ragged steps need a paged cache; this split keeps a lockstep cache"):
        split.step(torch.zeros(1, dtype=torch.long), None)
