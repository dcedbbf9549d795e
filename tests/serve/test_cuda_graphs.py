"""CUDA-graph capture of stages: replay equals eager, bf16, for prefill, decode and verify buckets (GPU only)."""
import pytest
import torch

import ppsplit
from ppsplit import CacheConfig
from ppsplit.core.ragged import RaggedStep, Segment
from tests.support import VOCAB, tiny_model

pytestmark = pytest.mark.gpu


FILL = [Segment(1, 0, 30), Segment(2, 0, 12), Segment(3, 0, 20)]  # the prefixes the mixed step continues
MIXED = [Segment(0, 0, 7), Segment(1, 30, 1), Segment(2, 12, 4), Segment(3, 20, 5)]  # prefill, decode, verify, chunk
TABLES = {0: [3, 0], 1: [5, 1], 2: [2, 7], 3: [6, 4]}  # shuffled, non-contiguous blocks


def ragged_replay_equals_eager(model, **options):
    """Two splits of ``model`` (fresh paged caches): one eager, one with the 64-token bucket captured; the same
    fill step then the mixed step (both padded to the bucket) give bit-equal logits and taps."""
    cache = CacheConfig(batch_size=4, max_len=64, num_blocks=8, block_size=16)
    eager = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache, **options)
    graphed = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache, **options).capture(0, [64])
    assert graphed.graphs
    torch.manual_seed(0)
    for segments in (FILL, MIXED):
        step = RaggedStep.build(segments, TABLES, eager.layout, pad_to=64).to("cuda")
        ids = torch.randint(3, VOCAB, (64,), device="cuda")
        with torch.no_grad():
            logits_e, aux_e = eager.step(ids, step)
            logits_g, aux_g = graphed.step(ids, step)
        n = sum(s.count for s in segments)
        torch.testing.assert_close(logits_g[:n], logits_e[:n], atol=0, rtol=0)
        assert torch.equal(aux_g[:, :n], aux_e[:, :n]) and not aux_e[:, :n].isnan().any()
    return eager


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "qwen3", "mixtral"])
def test_replay_equals_eager(arch):
    """bf16, a ragged step mixing a prefill, a decode, a verify window and a prefill chunk over shuffled blocks:
    the captured bucket's replay equals the eager call exactly."""
    ragged_replay_equals_eager(tiny_model(arch).to(device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rope_write_kernel_in_a_ragged_step_equals_the_ops_it_replaces(arch):
    """bf16, the default CUDA split (each layer's rotations and key and value writes in one ``rope_write`` kernel)
    against the same split with ``fuse_pointwise=False`` (the ATen rotations, the write kernel): a fill step then the
    mixed step give bit-equal logits and taps."""
    model = tiny_model(arch).to(device="cuda", dtype=torch.bfloat16)
    cache = CacheConfig(batch_size=4, max_len=64, num_blocks=8, block_size=16)
    fused = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache)
    plain = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache, fuse_pointwise=False)
    assert all(stage.meta["ppsplit.pointwise"].get("rope_write") for stage in fused.stages)
    torch.manual_seed(0)
    for segments in (FILL, MIXED):
        step = RaggedStep.build(segments, TABLES, fused.layout, pad_to=64).to("cuda")
        ids = torch.randint(3, VOCAB, (64,), device="cuda")
        with torch.no_grad():
            (a, a_aux), (b, b_aux) = fused.step(ids, step), plain.step(ids, step)
        n = sum(s.count for s in segments)
        assert torch.equal(a[:n], b[:n]) and torch.equal(a_aux[:, :n], b_aux[:, :n])


def test_generate_with_graphs_equals_eager():
    model = tiny_model("llama").to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 7), device="cuda")
    eager = ppsplit.split_model(model, 3, cache=CacheConfig(batch_size=2, max_len=64)).generate(ids, 20,
                                                                                                enforce_eager=True)
    graphed = ppsplit.split_model(model, 3, cache=CacheConfig(batch_size=2, max_len=64)).capture(2, [7, 1])
    assert graphed.graphs and torch.equal(graphed.generate(ids, 20), eager)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    # bf16 on the GPU: HF's dynamic cache and our static one may round differently; most tokens agree.
    assert (eager == expected).float().mean() > 0.9


def test_the_engine_on_cuda_captures_schedules_ahead_and_equals_eager(tmp_path):
    """bf16 on one GPU: by default the engine captures its stages for the token buckets and schedules each step while
    the previous one runs (windows filled in on the device). Every request's tokens, and with an EAGLE-3 drafter its
    drafts and acceptances, equal the eager engine's on the same padded steps; the greedy tokens mostly equal Hugging
    Face's (bf16 rounding may differ); one device read per step."""
    from ppsplit.serve.engine import Engine
    from ppsplit.serve.sampling import SamplingParams
    from tests.serve.test_engine import HostReads
    from tests.support import drafter_config, random_drafter_tensors, write_drafter

    model = tiny_model("llama").to(device="cuda", dtype=torch.bfloat16)
    cache = CacheConfig(batch_size=8, max_len=96)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 9, 30, 5, 12)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 8, 15, 10, 6, 20)]
    cfg = drafter_config(model.config, aux_ids=[0, 1, 3])
    folder = write_drafter(str(tmp_path / "d"), cfg, random_drafter_tensors(cfg, scale=2.0))
    for k in (0, 3):
        runs = []
        for eager in (False, True):
            split = ppsplit.split_model(model, 2, aux=[1, 2, 4], cache=cache)
            drafter = ppsplit.load_drafter(folder, split=split) if k else None
            engine = Engine(split, drafter=drafter, num_draft_tokens=k, enforce_eager=eager,
                            async_scheduling=not eager, max_num_batched_tokens=64)
            if eager:
                engine.scheduler.buckets = list(runs[0][1])  # the same padded steps as the captured engine
            else:
                assert split.graphs and engine.runner.lag and engine.runner.depth == 2
            outs = engine.generate(prompts, params)
            runs.append(([(o.token_ids, o.drafts, o.accepted) for o in outs], engine.scheduler.buckets))
            for p in prompts[:2]:
                engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
            engine.step()
            reads = HostReads()
            with reads:
                engine.step()
            assert reads.count <= 1
        assert runs[0][0] == runs[1][0], k
        agree = total = 0
        for p, (tokens, _, _) in zip(prompts, runs[0][0]):
            with torch.no_grad():
                hf = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=len(tokens), do_sample=False,
                                    eos_token_id=None)[0, len(p):].tolist()
            agree, total = agree + sum(a == b for a, b in zip(tokens, hf)), total + len(tokens)
        assert agree / total > 0.9


def test_stages_on_two_devices():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    model = tiny_model("qwen3").to(torch.float32)
    split = ppsplit.split_model(model, 2, aux=[1, 4])
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        ref_logits, ref_aux = split(ids)
    split.place(["cuda:0", "cuda:1"])
    with torch.no_grad():
        logits, aux = split(ids.to("cuda:0"))
    assert logits.device == torch.device("cuda:1") and aux.device == torch.device("cuda:1")
    torch.testing.assert_close(logits.cpu(), ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux.cpu(), ref_aux, atol=1e-4, rtol=1e-4)
