"""The fuse pass: fused ops replace the add/norm/store groups at taps, and the split still equals HF."""
import pytest
import torch

import ppsplit
from tests.support import NUM_LAYERS, VOCAB
from tests.support import last_layer_output, reference

L = NUM_LAYERS
ops = torch.ops.ppsplit
NOT_KERNELS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
               torch.ops.aten.alias.default, torch.ops.aten.view_as.default, torch.ops.aten.unsqueeze.default,
               torch.ops.aten.transpose.int, torch.ops.aten.expand.default, torch.ops.aten.slice.Tensor,
               torch.ops.aten.select.int, torch.ops.aten.sym_size.int}


def kernels(stage):
    """Ops that launch work (views, getitems and size reads do not)."""
    return sum(1 for n in stage.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target not in NOT_KERNELS)


def hidden_norm_nodes(stage, hidden):
    """Nodes still inside a norm module over the hidden size (the decomposed RMSNorm/LayerNorm ops)."""
    left = []
    for n in stage.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if n.op != "call_function" or not stack or str(n.target).startswith("ppsplit") or n.target in NOT_KERNELS:
            continue
        cls = str(list(stack.values())[-1][1]).rsplit(".", 1)[-1].lower()
        val = n.meta.get("val")
        if "norm" in cls and isinstance(val, torch.Tensor) and val.shape[-1] == hidden and val.dim() >= 2:
            left.append(n)
    return left


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2", "gpt_neox", "mistral", "phi3", "opt"])
def test_fused_taps_replace_add_norm_store(traced_cache, arch):
    model, traced = traced_cache(arch)
    # Stages [0, 2) and [2, 5): taps 1 and 4 sit inside a stage, 2 on the boundary, 0 and L at the ends.
    taps = [0, 1, 2, 4, L]
    split = ppsplit.split_model(traced, 2, aux=taps, balance=[2, 3])
    unfused = ppsplit.split_model(traced, 2, aux=taps, balance=[2, 3], fuse=False)
    no_taps = ppsplit.split_model(traced, 2, balance=[2, 3])
    hidden = split.plan.hidden_size

    written = {}
    for k, stage in enumerate(split.stages):
        for n in stage.graph.nodes:
            if "ppsplit.tap" in n.meta:
                written[n.meta["ppsplit.tap"]] = n.target
        # No decomposed norm over the hidden size is left, and no plain store where a kernel could absorb it.
        assert hidden_norm_nodes(stage, hidden) == [], f"stage {k}"
        assert hidden_norm_nodes(unfused.stages[k], hidden), "fuse=False keeps the traced norm ops"
        # A tap costs no kernel: the same number of launches as the split without taps.
        assert kernels(stage) == kernels(no_taps.stages[k]), f"stage {k}"
        assert kernels(stage) < kernels(unfused.stages[k])
    assert written[1] is ops.add_norm_store.default  # in-stage tap: add + next layer's norm + store
    assert written[4] is ops.add_norm_store.default
    assert written[L] is ops.add_norm_store.default  # last layer's output: add + final norm + store
    assert written[2] is ops.add_store.default  # boundary tap: its norm is on the next stage
    assert written[0] is ops.norm_store.default  # the embedding output entering layer 0's norm
    # The report is data: one entry per tap on its owner stage, ascending; the table formats it.
    assert [t.tap for t in split.plan.fused[0].taps] == [0, 1, 2] and [t.tap for t in split.plan.fused[1].taps] == [4, L]
    assert any(t.op.startswith("add+") and t.op.endswith("+store") for t in split.plan.fused[0].taps)
    assert ppsplit.TapFusion(2, 2, "add+store", "norm on the next stage") in split.plan.fused[0].taps
    assert "tap 2 -> slot 2: add+store (norm on the next stage)" in split.plan.fused[0].lines()
    assert "tap 2 -> slot 2: add+store (norm on the next stage)" in split.plan.describe()

    ids = torch.randint(3, VOCAB, (2, 7))
    ref_logits, ref_hidden = reference(model, ids)
    with torch.no_grad():
        logits, aux = split(ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for slot, tap in enumerate(split.plan.taps):
        expected = last_layer_output(model, ids) if tap == L else ref_hidden[tap]
        torch.testing.assert_close(aux[slot], expected, atol=1e-5, rtol=1e-5)


def test_fuse_norms_only_keeps_plain_stores(traced_cache):
    _, traced = traced_cache("llama")
    split = ppsplit.split_model(traced, 2, aux=[1, 4], balance=[2, 3], fuse="norms")
    stores = [n for s in split.stages for n in s.graph.nodes if n.target is ops.tap_store.default]
    assert len(stores) == 2
    assert any(n.target is ops.add_norm.default for s in split.stages for n in s.graph.nodes)
    with pytest.raises(ppsplit.ConfigError, match="fuse must be True"):
        ppsplit.split_model(traced, 2, fuse="yes")
    # The option's spellings: True is "all", False is "none".
    assert ppsplit.SplitOptions(pp=2, fuse=True).fuse == "all" and ppsplit.SplitOptions(pp=2, fuse=False).fuse == "none"


def test_bf16_fused_split_matches_hf_bit_for_bit():
    """In bf16 on the CPU, the fused ops' torch path is the HF op sequence: identical results."""
    from tests.support import tiny_model

    for arch in ("llama", "gemma2"):
        model = tiny_model(arch).to(torch.bfloat16)
        split = ppsplit.split_model(model, 2, aux=[1, 3], balance=[2, 3])
        ids = torch.randint(3, VOCAB, (2, 6))
        with torch.no_grad():
            ref = model(ids, output_hidden_states=True)
            logits, aux = split(ids)
        assert torch.equal(logits, ref.logits)
        assert torch.equal(aux[0], ref.hidden_states[1]) and torch.equal(aux[1], ref.hidden_states[3])
