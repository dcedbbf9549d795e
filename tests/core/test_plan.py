"""The plan: balancing policies, tap owners and slots, JSON round trip."""
import pytest

from ppsplit import ConfigError, ModelCosts, SplitOptions, SplitPlan
from ppsplit.core.plan import ModelFacts
from ppsplit.passes.plan import make_plan


def costs(num_layers=10, layer=100, embed=0, head=0):
    return ModelCosts(embed_params=embed, head_params=head, layer_params=(layer,) * num_layers,
                      embed_bytes=2 * embed, head_bytes=2 * head, layer_bytes=(2 * layer,) * num_layers)


def sizes(plan):
    return [s.num_layers for s in plan.stages]


def test_layers_balance_gives_end_stages_the_smaller_share():
    assert sizes(make_plan(costs(10), 4)) == [2, 3, 3, 2]
    assert sizes(make_plan(costs(8), 4)) == [2, 2, 2, 2]
    assert sizes(make_plan(costs(32), 4)) == [8, 8, 8, 8]
    assert sizes(make_plan(costs(5), 1)) == [5]
    assert sizes(make_plan(costs(5), 5)) == [1, 1, 1, 1, 1]
    plan = make_plan(costs(9), 4)
    assert max(sizes(plan)) == 3 and sizes(plan)[0] == 2 and sizes(plan)[-1] == 2


def test_params_balance_counts_embedding_and_head():
    # Llama-3.1-8B-like proportions: embedding and head each ~2.4 layers' worth of parameters.
    plan = make_plan(costs(32, layer=218, embed=525, head=525), 4, balance="params")
    s = sizes(plan)
    assert sum(s) == 32 and s[0] < 8 and s[-1] < 8 and s[1] > 8
    assert plan.stages[0].params == 525 + 218 * s[0]
    assert plan.stages[-1].params == 525 + 218 * s[-1]
    assert max(st.cost for st in plan.stages) <= 218 * 9 + 525  # close to the even share
    # With no embedding or head cost, params balance is as even as layers.
    assert sizes(make_plan(costs(12), 3, balance="params")) == [4, 4, 4]


def test_explicit_and_callable_balance():
    assert sizes(make_plan(costs(10), 3, balance=[2, 5, 3])) == [2, 5, 3]
    plan = make_plan(costs(10), 2, balance=lambda c, pp: [c.num_layers - 1, 1])
    assert sizes(plan) == [9, 1] and plan.balance == "<lambda>"
    with pytest.raises(ConfigError, match="must be 3 positive numbers that add up to the model's 10"):
        make_plan(costs(10), 3, balance=[2, 2, 2])
    with pytest.raises(ConfigError, match="balance must be one of layers, params"):
        make_plan(costs(10), 3, balance="flops")


def test_owner_slot_and_prefix():
    plan = make_plan(costs(8), 4, taps=(8, 2, 4, 4, 0, 5))
    assert plan.taps == (0, 2, 4, 5, 8)  # duplicates collapse, ascending
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # Owner: start < j <= end; a tap on a boundary belongs to the stage before it.
    assert [plan.owner(t) for t in plan.taps] == [0, 0, 1, 2, 3]
    assert [plan.slot(t) for t in plan.taps] == [0, 1, 2, 3, 4]
    assert [plan.filled(s) for s in range(4)] == [2, 3, 4, 5]
    assert [list(plan.slots_of(s)) for s in range(4)] == [[0, 1], [2], [3], [4]]


def test_json_round_trip():
    facts = ModelFacts(hidden_size=64, dtype="bfloat16", model_class="LlamaForCausalLM", layers_fqn="model.layers")
    plan = make_plan(costs(10, embed=7, head=9), 3, taps=(2, 5, 7), balance="params", facts=facts)
    again = SplitPlan.from_json(plan.to_json())
    assert again == plan
    assert again.owner(5) == plan.owner(5) and again.costs.layer_params == plan.costs.layer_params
    assert "LlamaForCausalLM" in plan.describe() and "residual entering layer 5" in plan.describe()


def test_plan_rejects_bad_values():
    # Options are validated once, by SplitOptions, against the model's layer count.
    with pytest.raises(ConfigError, match=r"pp must be between 1 and 10 \(the model has 10 decoder layers\), but got 11"):
        SplitOptions(pp=11).taps(10)
    with pytest.raises(ConfigError, match="pp must be a positive number of stages, but got 0"):
        SplitOptions(pp=0)
    with pytest.raises(ConfigError, match="aux id 11 is out of range: tap ids go from 0 .* to 10"):
        SplitOptions(pp=2, aux=(3, 11)).taps(10)
    with pytest.raises(ValueError, match="taps must be distinct, ascending and within"):
        make_plan(costs(10), 2, taps=(3, 11))
    with pytest.raises(ValueError, match="contiguous"):
        SplitPlan.from_dict({**make_plan(costs(4), 2).to_dict(),
                             "stages": [dict(index=0, start=0, end=3, cost=1, params=0, bytes=0),
                                        dict(index=1, start=2, end=4, cost=1, params=0, bytes=0)]})
