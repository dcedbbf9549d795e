"""Half layers: stage boundaries between a decoder layer's attention block and its MLP block.

Against the unsplit Hugging Face model (logits, every tap, cached greedy decoding), the structure (what crosses a
mid-layer boundary, which stage holds which weights and KV cache), the exact min-max split over half units (against
brute force), and the default staying whole-layer."""
import itertools
import json
import random

import pytest
import torch

import ppsplit
from ppsplit import CacheConfig, ConfigError, ModelCosts, RegionCosts, SplitPlan
from ppsplit.passes.planning.balance import best_bounds
from ppsplit.passes.planning.half_plan import allowed_cuts
from ppsplit.passes.plan import make_plan
from tests.support import NUM_LAYERS as L, VOCAB, traced_with_cache
from tests.support import last_layer_output, reference, run_stages

CACHE = CacheConfig(batch_size=2, max_len=32)
def cached(arch):
    return traced_with_cache(arch, CACHE)


@pytest.mark.parametrize("arch,counts", [("llama", [2.5, 2.5]), ("llama", [1.5, 2, 1.5]), ("gemma2", [0.5, 3, 1.5]),
                                         ("qwen2", [3.5, 1.5])])
def test_mid_layer_split_matches_hf(traced_cache, arch, counts):
    model, traced = traced_cache(arch)
    assert sorted(traced.mids) == list(range(L))  # every layer of these models has the point
    taps = list(range(L + 1))
    split = ppsplit.split_model(traced, len(counts), aux=taps, balance=counts, half_layers=True)
    plan = split.plan
    assert plan.sizes == tuple(counts) and plan.half_layers
    torch.manual_seed(len(counts))
    for batch, tokens in ((2, 7), (1, 1)):
        ids = torch.randint(3, VOCAB, (batch, tokens))
        ref_logits, ref_hidden = reference(model, ids)
        with torch.no_grad():
            logits, aux, inputs = run_stages(split, ids, torch.arange(tokens))  # also: each stage fills its prefix
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        for slot, tap in enumerate(plan.taps):
            expected = last_layer_output(model, ids) if tap == L else ref_hidden[tap]
            torch.testing.assert_close(aux[slot], expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"tap {tap}: {m}")
        for k, x in enumerate(inputs[1:], start=1):
            if plan.starts_mid(k):  # only the residual stream after the attention block crosses: [B, T, H]
                assert x.shape == (batch, tokens, plan.hidden_size) and not plan.carries
            else:
                torch.testing.assert_close(x, ref_hidden[plan.stages[k].start], atol=1e-5, rtol=1e-5)
    # Tap j belongs to the stage that computes the end of layer j - 1, even when that stage ends mid-layer.
    for tap in taps[1:]:
        assert plan.owner(tap) == next(s.index for s in plan.stages if s.start < tap <= s.end)
    # Each stage holds the weights of the halves it runs: the attention projections before the cut, the MLP after.
    fqn = traced.layers.fqn
    for k in range(1, plan.pp):
        if plan.starts_mid(k):
            j = plan.stages[k].start
            before, after = (dict(split.stages[i].named_parameters()) for i in (k - 1, k))
            assert any(n.startswith(f"{fqn}.{j}.self_attn.") for n in before)
            assert not any(n.startswith(f"{fqn}.{j}.self_attn.") for n in after)
            assert any(n.startswith(f"{fqn}.{j}.mlp.") for n in after)
            assert not any(n.startswith(f"{fqn}.{j}.mlp.") for n in before)


@pytest.mark.parametrize("arch,counts", [("llama", [1.5, 2, 1.5]), ("gemma2", [2.5, 2.5])])
def test_cached_greedy_generate_matches_hf(arch, counts):
    model, traced = cached(arch)
    split = ppsplit.split_model(traced, len(counts), aux=[1, 3], balance=counts, half_layers=True)
    # The KV cache of a cut layer lives with its attention half.
    for k in range(1, split.plan.pp):
        if split.plan.starts_mid(k):
            j = split.plan.stages[k].start
            assert any(f"kv_cache.{j}." in n for n, _ in split.stages[k - 1].named_buffers())
            assert not any(f"kv_cache.{j}." in n for n, _ in split.stages[k].named_buffers())
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(split.generate(ids, 12), expected)


