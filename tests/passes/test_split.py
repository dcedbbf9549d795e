"""The split model against the unsplit Hugging Face model: logits and every tap, fp32 on the CPU."""
import pytest
import torch

import ppsplit
from ppsplit.passes.plan import plan as make_plan
from tests.support import ARCHS, NUM_LAYERS, VOCAB, last_layer_output, reference, run_stages

L = NUM_LAYERS


def interesting_taps(plan):
    """0, every stage's first and last layer, L-1 and L, plus a duplicate."""
    taps = {0, L - 1, L}
    for s in plan.stages:
        taps |= {s.start, s.end - 1}
    return sorted(taps) + [L]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_split_matches_hf(traced_cache, arch, pp):
    model, traced = traced_cache(arch)
    taps = interesting_taps(make_plan(traced, pp))
    split = ppsplit.split_model(traced, pp, aux=taps)
    assert split.plan.taps == tuple(sorted(set(taps)))

    torch.manual_seed(pp)
    for batch, tokens in ((2, 9), (1, 1), (3, 4)):
        ids = torch.randint(3, VOCAB, (batch, tokens))
        positions = torch.arange(tokens)
        ref_logits, ref_hidden = reference(model, ids)
        ref_last = last_layer_output(model, ids)
        with torch.no_grad():
            logits, aux, inputs = run_stages(split, ids, positions)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        for slot, tap in enumerate(split.plan.taps):
            expected = ref_last if tap == L else ref_hidden[tap]
            torch.testing.assert_close(aux[slot], expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"tap {tap}: {m}")
        # What crosses each boundary is exactly the residual stream entering the next stage's first layer.
        for stage, x in zip(split.plan.stages[1:], inputs[1:]):
            torch.testing.assert_close(x, ref_hidden[stage.start], atol=1e-5, rtol=1e-5)

        # The sequential runner gives the same result.
        with torch.no_grad():
            logits2, aux2 = split(ids)
        torch.testing.assert_close(logits2, logits, atol=0, rtol=0)
        torch.testing.assert_close(aux2, aux, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "opt"])
def test_explicit_positions(traced_cache, arch):
    """Positions that do not start at 0 flow to every stage (rotary and learned position embeddings)."""
    model, traced = traced_cache(arch)
    split = ppsplit.split_model(traced, 3, aux=[1, 3, L])
    ids = torch.randint(3, VOCAB, (2, 6))
    positions = torch.arange(5, 11)
    ref_logits, ref_hidden = reference(model, ids, positions)
    with torch.no_grad():
        logits, aux, _ = run_stages(split, ids, positions)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[0], ref_hidden[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[2], last_layer_output(model, ids, positions), atol=1e-5, rtol=1e-5)


def test_drafter_inputs_layout(traced_cache):
    model, traced = traced_cache("qwen3")
    split = ppsplit.split_model(traced, 2, aux=[4, 1, 3])
    ids = torch.randint(3, VOCAB, (2, 5))
    with torch.no_grad():
        _, aux = split(ids)
    feats = split.drafter_inputs(aux)
    _, hidden = reference(model, ids)
    assert feats.shape == (2, 5, 3 * 64)
    expected = torch.cat([hidden[1], hidden[3], hidden[4]], dim=-1)  # ascending tap ids, EAGLE-3 layout
    torch.testing.assert_close(feats, expected, atol=1e-5, rtol=1e-5)


def test_no_taps_gives_empty_aux(traced_cache):
    model, traced = traced_cache("llama")
    split = ppsplit.split_model(traced, 2)
    ids = torch.randint(3, VOCAB, (1, 4))
    with torch.no_grad():
        logits, aux = split(ids)
    assert aux.shape == (0, 1, 4, 64)
    torch.testing.assert_close(logits, reference(model, ids)[0], atol=1e-5, rtol=1e-5)


def test_eagle3_default_and_sglang_convention(traced_cache):
    _, traced = traced_cache("llama")
    eagle = ppsplit.split_model(traced, 2, aux="eagle3").plan.taps
    assert eagle == tuple(sorted({2, L // 2, L - 3}))
    sglang = ppsplit.split_model(traced, 2, aux=[0, 2], aux_convention="sglang").plan.taps
    assert sglang == (1, 3)
