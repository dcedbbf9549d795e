"""Short-convolution state in the stages' cache (LFM2's ``conv`` layers beside attention): kept per position like
K/V, so prefill, decode and a verify pass with rejected drafts all run through the same stages. Oracles: the
unsplit Hugging Face model (logits, ``output_hidden_states``, greedy ``generate``)."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING

import ppsplit
from tests.support import hf_greedy
from ppsplit import CacheConfig

V = 128
pytestmark = pytest.mark.skipif("lfm2" not in CONFIG_MAPPING, reason="this transformers has no lfm2")


@pytest.fixture(scope="module")
def model():
    config = AutoConfig.for_model("lfm2", vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  layer_types=["conv", "full_attention"] * 3, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def expected(model, ids):
    return hf_greedy(model, ids, 10)


@pytest.fixture(scope="module")
def cached(model):
    return ppsplit.trace_model(model, cache=CacheConfig(2, 32))


def test_split_with_taps_equals_hf(model, ids):
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    traced = ppsplit.trace_model(model)
    for pp in (2, 3):
        logits, aux = ppsplit.split_model(traced, pp, aux=[1, 2, 4])(ids)
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        for slot, tap in enumerate((1, 2, 4)):
            torch.testing.assert_close(aux[slot], ref.hidden_states[tap], atol=1e-5, rtol=0)


@pytest.mark.parametrize("pp", [2, 3])
def test_cached_greedy_decoding_equals_hf(cached, ids, expected, pp):
    split = ppsplit.split_model(cached, pp, aux=[2])
    # Every conv layer's stage holds its inputs per position; attention layers their keys and values.
    buffers = {n for stage in split.stages for n, _ in stage.named_buffers() if n.startswith("kv_cache.")}
    assert {f"kv_cache.{i}.conv_inputs" for i in (0, 2, 4)} <= buffers
    assert {f"kv_cache.{i}.keys" for i in (1, 3, 5)} <= buffers
    assert torch.equal(split.generate(ids, 10), expected)


def test_verify_pass_with_rejected_drafts_then_decoding_equals_hf(cached, ids, expected):
    """Prefill, one verify pass of [committed token, right draft, two wrong drafts] (the wrong ones write conv
    inputs at positions 8 and 9), then one-token steps from position 8: the conv windows must read the accepted
    inputs, not the rejected ones, and the tokens equal HF's greedy continuation."""
    split = ppsplit.split_model(cached, 2)
    split.reset_cache()
    greedy = expected[:, 6:]
    with torch.no_grad():
        split(ids, torch.arange(6))
        wrong = (greedy[:, 2:4] + 1) % V
        window = torch.cat([greedy[:, :2], wrong], dim=1)  # positions 6..9
        logits, _ = split(window, torch.arange(6, 10))
        picked = logits.argmax(-1)
        assert torch.equal(picked[:, :2], greedy[:, 1:3])  # rows 0, 1 verify: draft 1 accepted, next is greedy[2]
        assert not torch.equal(picked[:, 2:], greedy[:, 3:5])  # rows after a wrong draft follow the wrong context
        tokens, token = [greedy[:, :2], picked[:, 1:2]], picked[:, 1:2]
        for position in range(8, 15):  # overwrites positions 8 and 9, which the rejected drafts wrote
            logits, _ = split(token, torch.tensor([position]))
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
    assert torch.equal(torch.cat(tokens, dim=1)[:, :10], greedy)


def test_conv_state_survives_compile_load_and_two_processes(model, ids, expected, tmp_path):
    from tests.processes import equal_to_hf, generate, launch

    model.save_pretrained(tmp_path / "ckpt")
    folder = ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "pp2"), pp=2, cache=CacheConfig(2, 32))
    assert torch.equal(ppsplit.load(folder).generate(ids, 10), expected)
    results = launch(2, generate, folder, ids, 10)
    assert results[0][0] == results[1][0] == "ok", results
    first, again = results[0][1]
    assert equal_to_hf(first, expected) and again == first


@pytest.mark.gpu
def test_captured_conv_stages_equal_eager_on_gpu(model, ids):
    import copy

    split = ppsplit.split_model(copy.deepcopy(model).to("cuda", torch.bfloat16), 2, cache=CacheConfig(2, 32))
    prompt = ids.cuda()
    eager = split.generate(prompt, 10)
    split.reset_cache()
    split.capture(2, [prompt.shape[1], 1])
    assert torch.equal(split.generate(prompt, 10), eager)


# Inkling: four short convolutions per layer (keys, values, and after the attention and MLP blocks), each keeping
# its inputs by position in its own buffer (conv_inputs, conv_inputs_1, ..._3).
INKLING = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
               sliding_window_size=8, d_rel=8, rel_extent=64, layer_types=["hybrid_sliding", "hybrid"],
               max_position_embeddings=256, intermediate_size=128, mlp_layer_types=["dense"] * 2, bos_token_id=1,
               eos_token_id=2)
_inkling: dict = {}


def inkling():
    if "inkling_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no inkling_text")
    if not _inkling:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("inkling_text", **INKLING)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        # Its relative-position logits keep its attention as traced, so the cache cannot be paged: trace it lockstep.
        _inkling.update(model=model, cached=ppsplit.trace_model(model, cache=CacheConfig(2, 32), paged=False))
    return _inkling["model"], _inkling["cached"]


def test_inkling_splits_decodes_and_verifies_rejected_drafts_like_hf(ids):
    from tests.support import decode_through_rejected_drafts

    model, cached = inkling()
    want = hf_greedy(model, ids, 10)
    assert len(set(want[:, 6:].flatten().tolist())) > 4, "degenerate reference: retune the weights"
    split = ppsplit.split_model(cached, 2, aux=[0, 1])
    with torch.no_grad():  # the prompt through the cache: logits and taps as Hugging Face's
        ref = model(ids, output_hidden_states=True)
        logits, aux = split(ids, torch.arange(6))
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
    for slot in (0, 1):
        torch.testing.assert_close(aux[slot], ref.hidden_states[slot], atol=1e-5, rtol=0)
    buffers = {n for stage in split.stages for n, _ in stage.named_buffers() if n.startswith("kv_cache.")}
    assert {f"kv_cache.{i}.conv_inputs{s}" for i in range(2) for s in ("", "_1", "_2", "_3")} <= buffers
    assert torch.equal(split.generate(ids, 10), want)
    assert torch.equal(decode_through_rejected_drafts(split, ids, want[:, 6:]), want[:, 6:])


def test_inkling_compiles_to_a_folder_that_decodes_like_hf(ids, tmp_path):
    model, _ = inkling()
    model.save_pretrained(tmp_path / "ckpt")
    folder = ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "pp2"), pp=2, cache=CacheConfig(2, 32))
    assert torch.equal(ppsplit.load(folder).generate(ids, 10), hf_greedy(model, ids, 10))