def test_default_stays_whole_layer_and_old_plans_load(traced_cache):
    _, traced = traced_cache("llama")
    whole = ppsplit.split_model(traced, 4, fuse=False)
    assert not whole.plan.half_layers and [s.num_layers for s in whole.plan.stages] == [1, 1, 2, 1]
    text = whole.plan.to_json()
    data = json.loads(text)  # written as before half layers existed (but for the version)
    assert "half_end" not in text and "mid_layers" not in text and "attention" not in data["region_costs"]
    again = SplitPlan.from_json(text)
    assert again == whole.plan
    halves = ppsplit.split_model(traced, 4, fuse=False, half_layers=True)
    assert halves.plan.sizes == (1, 1.5, 1.5, 1) and halves.plan.half_layers
    assert SplitPlan.from_json(halves.plan.to_json()) == halves.plan
    old = json.loads(text)
    old["version"] = 3  # a plan written before half layers existed
    assert SplitPlan.from_dict(old).stages == whole.plan.stages


def test_parallel_blocks_offer_no_mid_point(traced_cache):
    """GPT-NeoX runs attention and MLP side by side on the same input: no point where one value crosses."""
    _, traced = traced_cache("gpt_neox")
    assert traced.mids == {}
    split = ppsplit.split_model(traced, 2, half_layers=True, fuse=False)
    assert not split.plan.half_layers
    costs = ModelCosts(embed_params=1, head_params=1, layer_params=(10,) * L, mid_layers=(0, 1, 3, 4))
    with pytest.raises(ConfigError, match="cut decoder layer 2 in the middle, but that layer has no point"):
        make_plan(costs, 2, balance=[2.5, 2.5], half_layers=True)


def test_min_max_over_half_units_is_optimal_against_brute_force():
    rng = random.Random(1)
    checked = 0
    for _ in range(200):
        n = rng.randint(1, 5)
        mids = tuple(j for j in range(n) if rng.random() < 0.7)
        cuts = allowed_cuts(ModelCosts(embed_params=0, head_params=0, layer_params=(0,) * n, mid_layers=mids))
        pp = rng.randint(1, len(cuts) - 1)
        layers = tuple(float(rng.randint(2, 20)) for _ in range(n))
        cost = RegionCosts(layers=layers, attention=tuple(float(rng.randint(1, int(c) - 1)) for c in layers),
                           embed=float(rng.randint(0, 20)), head=float(rng.randint(0, 30)),
                           stage=float(rng.randint(0, 3)))
        memory = RegionCosts(layers=tuple(float(rng.randint(2, 10)) for _ in range(n)),
                             attention=tuple(1.0 for _ in range(n)), embed=float(rng.randint(0, 9)),
                             head=float(rng.randint(0, 9)))
        cap = rng.choice([None, float(rng.randint(4, 30))])
        splits = [[0, *inner, 2 * n] for inner in itertools.combinations(cuts[1:-1], pp - 1)]
        feasible = [b for b in splits if cap is None or max(memory.span_costs(b)) <= cap]
        got = best_bounds(cost, pp, cuts, memory=memory, cap=cap)
        if not feasible:
            assert got is None
            continue
        assert got in splits
        assert cap is None or max(memory.span_costs(got)) <= cap
        best = min(max(cost.span_costs(b)) for b in feasible)
        assert max(cost.span_costs(got)) == best
        even = min(sum(c * c for c in cost.span_costs(b)) for b in feasible if max(cost.span_costs(b)) == best)
        assert sum(c * c for c in cost.span_costs(got)) == even
        checked += 1
    assert checked > 100


