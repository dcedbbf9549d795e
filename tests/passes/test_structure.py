"""Structure of the emitted stages: which parameters each holds, what crosses, where the taps are stored."""
import pytest
import torch

import ppsplit
from ppsplit.core.layers import find_layers
from tests.support import ARCHS, NUM_LAYERS, VOCAB, tiny_model

L = NUM_LAYERS


def hf_param_phases(model):
    """Parameter names used before the first decoder layer and after the last one, found by running the
    unsplit model with hooks (independent of ppsplit's graph analysis)."""
    layers = model.get_submodule(find_layers(model).fqn)
    events, hooks = [], []
    for name, mod in model.named_modules(remove_duplicate=False):
        if any(True for _ in mod.parameters(recurse=False)):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, name=name: events.append(name)))
    hooks.append(layers[0].register_forward_pre_hook(lambda m, a: events.append("<layers>")))
    hooks.append(layers[-1].register_forward_hook(lambda m, a, o: events.append("</layers>")))
    try:
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (1, 4)))
    finally:
        for h in hooks:
            h.remove()
    start, end = events.index("<layers>"), events.index("</layers>")

    def params_of(mod_names):
        return {f"{n}.{p}" for n in mod_names for p, _ in model.get_submodule(n).named_parameters(recurse=False)}

    return params_of(events[:start]), params_of(events[end + 1:])


def layer_params(model, fqn, lo, hi):
    return {n for n, _ in model.named_parameters(remove_duplicate=False)
            if any(n.startswith(f"{fqn}.{i}.") for i in range(lo, hi))}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pp", [2, 4])
def test_each_stage_holds_exactly_its_parameters(traced_cache, arch, pp):
    model, traced = traced_cache(arch)
    split = ppsplit.split_model(traced, pp, aux=[0, 2, L])
    pre, post = hf_param_phases(model)
    assert pre and post
    fqn = split.plan.layers_fqn
    for stage, sp in zip(split.stages, split.plan.stages):
        held = {n for n, _ in stage.named_parameters(remove_duplicate=False)}
        expected = layer_params(model, fqn, sp.start, sp.end)
        if sp.index == 0:
            expected |= pre
        if sp.index == pp - 1:
            expected |= post
        assert held == expected, f"stage {sp.index}: extra {held - expected}, missing {expected - held}"
        # Tensors are the model's own (shared, not copied) under their original names.
        model_params = dict(model.named_parameters(remove_duplicate=False))
        for name, p in stage.named_parameters(remove_duplicate=False):
            assert p is model_params[name] or p.data_ptr() == model_params[name].data_ptr()


def test_tied_embedding_is_replicated_on_last_stage(traced_cache):
    model, traced = traced_cache("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    split = ppsplit.split_model(traced, 2)
    first = dict(split.stages[0].named_parameters())
    last = dict(split.stages[-1].named_parameters())
    assert "transformer.wte.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "transformer.wte.weight" not in last
    assert last["lm_head.weight"].data_ptr() == first["transformer.wte.weight"].data_ptr()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("pp", [1, 2])
def test_plan_counts_the_parameters_each_stage_holds(traced_cache, arch, pp):
    """The plan's per-stage counts (what ``plan`` prints and placement checks) are the tensors each stage holds: a
    tied lm_head counts on the last stage when it is a replica, once when one stage holds both ends."""
    _, traced = traced_cache(arch)
    split = ppsplit.split_model(traced, pp)
    for stage, sp in zip(split.stages, split.plan.stages):
        held = {p.data_ptr(): p.numel() for p in stage.parameters()}
        assert sp.params == sum(held.values()), f"stage {sp.index}"

@pytest.mark.parametrize("arch", ARCHS)
def test_boundaries_carry_only_hidden_and_aux(traced_cache, arch):
    _, traced = traced_cache(arch)
    split = ppsplit.split_model(traced, 3, aux=[0, 1, 2, 3, 4, L])
    for k, stage in enumerate(split.stages):
        placeholders = [n.target for n in stage.graph.nodes if n.op == "placeholder"]
        assert placeholders == ["x", "positions", "aux"]
        out = next(n for n in stage.graph.nodes if n.op == "output").args[0]
        assert len(out) == 2 and out[1].target == "aux"
        # Each tap is written by exactly one op (plain or fused) on its owner stage.
        written = [split.plan.slot(n.meta["ppsplit.tap"]) for n in stage.graph.nodes if "ppsplit.tap" in n.meta]
        assert sorted(written) == list(split.plan.slots_of(k))

    ids = torch.randint(3, VOCAB, (2, 5))
    x = ids
    aux = split.new_aux(2, 5)
    with torch.no_grad():
        for k, stage in enumerate(split.stages):
            x, aux = stage(x, torch.arange(5), aux)
            if k < split.plan.pp - 1:
                assert x.shape == (2, 5, 64) and x.dtype == torch.float32  # the hidden state, nothing else
    assert x.shape == (2, 5, VOCAB)


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_nodes_are_conserved(traced_cache, arch):
    """Every decoder-layer op of the unsplit graph lands in exactly one stage."""
    _, traced = traced_cache(arch)

    def layer_ops(graph):
        return sum(1 for n in graph.nodes if n.op == "call_function" and n.meta.get("ppsplit.layer") is not None
                   and n.target is not torch.ops.ppsplit.tap_store.default)

    unsplit = layer_ops(traced.gm.graph)
    for pp in (1, 2, 3, 4):
        split = ppsplit.split_model(traced, pp, aux=[1, 3], fuse=False)
        assert sum(layer_ops(s.graph) for s in split.stages) == unsplit
        for stage, sp in zip(split.stages, split.plan.stages):
            layers = {n.meta["ppsplit.layer"] for n in stage.graph.nodes if n.meta.get("ppsplit.layer") is not None
                      and n.op == "call_function"}
            assert layers == set(range(sp.start, sp.end))


def test_meta_model_splits_without_weights():
    with torch.device("meta"):
        model = tiny_model("llama")
    split = ppsplit.split_model(model, 2, aux="1,3")
    assert all(p.is_meta for s in split.stages for p in s.parameters())
    real = ppsplit.split_model(tiny_model("llama"), 2, aux="1,3")
    assert split.plan == real.plan
    assert [set(dict(s.named_parameters())) for s in split.stages] == \
           [set(dict(s.named_parameters())) for s in real.stages]


def test_stages_hold_buffers_they_need(traced_cache):
    """Rotary inv_freq is recomputation input: every stage that applies rotary has its own copy."""
    _, traced = traced_cache("llama")
    split = ppsplit.split_model(traced, 3)
    for stage in split.stages:
        assert "model.rotary_emb.inv_freq" in dict(stage.named_buffers())
        assert "model.rotary_emb.inv_freq" not in stage.state_dict()  # non-persistent, as in the model
