"""Balance policies: the exact min-max split (against brute force), memory caps, flops counted from the graph
(against a hand count), and the time policy on a real tiny model."""
import itertools
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig, ConfigError, CostModel, ModelCosts, RegionCosts, SplitOptions, SplitPlan
from ppsplit.core.options import parse_bytes
from ppsplit.passes.planning.balance import best_split
from ppsplit.passes.planning.costs import count_flops
from ppsplit.passes.plan import make_plan
from tests.support import tiny_model

H, I, HEADS, KV, D = 64, 128, 4, 2, 16  # tests/support.py's tiny shape
BIG_VOCAB = 128000
_TRACED = {}


def traced(name):
    """Tiny models with a large vocabulary, so that the head costs more than a layer (traced once per session)."""
    if name not in _TRACED:
        if name == "qwen3_moe":
            cfg = AutoConfig.for_model("qwen3_moe", vocab_size=BIG_VOCAB, hidden_size=H, intermediate_size=I,
                                       moe_intermediate_size=32, num_attention_heads=HEADS, num_key_value_heads=KV,
                                       head_dim=D, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                       max_position_embeddings=256)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).eval()
        else:
            model = tiny_model("llama", vocab_size=BIG_VOCAB)
        cache = CacheConfig(2, 64) if name == "llama+cache" else None
        _TRACED[name] = (model, ppsplit.trace_model(model, cache=cache))
    return _TRACED[name]


def compositions(n, pp):
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0,) + cuts + (n,)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def test_min_max_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        n = rng.randint(1, 8)
        pp = rng.randint(1, n)
        cost = RegionCosts(layers=tuple(float(rng.randint(1, 20)) for _ in range(n)), embed=float(rng.randint(0, 30)),
                           head=float(rng.randint(0, 30)), stage=float(rng.randint(0, 5)))
        memory = RegionCosts(layers=tuple(float(rng.randint(1, 10)) for _ in range(n)), embed=float(rng.randint(0, 15)),
                             head=float(rng.randint(0, 15)))
        cap = rng.choice([None, float(rng.randint(5, 40))])
        feasible = [s for s in compositions(n, pp) if cap is None or max(memory.stage_costs(s)) <= cap]
        got = best_split(cost, pp, memory=memory, cap=cap)
        if not feasible:
            assert got is None
            continue
        assert got is not None and sum(got) == n and len(got) == pp and min(got) >= 1
        assert cap is None or max(memory.stage_costs(got)) <= cap  # the cap holds
        assert max(cost.stage_costs(got)) == min(max(cost.stage_costs(s)) for s in feasible)  # exact optimum
        # Among the optimal splits, the most even (smallest sum of squares).
        best = max(cost.stage_costs(got))
        even = min(sum(c * c for c in cost.stage_costs(s)) for s in feasible if max(cost.stage_costs(s)) == best)
        assert sum(c * c for c in cost.stage_costs(got)) == even
        checked += 1
    assert checked > 150


def costs(num_layers=8, layer=100, embed=300, head=300, cache=0):
    return ModelCosts(embed_params=embed, head_params=head, layer_params=(layer,) * num_layers,
                      embed_bytes=2 * embed, head_bytes=2 * head, layer_bytes=(2 * layer,) * num_layers,
                      layer_cache_bytes=(cache,) * num_layers if cache else ())