def test_halves_reach_what_whole_layers_cannot():
    """Eight layers and a head of two layers over four stages (mean 2.5 layers each): the best whole-layer split
    has a stage of 3 layers, 20% over the mean; half layers come within 4%."""
    n = 8
    costs = ModelCosts(embed_params=0, head_params=200, layer_params=(100,) * n, mid_layers=tuple(range(n)),
                       attn_params=(40,) * n)
    whole = make_plan(costs, 4, balance="params")
    halves = make_plan(costs, 4, balance="params", half_layers=True)
    assert whole.imbalance == pytest.approx(300 / 250)
    assert halves.imbalance == pytest.approx(1.0, abs=0.05) and halves.half_layers
    assert [s.cost for s in halves.stages] == [s.params for s in halves.stages]  # per-half params are what it holds
    assert sum(s.params for s in halves.stages) == sum(costs.layer_params) + costs.head_params


def test_flops_and_time_per_half(traced_cache):
    from ppsplit.passes.planning.costs import count_flops

    model, traced = traced_cache("llama")
    step = count_flops(traced).step(1, 1, 100, halves=True)
    H, I, KV, D, HEADS = 64, 128, 2, 16, 4
    attention = 2 * (H * H * 2 + H * KV * D * 2 + 2 * HEADS * D * 101)  # q, o, k, v and the scores over 101 keys
    assert step.attention[0] == pytest.approx(attention, rel=1e-12)
    assert step.layers[0] - step.attention[0] == pytest.approx(2 * 3 * H * I, rel=1e-12)  # gate, up, down
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        split = ppsplit.split_model(traced, 3, balance="time", fuse=False, half_layers=True)
    finally:
        torch.set_num_threads(threads)
    region = split.plan.region_costs
    assert region.unit == "ms" and len(region.attention) == L
    assert all(0 <= a <= c for a, c in zip(region.attention, region.layers))
    assert max(region.span_costs(split.plan.bounds)) == min(
        max(region.span_costs([0, *b, 2 * L])) for b in itertools.combinations(range(1, 2 * L), 2))
    ids = torch.randint(3, VOCAB, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], reference(model, ids)[0], atol=1e-5, rtol=1e-5)


def test_caps_explicit_counts_and_cli():
    n = 6
    costs = ModelCosts(embed_params=50, head_params=50, layer_params=(100,) * n, embed_bytes=100, head_bytes=100,
                       layer_bytes=(200,) * n, layer_cache_bytes=(40,) * n, mid_layers=tuple(range(n)),
                       attn_params=(30,) * n, attn_bytes=(60,) * n)
    # Memory per half: attention 60 + 40 (its KV cache), MLP 140; the cap holds on every stage, counted that way.
    capped = make_plan(costs, 3, balance="params", half_layers=True, max_stage_bytes=600)
    assert all(s.bytes + s.cache_bytes <= 600 for s in capped.stages)
    assert sum(s.cache_bytes for s in capped.stages) == 240 and sum(s.bytes for s in capped.stages) == 1400
    with pytest.raises(ConfigError, match=r"no split of the 6 layers \(in half layers\) into 3 stages .* smallest cap"):
        make_plan(costs, 3, balance="params", half_layers=True, max_stage_bytes=300)
    with pytest.raises(ConfigError, match=r"multiples of 0.5 that add up to the model's 6 decoder layers"):
        make_plan(costs, 2, balance=[3.25, 2.75], half_layers=True)
    explicit = make_plan(costs, 3, taps=(0, 1, 3, 4), balance=[0.5, 3, 2.5], half_layers=True)
    assert explicit.bounds == (0, 1, 7, 12) and explicit.layer_range(0) == "0.attn"
    assert [explicit.layer_range(k) for k in (1, 2)] == ["0.mlp-3.attn", "3.mlp-5"]
    # An attention-only stage owns no tap: tap 1 (layer 0's output) is computed by stage 1, tap 4 by stage 2.
    assert [explicit.owner(t) for t in (0, 1, 3, 4)] == [0, 1, 1, 2]
    assert [explicit.filled(k) for k in range(3)] == [1, 3, 4]
    from ppsplit.cli.commands import build_parser as _parser, split_options as _options

    opts = _options(_parser().parse_args(["plan", "demo", "--pp", "2", "--half-layers", "--balance", "4.5,3.5"]))
    assert opts.half_layers and opts.balance == [4.5, 3.5]
    assert not _options(_parser().parse_args(["plan", "demo", "--pp", "2"])).half_layers
