"""The drafter's captured steps (a block drafter's two parts, a chain drafter's chained step): the static buffers, the
padding of requests to a bucket and the fallbacks give the eager engine's tokens, drafts and acceptance; on the CPU
through an eager stand-in for capture (each ``replay`` reruns the captured function on the static buffers), on CUDA
through real graphs (GPU only)."""
import copy

import pytest
import torch

import ppsplit
from ppsplit import CacheConfig
from ppsplit.serve.draft_graphs import BlockGraphs, ChainGraphs
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.eagle3.test_dflash import BLOCK, TAPS, small, zlab_drafter
from tests.support import drafter_config, random_drafter_tensors, tiny_model, write_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


class EagerGraph:
    """What ``capture`` returns, eager: ``replay`` reruns ``fn`` and writes its results into the first call's."""

    def __init__(self, fn):
        self.fn, self.out, self.replays = fn, fn(), 0

    def replay(self):
        self.replays += 1
        out = self.fn()
        if isinstance(out, tuple):
            for static, value in zip(self.out, out):
                static.copy_(value)
        elif out is not None:
            self.out.copy_(out)


def eager_capture(fn, device, pool=None):
    graph = EagerGraph(fn)
    return graph, graph.out


def run(split, drafter, prompts, graphs: bool, **params):
    engine = Engine(split, drafter=drafter, num_draft_tokens=BLOCK - 1)
    proposer = engine.runner.sampler.proposer
    if graphs:
        proposer.graphs = BlockGraphs(drafter, BLOCK, split.plan, split.layout, range(1, 65), capture_fn=eager_capture)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=24, seed=i, **params) for i in range(len(prompts))])
    return outs, proposer.graphs


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8}], ids=["greedy", "sampled"])
def test_stand_in_replays_equal_the_eager_engine(tmp_path, params):
    """Three requests (3 is padded to the 4-request bucket) through the static buffers: the same tokens and the
    same acceptance per verify pass as the eager drafter, and every part went through a replay."""
    _, graph = small()
    zlab_drafter(tmp_path / "z", 32, seed=1, scale=0.5)
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    torch.manual_seed(3)
    prompts = [torch.randint(3, 32, (n,)).tolist() for n in (7, 5, 9)]
    eager, _ = run(split, drafter, prompts, False, **params)
    graphed, graphs = run(split, drafter, prompts, True, **params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert [o.accepted for o in graphed] == [o.accepted for o in eager]
    assert sum(sum(o.accepted) for o in eager) > 0  # drafts were accepted, so the blocks' rows mattered
    assert sum(g.replays for g in graphs.context.values()) > 0
    # Three drawing requests ran padded to four: a greedy step's picks in the graph, a sampling step's eager.
    assert (graphs.greedy if not params else graphs.blocks)[4][0].replays > 0
    assert (graphs.blocks if not params else graphs.greedy)[4][0].replays == 0



@pytest.mark.parametrize("params", [{}, {"temperature": 0.8}], ids=["greedy", "sampled"])
def test_chain_stand_in_replays_equal_the_eager_engine(tmp_path, params):
    """An EAGLE-3 drafter, K = 3: three drawing requests (padded to the 4-request bucket) through the chained step's
    static buffers give the eager drafter's drafts, tokens and acceptance."""
    model = tiny_model("llama")
    split = ppsplit.split_model(model, 2, aux=[1, 2, 4], cache=CacheConfig(batch_size=8, max_len=64))
    cfg = drafter_config(model.config, aux_ids=[0, 1, 3])
    drafter = ppsplit.load_drafter(write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg)), split=split)
    prompts = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 5, 9)]
    runs = []
    for graphs in (False, True):
        engine = Engine(split, drafter=drafter, num_draft_tokens=3)
        if graphs:
            engine.runner.sampler.proposer.graphs = ChainGraphs(drafter, split.layout, capture_fn=eager_capture)
        sp = [SamplingParams(max_tokens=16, seed=i, **params) for i in range(3)]
        runs.append([(o.token_ids, o.drafts, o.accepted) for o in engine.generate(prompts, sp)])
    assert runs[1] == runs[0]
    assert engine.runner.sampler.proposer.graphs.steps[4][0].replays > 0


@pytest.mark.gpu
def test_captured_drafter_equals_eager_on_cuda(tmp_path):
    """bf16 on CUDA: the engine captures the drafter with the stages; its tokens and acceptance equal the eager
    engine's (``enforce_eager``) for four greedy requests."""
    model, _ = small()
    model = copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16)  # small() is cached: leave it on the CPU
    zlab_drafter(tmp_path / "z", 32, seed=1, scale=0.5)
    cache = ppsplit.CacheConfig(batch_size=8, max_len=64)
    outs = {}
    for eager in (True, False):
        split = ppsplit.split_model(model, 2, aux=TAPS, cache=cache)
        drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
        engine = Engine(split, drafter=drafter, num_draft_tokens=BLOCK - 1, enforce_eager=eager)
        assert (engine.runner.sampler.proposer.graphs is None) == eager
        torch.manual_seed(3)
        prompts = [torch.randint(3, 32, (7,)).tolist() for _ in range(4)]
        outs[eager] = [(o.token_ids, o.accepted) for o in engine.generate(prompts, SamplingParams(max_tokens=24))]
    assert outs[False] == outs[True]


@pytest.mark.gpu
def test_fused_draft_kernels_equal_aten_on_cuda(tmp_path):
    """bf16 on CUDA: a DFlash block through the stages' fused norm, rotation and gated-activation kernels (inference)
    gives the rows of the ATen ops (grad mode, where the kernels step aside) to bf16 rounding."""
    model, _ = small()
    model = copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16)  # small() is cached: leave it on the CPU
    zlab_drafter(tmp_path / "z", 32, seed=1, scale=0.5)
    split = ppsplit.split_model(model, 2, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    ids = torch.randint(3, 32, (1, 9), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        _, aux = split(ids, torch.arange(9, device="cuda"))
    block = torch.tensor([5] + [drafter.mask_token_id] * (BLOCK - 1), device="cuda")
    args = (aux[:, 0], block, torch.arange(9, device="cuda"), torch.arange(9, 9 + BLOCK, device="cuda"))
    with torch.no_grad():
        fused = drafter.block_rows(*args)
    with torch.enable_grad():
        plain = drafter.block_rows(*args)
    assert plain.requires_grad and not fused.requires_grad  # the two paths really differ
    torch.testing.assert_close(fused.float(), plain.detach().float(), atol=3e-2, rtol=3e-2)
