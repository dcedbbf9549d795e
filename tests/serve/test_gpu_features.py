"""The engine's request features on CUDA (GPU only), bf16, with the stages (and a block drafter) captured: each gives
the same tokens as the same engine run eager (``enforce_eager``): grammar masks copied beside the step, ``n``
choices sharing their prompt's blocks, DSpark's trimmed windows through the captured drafter, MTP chains through the
captured chained step (an FP8 one too, and across ranks)."""
import copy
import json

import pytest
import torch

import ppsplit
from ppsplit import CacheConfig
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.eagle3.test_mtp_fp8 import fp8  # noqa: F401  (the fixture: a block-FP8 DeepSeek-V3 folder with --mtp)
from tests.support import tiny_model

pytestmark = pytest.mark.gpu


def both(build, run):
    """``run(engine)`` for an eager and a captured engine (``build(enforce_eager)``), the captured one first."""
    return [run(build(eager)) for eager in (False, True)]


def test_grammar_requests_on_cuda():
    xgrammar = pytest.importorskip("xgrammar")  # noqa: F841
    from ppsplit.serve.structured import Grammars
    from tests.serve.test_structured import EOS, SCHEMA, char_tokenizer_json, text

    grammars = Grammars(char_tokenizer_json(), 32, [EOS])
    model = tiny_model("llama", vocab_size=32, eos_token_id=EOS).to(device="cuda", dtype=torch.bfloat16)
    params = [SamplingParams(max_tokens=40, grammar=grammars.compile("json", json.dumps(SCHEMA))),
              SamplingParams(max_tokens=40, grammar=grammars.compile("regex", r"[a-f]{2,5}-[0-9]{1,3}")),
              SamplingParams(max_tokens=12)]
    prompts = [[5, 9, 3, 9], [7, 7, 7], [11, 20, 12]]

    def build(eager):
        split = ppsplit.split_model(model, 1, cache=CacheConfig(batch_size=8, max_len=64))
        return Engine(split, enforce_eager=eager)

    captured, eager = both(build, lambda e: [o.token_ids for o in e.generate(prompts, params)])
    assert captured == eager
    value = json.loads(text(captured[0]))
    assert set(value) == {"a", "b"}


def test_n_choices_share_prompt_blocks_on_cuda():
    model = tiny_model("qwen3").to(device="cuda", dtype=torch.bfloat16)
    prompt = torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(engine):
        params = [SamplingParams(max_tokens=10, temperature=0.8, seed=7 + j) for j in range(4)]
        first = engine.add_request(prompt, params[0])
        ids = [first] + [engine.add_request(prompt, p, parent=first) for p in params[1:]]
        done = {}
        while engine.has_unfinished():
            done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        assert engine.blocks_in_use == 0
        return [done[i] for i in ids], engine.scheduler.shared_tokens

    def build(eager):
        split = ppsplit.split_model(model, 2, cache=CacheConfig(batch_size=8, max_len=128, block_size=16))
        return Engine(split, enforce_eager=eager)

    (captured, shared), (eager, _) = both(build, run)
    assert captured == eager and len({tuple(c) for c in captured}) > 1
    assert shared == 3 * 32  # the three later choices took the prompt's two full blocks


def dspark_captured_and_eager(model, folder: str, taps, k: int, threshold: float, rule: str | None = None):
    """A DSpark drafter from ``folder`` over a pp-2 split of ``model`` (the cached CPU target, copied to CUDA in
    bf16), windows trimmed at ``threshold`` (under ``rule`` if given): the captured engine's and the eager engine's
    ``(tokens, accepted, drafts)`` of four greedy requests."""
    model = copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16)  # small() is cached: leave it on the CPU
    prompts = torch.randint(6, 32, (4, 7), generator=torch.Generator().manual_seed(3)).tolist()

    def build(eager):
        split = ppsplit.split_model(model, 2, aux=taps, cache=CacheConfig(batch_size=8, max_len=64))
        drafter = ppsplit.load_drafter(folder, split=split)
        drafter.confidence_threshold = threshold
        if rule is not None:
            drafter.confidence_rule = rule
        engine = Engine(split, drafter=drafter, num_draft_tokens=k, enforce_eager=eager)
        assert (engine.runner.sampler.proposer.graphs is None) == eager
        return engine

    return both(build, lambda e: [(o.token_ids, o.accepted, o.drafts) for o in
                                  e.generate(prompts, SamplingParams(max_tokens=24))])


