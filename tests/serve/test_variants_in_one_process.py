"""Hugging Face StaticCache under ``torch.compile(mode="reduce-overhead")``, a split replayed from CUDA graphs and a
split with ``compile=True`` replayed from CUDA graphs, all at batch 32 in one process (GPU only).

``bench/peer.py`` once ended in an illegal memory access when these three ran in one process; each ran correctly
alone. Here they run interleaved for several rounds on one model (whose projections the default split fuses, so
the model's own weights become views of the fused ones between HF's capture and its next replay): every replay
must give the same logits as the first, the two splits must agree with an eager split, and HF with both. (The
crash came from Inductor's copy of the tap stores' slot views, pytorch/pytorch#192226; bench/RESULTS.md section 30.)"""
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig
from ppsplit.core.ragged import RaggedStep

pytestmark = pytest.mark.gpu

BATCH, PREFIX, LEN = 32, 48, 64


def test_hf_compiled_and_both_splits_in_one_process():
    sys.path.insert(0, "bench")
    from bench.peer import hf_step
    from bench.shapes import config

    torch.manual_seed(0)
    cfg = config("llama-3.1-8b", num_hidden_layers=2, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=32000)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()

    # hf_step draws its prefix and its step's ids from the global generator: the same seed gives the splits the same
    torch.manual_seed(1)
    hf = hf_step(model, BATCH, 1, PREFIX, LEN, True, "cuda")
    torch.manual_seed(1)
    prefix = torch.randint(0, cfg.vocab_size, (BATCH, PREFIX), device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (BATCH, 1), device="cuda")

    cache = CacheConfig(batch_size=BATCH, max_len=LEN)
    splits = {name: ppsplit.split_model(model, 1, cache=cache, compile=c) for name, c in
              (("eager", False), ("graphs", False), ("graphs+compile", True))}
    # the CUDA default: projections fused, compiled or not
    assert all(s.stages[0].meta.get("ppsplit.projections") for s in splits.values())
    step = RaggedStep.lockstep(BATCH, 1, PREFIX, splits["eager"].layout).to("cuda")
    runs = {}
    for name, split in splits.items():
        with torch.no_grad():
            split(prefix, torch.arange(PREFIX, device="cuda"))  # the same prefix in every split's cache
        if name != "eager":
            graphed = split.capture(0, [BATCH])
            runs[name] = lambda graphed=graphed: graphed.step(ids.flatten(), step)[0].clone()
    with torch.no_grad():
        reference = splits["eager"](ids, torch.tensor([PREFIX], device="cuda"))[0].reshape(BATCH, -1).float()
    runs["hf+compile"] = lambda: hf()[:, -1].clone()

    first = {}
    for _ in range(4):  # interleaved: each variant's graphs replay between the others'
        for name, run in runs.items():
            with torch.no_grad():
                out = run()
            torch.cuda.synchronize()
            assert torch.isfinite(out).all(), name
            if name in first:
                assert torch.equal(out, first[name]), f"{name}: a replay gave other logits than its first"
            else:
                first[name] = out
    scale = reference.abs().max()
    for name, out in first.items():
        err = (out.float().reshape(BATCH, -1) - reference).abs().max() / scale
        assert err < 0.03, f"{name}: logits {err:.3g} (of the largest) from the eager split's"
        assert (out.float().reshape(BATCH, -1).argmax(-1) == reference.argmax(-1)).float().mean() > 0.9, name
