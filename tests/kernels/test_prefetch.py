"""The L2 prefetch rewrite (``passes.rewrites.prefetch``): where it places the prefetches and joins, and that a
step with them computes the same bits, eager and captured."""
import pytest
import torch

import ppsplit
from ppsplit.passes.rewrites import prefetch
from ppsplit.triton_kernels.prefetch import l2_join, l2_prefetch

ops = torch.ops.ppsplit


def _gemv_split(model, monkeypatch, cache, **kw):
    from ppsplit.passes.rewrites import gemv as gemv_pass
    from ppsplit.triton_kernels import gemv, qkv

    for module in (gemv_pass, gemv, qkv):
        monkeypatch.setattr(module, "MIN_OUT", 1)
    split = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache, fuse_projections=True, fuse_pointwise=True, **kw)
    for stage in split.stages:
        gemv_pass.route_gemv(stage)
    return split


def test_prefetches_follow_a_projection_and_join_before_the_next_one_with_work_between(monkeypatch):
    """On a paged llama stage with every projection through the GEMV: a prefetch point after each projection that
    kernels separate from the next (q/k/v -> o: the attention; o -> gate/up: the norm; down -> the next layer's
    q/k/v: the norm), none between projections that follow each other directly; each point asks for the next
    projections' weights in the order the step reads them, up to the budget, and the next projection joins the
    branch just before it runs. ``route_gemv`` places them itself, and placing them again replaces its."""
    from tests.support import tiny_model

    monkeypatch.setattr(prefetch, "MIN_BYTES", 0)
    model = tiny_model("llama")
    cache = ppsplit.CacheConfig(batch_size=2, max_len=64, num_blocks=8, block_size=16)
    split = _gemv_split(model, monkeypatch, cache)
    stage = split.stages[0]
    heavy = [n for n in stage.graph.nodes if n.target in prefetch.projection_ops()]
    by_gemv = sum(n.target is l2_prefetch for n in stage.graph.nodes)
    sizes = [prefetch.weight_bytes(stage, n) for n in heavy]
    budget = sizes[1] + 1  # the next weight whole and the first bytes of the one after
    placed = prefetch.insert_prefetches(stage, budget)
    nodes = list(stage.graph.nodes)
    assert any(len(n.args) > 3 for n in nodes if n.target is l2_prefetch), "no point reached a second weight"
    points = [n for n in nodes if n.target is l2_prefetch]
    joins = [n for n in nodes if n.target is l2_join]
    assert by_gemv == placed == len(points) == len(joins) == len(heavy) - 1 - sum(
        n.target == ops.linear_silu_mul.default for n in heavy[1:])  # down follows the gated gate/up directly
    for point, join in zip(points, joins):
        before = max(i for i, n in enumerate(nodes[:nodes.index(point)]) if n in heavy)
        after = nodes.index(join) + 1
        assert nodes[after] in heavy and join.args == (nodes[after].args[0],)
        assert point.args[0] is nodes[before].args[0]
        ahead = heavy.index(nodes[after])
        count = next(c for c in range(1, len(heavy) - ahead + 1)
                     if sum(sizes[ahead:ahead + c]) >= budget or ahead + c == len(heavy))
        assert point.args[1] == budget and [w.target for w in point.args[2:]] == [
            n.args[1].target for n in heavy[ahead:ahead + count]]
        assert any(prefetch.is_work(n) and n.target not in (l2_prefetch, l2_join)
                   for n in nodes[before + 1:nodes.index(join)]), "a point between projections with no work"


@pytest.mark.gpu
def test_a_step_with_prefetches_equals_the_step_without_eager_and_captured_on_gpu(monkeypatch):
    """bf16 paged llama on a GPU, every projection through the GEMV, with the GEMV rewrite's prefetch points (the
    size floor lowered to these small weights): a prefill, then eight decode steps, eager and captured, give the bits
    of the same split without prefetches."""
    from tests.support import assert_decode_steps_equal, tiny_model

    monkeypatch.setattr(prefetch, "MIN_BYTES", 0)
    model = tiny_model("llama").to(device="cuda", dtype=torch.bfloat16)
    cache = ppsplit.CacheConfig(batch_size=2, max_len=64, num_blocks=8, block_size=16)
    plain = _gemv_split(model, monkeypatch, cache)
    for stage in plain.stages:
        prefetch.remove_prefetches(stage)
    fetched = _gemv_split(model, monkeypatch, cache)
    assert all(any(n.target is l2_prefetch for n in stage.graph.nodes) for stage in fetched.stages)
    graphed = _gemv_split(model, monkeypatch, cache).capture(0, [1])
    assert_decode_steps_equal(fetched, plain, graphed)