def test_memory_policy_and_cap():
    # Each layer holds 200 B of weights + 50 B of cache; the embedding 600 B, the head 1200 B.
    c = costs(8, head=600, cache=50)
    held = RegionCosts(layers=(250.0,) * 8, embed=600.0, head=1200.0)
    smallest = min(max(held.stage_costs(s)) for s in compositions(8, 3))
    plan = make_plan(c, 3, balance="memory")
    assert [s.cost for s in plan.stages] == [s.bytes + s.cache_bytes for s in plan.stages]
    assert max(s.cost for s in plan.stages) == smallest == 1450
    # The even layers split ([2, 3, 3]) holds 1950 B on the last stage; under a cap of 1500 B the layers policy
    # takes the most even split that fits.
    assert max(s.bytes + s.cache_bytes for s in make_plan(c, 3).stages) == 1950
    capped = make_plan(c, 3, balance="layers", max_stage_bytes=1500)
    fitting = [s for s in compositions(8, 3) if max(held.stage_costs(s)) <= 1500]
    assert max(s.num_layers for s in capped.stages) == min(max(s) for s in fitting)
    assert all(s.bytes + s.cache_bytes <= 1500 for s in capped.stages)
    assert capped.max_stage_bytes == 1500 and "cap 1.5 KiB per stage" in capped.describe()
    with pytest.raises(ConfigError, match=f"the smallest cap that fits pp=3 is {int(smallest)} "):
        make_plan(c, 3, balance="params", max_stage_bytes=int(smallest) - 1)
    assert make_plan(c, 3, balance="params", max_stage_bytes=int(smallest)).pp == 3
    with pytest.raises(ConfigError, match=r"stage 0 of layer counts \[6, 1, 1\] holds .* over max_stage_bytes=1500"):
        make_plan(c, 3, balance=[6, 1, 1], max_stage_bytes=1500)


def test_plan_records_costs_imbalance_and_reads_older_plans():
    c = costs(8)
    region = RegionCosts(layers=(1.0,) * 8, embed=0.0, head=3.0, stage=0.5, unit="ms")
    plan = make_plan(c, 4, balance="time", region_costs=region, cost_model=CostModel(batch=8, context=512))
    assert plan.stages[-1].num_layers == 1  # the head weighs three layers
    assert sorted(s.cost for s in plan.stages) == [2.5, 2.5, 3.5, 4.5]
    assert plan.imbalance == pytest.approx(4.5 / 3.25)
    text = plan.describe()
    assert "stage cost in ms: slowest / mean = 1.385" in text and "decode (batch 8, 1 token(s) after 512)" in text
    again = SplitPlan.from_json(plan.to_json())
    assert again == plan and again.region_costs.layers == region.layers and again.cost_model.batch == 8
    old = plan.to_dict()
    for key in ("region_costs", "cost_model", "max_stage_bytes"):
        del old[key]
    older = SplitPlan.from_dict(old)  # a plan.json written before these fields existed
    assert older.region_costs is None and older.stages == plan.stages and older.imbalance == plan.imbalance
    with pytest.raises(ConfigError, match="balance='time' needs the costs"):
        make_plan(c, 2, balance="time")


def test_options_validate_cost_model_cap_and_sizes():
    assert parse_bytes("20GiB") == 20 << 30 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("4096") == 4096
    with pytest.raises(ConfigError, match="'20XB' is not a size"):
        parse_bytes("20XB")
    assert CostModel.parse("batch=8,context=4096,prefill=128,prefill_weight=0.5") == CostModel(
        batch=8, context=4096, prefill=128, prefill_weight=0.5)
    with pytest.raises(ConfigError, match="CostModel.batch must be an integer >= 1, but got 0"):
        CostModel(batch=0)
    with pytest.raises(ConfigError, match="prefill=0 gives it no tokens"):
        CostModel(prefill_weight=1.0)
    with pytest.raises(ConfigError, match="cost model entry 'batchsize=2'"):
        CostModel.parse("batchsize=2")
    with pytest.raises(ConfigError, match="max_stage_bytes must be a positive number of bytes"):
        SplitOptions(pp=2, max_stage_bytes=0)
    with pytest.raises(ConfigError, match="balance must be one of layers, params, flops, time, memory"):
        SplitOptions(pp=2, balance="speed")
    from ppsplit.cli.commands import build_parser as _parser, split_options as _options

    args = _parser().parse_args(["plan", "demo", "--pp", "2", "--balance", "flops", "--max-stage-memory", "1GiB",
                                 "--cost-model", "batch=4"])
    opts = _options(args)
    assert opts.balance == "flops" and opts.max_stage_bytes == 1 << 30 and opts.cost_model.batch == 4


