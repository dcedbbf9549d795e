"""Short-convolution state in the stages' cache (LFM2's ``conv`` layers beside attention): kept per position like
K/V, so prefill, decode and a verify pass with rejected drafts all run through the same stages. Oracles: the
unsplit Hugging Face model (logits, ``output_hidden_states``, greedy ``generate``)."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING

import ppsplit
from tests.support import decode, hf_greedy
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
    assert torch.equal(decode(split, ids, 10), expected)


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
    assert torch.equal(decode(ppsplit.load(folder), ids, 10), expected)
    results = launch(2, generate, folder, ids, 10)
    assert results[0][0] == results[1][0] == "ok", results
    first, again = results[0][1]
    assert equal_to_hf(first, expected) and again == first


@pytest.mark.gpu
def test_captured_conv_stages_equal_eager_on_gpu(model, ids):
    import copy

    split = ppsplit.split_model(copy.deepcopy(model).to("cuda", torch.bfloat16), 2, cache=CacheConfig(2, 32))
    prompt = ids.cuda()
    eager = decode(split, prompt, 10)
    split.reset_cache()
    split.capture(2, [prompt.shape[1], 1])
    assert torch.equal(decode(split, prompt, 10), eager)


# Convolution state kept by position in several buffers per layer (conv_inputs, conv_inputs_1, ...). Inkling: four
# short convolutions per layer (keys, values, after the attention and the MLP blocks). ZAYA: its attention's q/k mixed
# by convolutions over the tokens before, and half of each value head from the token before (the model keeps only the
# last window and the last token's value, which a verify pass could not take back; ppsplit keeps them by position).
# Both keep their attention as traced (relative-position logits; the q/k convolutions are not depthwise), so their
# caches stay lockstep: traced lockstep at once.
CONV_MODELS = {
    "inkling_text": (dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=16, sliding_window_size=8, d_rel=8, rel_extent=64,
                          layer_types=["hybrid_sliding", "hybrid"], max_position_embeddings=256, intermediate_size=128,
                          mlp_layer_types=["dense"] * 2, bos_token_id=1, eos_token_id=2), 0.02, 4),
    "zaya": (dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, moe_intermediate_size=64, num_experts=4,
                  num_experts_per_tok=1, layer_types=["hybrid"] * 2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2), 0.3, 2),
}
_conv_models: dict = {}


def conv_model(arch: str):
    """(model, its lockstep cached trace, its conv buffers per layer)."""
    if arch not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {arch}")
    config, scale, buffers = CONV_MODELS[arch]
    if arch not in _conv_models:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **config)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * scale)
        _conv_models[arch] = (model, ppsplit.trace_model(model, cache=CacheConfig(2, 32), paged=False), buffers)
    return _conv_models[arch]


@pytest.mark.parametrize("arch", list(CONV_MODELS))
def test_convolution_states_split_decode_and_verify_rejected_drafts_like_hf(ids, arch):
    from tests.support import decode_through_rejected_drafts

    model, cached, count = conv_model(arch)
    want = hf_greedy(model, ids, 10)
    assert len(set(want[:, 6:].flatten().tolist())) > 4, "degenerate reference: retune the weights"
    split = ppsplit.split_model(cached, 2, aux=[0, 1])
    with torch.no_grad():  # the prompt through the cache: logits and taps as Hugging Face's
        ref = model(ids, output_hidden_states=True)
        logits, aux = split(ids, torch.arange(6))
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=1e-4)  # ZAYA's activations reach ~10
    for slot in (0, 1):
        torch.testing.assert_close(aux[slot], ref.hidden_states[slot], atol=1e-4, rtol=1e-4)
    buffers = {n for stage in split.stages for n, _ in stage.named_buffers() if n.startswith("kv_cache.")}
    names = ["conv_inputs"] + [f"conv_inputs_{i}" for i in range(1, count)]
    assert {f"kv_cache.{layer}.{name}" for layer in range(2) for name in names} <= buffers
    assert torch.equal(decode(split, ids, 10), want)
    assert torch.equal(decode_through_rejected_drafts(split, ids, want[:, 6:]), want[:, 6:])


@pytest.mark.parametrize("arch", list(CONV_MODELS))
def test_convolution_states_compile_to_a_folder_that_decodes_like_hf(ids, arch, tmp_path):
    model, _, _ = conv_model(arch)
    model.save_pretrained(tmp_path / "ckpt")
    folder = ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "pp2"), pp=2, cache=CacheConfig(2, 32))
    assert torch.equal(decode(ppsplit.load(folder), ids, 10), hf_greedy(model, ids, 10))