def test_dspark_trimmed_windows_on_cuda(tmp_path):
    from tests.eagle3.test_dflash import TAPS, small
    from tests.eagle3.test_dspark import BLOCK, dspark_drafter
    from tests.support import bigram_markov

    model, _ = small()
    dspark_drafter(tmp_path / "d", model, seed=1, scale=0.5, markov_rank=32, prepare=bigram_markov(model))
    captured, eager = dspark_captured_and_eager(model, str(tmp_path / "d"), TAPS, BLOCK, 0.3)
    assert captured == eager
    assert sum(sum(a) for _, a, _ in captured) > 0


@pytest.mark.parametrize("rule", ["each", "survival"])
def test_deepspec_dspark_trimmed_windows_on_cuda(tmp_path, rule):
    """A DeepSpec DSpark folder (no speculators needed), threshold 0.4 under each trimming rule: the captured
    drafter (block, Markov and confidence heads in one greedy graph) gives the eager engine's tokens, drafts and
    acceptance."""
    from tests.eagle3.test_deepspec import BLOCK, TAPS, deepspec_folder, knows_the_target
    from tests.eagle3.test_dflash import small

    model, _ = small()
    deepspec_folder(tmp_path / "d", model, rank=model.config.vocab_size, seed=1, scale=0.5,
                    prepare=knows_the_target(model, 0.5))
    captured, eager = dspark_captured_and_eager(model, str(tmp_path / "d"), TAPS, BLOCK, 0.4, rule)
    assert captured == eager
    assert len({len(d) for _, _, drafts in captured for d in drafts}) > 1  # windows of several lengths


def test_mtp_chain_on_cuda(tmp_path):
    from tests.eagle3.test_mtp import L, V, build as build_mtp

    target, _, _, folder, _ = build_mtp(tmp_path / "ckpt")
    target = target.to(device="cuda", dtype=torch.bfloat16)
    prompts = [torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 13)]

    def build(eager):
        split = ppsplit.split_model(target, 2, aux=[L], cache=CacheConfig(batch_size=8, max_len=64))
        engine = Engine(split, drafter=ppsplit.load_mtp(folder, split=split), num_draft_tokens=2, enforce_eager=eager)
        assert (engine.runner.sampler.proposer.graphs is None) == eager  # the chained step captured
        return engine

    captured, eager = both(build, lambda e: [(o.token_ids, o.accepted) for o in
                                             e.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert captured == eager


class _Captured:
    """A ``tests.processes.serve`` script: whether the rank's drafter was captured (read before the first step)."""

    def __init__(self):
        self.graphs = None

    def __call__(self, engine, step):
        if self.graphs is None:
            self.graphs = engine.sampler.proposer.graphs is not None


def test_mtp_captured_across_ranks_on_cuda(tmp_path_factory, request):
    """``PipelineEngine`` on CUDA (one NCCL rank) captures its MTP drafter with its stage, as the one-process engine
    does, and gives that engine's eager tokens, drafts and acceptance."""
    from tests.eagle3.test_mtp import V, mtp_folder
    from tests.processes import launch, serve

    _, folder = mtp_folder("deepseek_v3", 1, tmp_path_factory, request)
    prompts = torch.randint(3, V, (3, 6), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    res = launch(1, serve, folder, [(p, params, 0) for p in prompts], 3, None, _Captured(), backend="nccl",
                 timeout=120, deadline=300)
    assert res[0][0] == "ok", res[0][-1][-800:]
    outputs, in_use, _, script = res[0][1]
    assert script.graphs and in_use == 0
    single = ppsplit.load(folder, ["cuda"])
    expected = Engine(single, drafter=single.drafter, num_draft_tokens=3, enforce_eager=True).generate(prompts, params)
    assert [outputs[str(i)][0::2] for i in range(3)] == [(e.token_ids, e.accepted) for e in expected]


def test_fp8_mtp_chain_on_cuda(fp8):  # noqa: F811
    """A block-FP8 DeepSeek-V3 folder compiled with --mtp, on CUDA: the MTP block's FP8 linears run the stages' FP8
    kernels in the captured chained step, with the eager engine's tokens and acceptance."""
    out = fp8[-1]
    prompts = [torch.randint(3, 32, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 13)]

    def build(eager):
        split = ppsplit.load(out, ["cuda", "cuda"])
        engine = Engine(split, drafter=split.drafter, num_draft_tokens=3, enforce_eager=eager)
        assert (engine.runner.sampler.proposer.graphs is None) == eager
        return engine

    captured, eager = both(build, lambda e: [(o.token_ids, o.accepted) for o in
                                             e.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert captured == eager