def layer_flops(b, t, c):
    """Hand count of one tiny Llama layer: the seven projections, and attention (scores and output) over the
    keys each query sees, c + (t + 1) / 2 on average under the causal mask."""
    projections = H * H + H * (KV * D) * 2 + H * H + 3 * H * I  # q, k, v, o, gate, up, down
    attention = 2 * HEADS * D * (c + (t + 1) / 2)
    return 2 * b * t * (projections + attention)


@pytest.mark.parametrize("name", ["llama", "llama+cache"])
def test_flops_match_a_hand_count(name):
    _, annotated = traced(name)
    counts = count_flops(annotated)
    for b, t, c in ((1, 1, 1024), (8, 1, 100), (2, 7, 0)):
        step = counts.step(b, t, c)
        assert step.layers[0] == pytest.approx(layer_flops(b, t, c), rel=1e-12)
        assert set(step.layers) == {step.layers[0]}
        assert step.head == 2 * b * t * H * BIG_VOCAB and step.embed == 0  # the embedding is a gather
    assert not counts.uncounted


def test_flops_of_eager_attention_and_moe(traced_cache):
    _, gemma = traced_cache("gemma2")  # attention as two matmuls (soft-capped), not SDPA
    step = count_flops(gemma).step(4, 1, 300)
    assert step.layers[0] == pytest.approx(layer_flops(4, 1, 300), rel=1e-12)
    _, moe = traced("qwen3_moe")  # experts through grouped_mm: a token pays for its top-2 of 4 experts only
    step = count_flops(moe).step(3, 5, 10)
    experts = 2 * (H * 2 * 32 + 32 * H)  # gate_up and down of one expert
    router = H * 4
    attention = H * H * 2 + H * KV * D * 2 + 2 * HEADS * D * (10 + 3)
    assert step.layers[1] == pytest.approx(2 * 3 * 5 * (experts + router + attention), rel=1e-12)


def test_flops_policy_gives_the_head_its_weight():
    _, annotated = traced("llama")
    by_layers = ppsplit.split_model(annotated, 2, fuse=False)
    by_flops = ppsplit.split_model(annotated, 2, balance="flops", fuse=False)
    # The head (2 * 64 * 128000 per token) outweighs four layers (~75k each): the last stage keeps one layer.
    assert [s.num_layers for s in by_layers.plan.stages] == [2, 3]
    assert [s.num_layers for s in by_flops.plan.stages] == [4, 1]
    region = by_flops.plan.region_costs
    assert region.unit == "FLOP" and by_flops.plan.cost_model == CostModel()
    assert by_flops.plan.imbalance < region.stage_costs([2, 3])[1] / (sum(region.stage_costs([2, 3])) / 2)
    ids = torch.randint(0, BIG_VOCAB, (1, 6))
    torch.testing.assert_close(by_flops(ids)[0], by_layers(ids)[0])  # same model, other cut


def test_time_policy_times_a_real_model_on_the_cpu():
    model, annotated = traced("llama")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread times steadier on a busy machine
    try:
        split = ppsplit.split_model(annotated, 2, balance="time", fuse=False)
    finally:
        torch.set_num_threads(threads)
    region = split.plan.region_costs
    assert split.plan.balance == "time" and region.unit == "ms" and len(region.layers) == 5
    assert region.head > max(region.layers[1:-1])  # a 64 x 128000 matmul against a 64-wide layer
    sizes = [s.num_layers for s in split.plan.stages]
    # The exact optimum under what was measured, and the head's stage holds fewer layers (usually [4, 1]; how
    # many fewer depends on this machine's timing).
    assert max(region.stage_costs(sizes)) == min(max(region.stage_costs(c)) for c in compositions(5, 2))
    assert sizes[1] < sizes[0]
    assert split.plan.stages[1].cost == pytest.approx(region.stage + region.layers[4] + region.head)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
    with pytest.raises(ConfigError, match="balance='time' times every layer .* on the meta device"):
        ppsplit.split_model(meta, 2, balance="time")
