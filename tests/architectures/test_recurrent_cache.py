"""Recurrent state in the stages' cache: Gated DeltaNet (Qwen3-Next), Kimi's delta attention (Kimi-Linear),
Mamba-2 (Nemotron-H), Mamba-1 (Falcon-Mamba), MiniMax's lightning attention, RecurrentGemma's RG-LRU, RWKV-4's WKV
and xLSTM's mLSTM layers keep a ring of states addressed by position, so prefill,
decode and a verify pass with rejected drafts run through the same stages. Oracles: the unsplit Hugging Face model (logits,
``output_hidden_states``, greedy ``generate``), which runs its own chunked scans and one-token recurrent steps."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING

import ppsplit
from ppsplit import CacheConfig
from ppsplit.core.errors import ConfigError
from tests.support import decode

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
CONFIGS = {
    "qwen3_next": dict(intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "nemotron_h": dict(intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=8,
                       mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=16),
    "falcon_mamba": dict(num_hidden_layers=3, state_size=8, intermediate_size=128),
    "kimi_linear": dict(intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
                        qk_nope_head_dim=8, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
                        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_head_dim=16,
                        linear_num_heads=4, linear_conv_kernel_dim=4),
}
CONFIGS.update({
    # MiniMax's lightning attention; a block of 4 tokens makes Hugging Face's prefill span several blocks.
    "minimax": dict(intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, layer_types=["linear_attention", "full_attention"] * 2, num_local_experts=4,
                    num_experts_per_tok=2, block_size=4),
    # RecurrentGemma: RG-LRU recurrent blocks (a short convolution, then the gated linear recurrence) and local
    # attention.
    "recurrent_gemma": dict(intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, lru_width=64, conv1d_width=4, attention_window_size=16,
                            block_types=["recurrent", "recurrent", "attention"]),
    # RWKV-4: the WKV recurrence, and two token shifts per layer (time mix, channel mix) kept by position.
    "rwkv": dict(num_hidden_layers=4, attention_hidden_size=64, intermediate_size=128),
    # xLSTM: mLSTM blocks (matrix memory, exponential gating); chunks of 4 make Hugging Face's prefill chunkwise.
    "xlstm": dict(embedding_dim=64, num_hidden_layers=4, num_blocks=4, num_heads=4, chunk_size=4, qk_dim_factor=1.0),
})
RECURRENT = {"qwen3_next": (0, 2), "nemotron_h": (0, 2), "falcon_mamba": (0, 1, 2),  # layers with a ring of states
             "kimi_linear": (0, 1, 2),  # Kimi's delta attention: a decay per key channel
             "minimax": (0, 2), "recurrent_gemma": (0, 1, 3), "rwkv": (0, 1, 2, 3), "xlstm": (0, 1, 2, 3)}
NO_CONV = {"minimax", "xlstm"}  # recurrent layers without a short convolution
SCALE = {"falcon_mamba": 0.2, "minimax": 0.2, "recurrent_gemma": 0.3,  # random weights that make greedy tokens vary
         "xlstm": 0.1}
# Hugging Face records Mamba's and RWKV's hidden states after each layer: its index j is the output of layer j
# (tap j + 1).
TAP_OFFSET = {"falcon_mamba": 1, "rwkv": 1}
# Hugging Face's own one-token RWKV step mixes the rows of a batch (it broadcasts the kept [B, C] shift against the
# [B, 1, C] token: modeling_rwkv.py, extract_key_value), so its batched generate is not the model's greedy
# continuation; the oracle is the uncached forward, token by token (and batch-1 generate, below).
UNCACHED_ORACLE = {"rwkv"}
ARCHS = [a for a in CONFIGS if a in CONFIG_MAPPING]

_models = {}


def build(arch: str) -> torch.nn.Module:
    if arch not in _models:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **CONFIGS[arch], **COMMON)).eval()
        with torch.no_grad():  # random weights large enough that greedy tokens vary
            for p in model.parameters():
                p.add_(torch.randn_like(p) * SCALE.get(arch, 0.02))
        _models[arch] = model
    return _models[arch]


_traced = {}


def cached(arch: str):
    if arch not in _traced:
        _traced[arch] = ppsplit.trace_model(build(arch), cache=CacheConfig(2, 32))
    return _traced[arch]


IDS = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(1))
_expected = {}


def expected(arch: str) -> torch.Tensor:
    if arch not in _expected:
        with torch.no_grad():
            if arch in UNCACHED_ORACLE:
                out = IDS
                for _ in range(10):
                    out = torch.cat([out, build(arch)(out).logits[:, -1:].argmax(-1)], dim=1)
                _expected[arch] = out
            else:
                _expected[arch] = build(arch).generate(IDS, max_new_tokens=10, do_sample=False)
        assert len(set(_expected[arch][:, 6:].flatten().tolist())) > 4, "degenerate reference: retune the weights"
    return _expected[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_split_with_taps_equals_hf(arch):
    model = build(arch)
    with torch.no_grad():
        ref = model(IDS, output_hidden_states=True)
    traced = ppsplit.trace_model(model)
    taps = (1, 2)
    for pp in (2, 3):
        logits, aux = ppsplit.split_model(traced, pp, aux=list(taps))(IDS)
        torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
        for slot, tap in enumerate(taps):
            torch.testing.assert_close(aux[slot], ref.hidden_states[tap - TAP_OFFSET.get(arch, 0)], atol=1e-4, rtol=0)


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_greedy_decoding_equals_hf(arch, pp):
    split = ppsplit.split_model(cached(arch), pp)
    buffers = {n: b for stage in split.stages for n, b in stage.named_buffers() if n.startswith("kv_cache.")}
    for layer in RECURRENT[arch]:  # each recurrent layer: its conv inputs by position and its ring of states
        ring = buffers[f"kv_cache.{layer}.states"]
        assert ring.shape[:2] == (2, split.plan.state_slots) and ring.dtype == torch.float32
        assert (f"kv_cache.{layer}.conv_inputs" in buffers) == (arch not in NO_CONV)
    assert split.plan.state_slots == 8
    assert torch.equal(decode(split, IDS, 10), expected(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_pass_with_rejected_drafts_then_decoding_equals_hf(arch):
    """Prefill, one verify pass of [committed token, right draft, two wrong drafts] (the wrong ones update every
    recurrent state), then one-token steps from the first wrong position: each step must start from the state after
    the accepted draft, not after the rejected ones, and the tokens equal HF's greedy continuation. A second verify
    pass rejects all its drafts."""
    from tests.support import decode_through_rejected_drafts

    split = ppsplit.split_model(cached(arch), 2)
    greedy = expected(arch)[:, 6:]
    assert torch.equal(decode_through_rejected_drafts(split, IDS, greedy), greedy)


@pytest.mark.parametrize("arch", [a for a in ("qwen3_next", "nemotron_h") if a in ARCHS])
def test_speculative_decoding_with_an_eagle3_drafter_equals_hf_greedy(arch, tmp_path):
    """EAGLE-3 through pp=2 stages of a hybrid: every verify pass that rejects drafts leaves the recurrent states of
    the rejected tokens in the ring, and the next pass must start from the state after the last accepted one. With
    K = 7 a verify pass fills all 8 slots; K = 8 does not fit and is refused."""
    from tests.support import drafter_config, random_drafter_tensors, write_drafter

    model = build(arch)
    split = ppsplit.split_model(cached(arch), 2, aux=[1, 2, 4])
    cfg = drafter_config(model.config, aux_ids=[0, 1, 3])
    folder = write_drafter(str(tmp_path / "drafter"), cfg, random_drafter_tensors(cfg), "safetensors")
    drafter = ppsplit.load_drafter(folder, split=split)
    with torch.no_grad():
        want = model.generate(IDS, max_new_tokens=16, do_sample=False)
    for k in (3, 7):
        out, stats = split.generate(IDS, 16, drafter=drafter, num_draft_tokens=k, return_stats=True)
        assert torch.equal(out, want), f"{arch} K={k}:\n{out[:, 6:]}\n{want[:, 6:]}"
        assert stats.verify_passes > 0 and sum(stats.accepted) < k * stats.verify_passes  # drafts were rejected
    with pytest.raises(ConfigError, match=r"num_draft_tokens <= 7"):
        split.generate(IDS, 16, drafter=drafter, num_draft_tokens=8)


def test_verify_longer_than_the_ring_is_refused():
    from ppsplit.serve.speculative import check_speculation

    plan = ppsplit.split_model(cached(ARCHS[0]), 2).plan
    check_speculation(plan, plan.state_slots - 1)  # K + 1 = slots fits
    with pytest.raises(ConfigError, match=r"num_draft_tokens <= 7"):
        check_speculation(plan, plan.state_slots)


def test_the_ring_size_follows_the_cache_config():
    from ppsplit.serve.speculative import check_speculation

    arch = "falcon_mamba" if "falcon_mamba" in ARCHS else ARCHS[0]
    split = ppsplit.split_model(build(arch), 2, cache=CacheConfig(2, 32, state_slots=4))
    rings = [b for stage in split.stages for n, b in stage.named_buffers() if n.endswith(".states")]
    assert rings and all(r.shape[1] == 4 for r in rings) and split.plan.state_slots == 4
    assert torch.equal(decode(split, IDS, 10), expected(arch))
    check_speculation(split.plan, 3)
    with pytest.raises(ConfigError, match=r"num_draft_tokens <= 3"):
        check_speculation(split.plan, 4)
    with pytest.raises(ConfigError, match="CacheConfig.state_slots must be a positive integer"):
        CacheConfig(2, 32, state_slots=0)


def test_recurrent_state_survives_compile_load_and_two_processes(tmp_path):
    from tests.processes import equal_to_hf, generate, launch

    arch = "nemotron_h" if "nemotron_h" in ARCHS else ARCHS[0]
    build(arch).save_pretrained(tmp_path / "ckpt")
    folder = ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "pp2"), pp=2, cache=CacheConfig(2, 32))
    loaded = ppsplit.load(folder)
    assert loaded.plan.state_slots == 8
    assert torch.equal(decode(loaded, IDS, 10), expected(arch))
    results = launch(2, generate, folder, IDS, 10)
    assert results[0][0] == results[1][0] == "ok", results
    first, again = results[0][1]
    assert equal_to_hf(first, expected(arch)) and again == first


def test_a_recurrence_without_a_routed_scan_is_refused_before_tracing():
    """A decay parameter (``A_log``) outside every routed mixer means a recurrence whose state the cache would not
    keep: refused before any trace, rather than decoded from a zero state."""
    from tests.support import tiny_model

    model = tiny_model("llama")
    model.model.layers[1].mlp.A_log = torch.nn.Parameter(torch.zeros(4))  # a recurrence ppsplit does not know
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp \(LlamaMLP\).*does not route to its state cache"):
        ppsplit.trace_model(model, cache=CacheConfig(2, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_captured_recurrent_stages_equal_eager_on_gpu(arch):
    import copy

    if arch not in ARCHS:
        pytest.skip(f"this transformers has no {arch}")
    model = copy.deepcopy(build(arch)).to("cuda", torch.bfloat16)
    split = ppsplit.split_model(model, 2, cache=CacheConfig(2, 32))
    prompt = IDS.cuda()
    eager = decode(split, prompt, 10)
    split.reset_cache()
    split.capture(2, [prompt.shape[1], 1])
    assert torch.equal(decode(split, prompt, 10), eager)


def _scan_cases(device):
    """(name, reference, kernel, args, ring position) for each scan, with a step longer than the ring (12 > 8
    tokens), one verify-sized step mid-sequence, and one decode token; Mamba-1's inputs are strided views as the
    model passes them."""
    from ppsplit.triton_kernels import recurrent as r

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    for tokens, start in ((12, 0), (5, 9), (1, 14)):
        batch, slots = 2, 8
        positions = torch.arange(start, start + tokens, device=device)
        yield ("gated_delta", r.gated_delta_reference, r.launch_gated_delta,
               (rand(batch, tokens, 2, 16), rand(batch, tokens, 2, 16), rand(batch, tokens, 4, 24),
                -rand(batch, tokens, 4).abs(), rand(batch, tokens, 4).sigmoid()),
               rand(3, slots, 4, 16, 24), positions, (True,))
        yield ("kimi_delta", r.gated_delta_reference, r.launch_gated_delta,  # a decay per key channel
               (rand(batch, tokens, 4, 16), rand(batch, tokens, 4, 16), rand(batch, tokens, 4, 24),
                -rand(batch, tokens, 4, 16).abs(), rand(batch, tokens, 4).sigmoid()),
               rand(3, slots, 4, 16, 24), positions, (True,))
        yield ("mamba2", r.ssm_scan_reference, r.launch_ssm_scan,
               (rand(batch, tokens, 4, 8), rand(batch, tokens, 4).abs(), -rand(4).abs(), rand(batch, tokens, 2, 16),
                rand(batch, tokens, 2, 16)), rand(3, slots, 4, 8, 16), positions, ())
        yield ("lightning", r.gated_delta_reference, r.launch_gated_delta,  # no delta rule, a fixed decay per head
               (rand(batch, tokens, 3, 16), rand(batch, tokens, 3, 16), rand(batch, tokens, 3, 24),
                -rand(1, 1, 3).abs().expand(batch, tokens, 3), None), rand(3, slots, 3, 16, 24), positions, (False,))
        yield ("lru", r.linear_recurrence_reference, r.launch_linear_recurrence,
               (rand(batch, tokens, 37), rand(batch, tokens, 37).sigmoid()), rand(3, slots, 37), positions, ())
        yield ("wkv", r.wkv_reference, r.launch_wkv,  # keys large enough that the max-scaling matters
               (rand(37), rand(37), 30 * rand(batch, tokens, 37), rand(batch, tokens, 37)),
               torch.stack([rand(3, slots, 37).abs(), rand(3, slots, 37).abs() + 1, rand(3, slots, 37)], 2),
               positions, ())
        yield ("mlstm", r.mlstm_reference, r.launch_mlstm,
               (rand(batch, tokens, 3, 16), rand(batch, tokens, 3, 16), rand(batch, tokens, 3, 40),
                3 * rand(batch, tokens, 3), 3 * rand(batch, tokens, 3)),
               torch.cat([rand(3, slots, 3, 16, 41), rand(3, slots, 3, 1, 1).expand(3, slots, 3, 16, 1)], -1),
               positions, (1e-6,))
        yield ("mamba1", r.ssm_scan_reference, r.launch_ssm_scan,
               (rand(batch, 6, tokens).transpose(1, 2)[..., None], rand(batch, 6, tokens).abs().transpose(1, 2),
                -rand(6, 16).abs(), rand(batch, 16, tokens).transpose(1, 2)[:, :, None],
                rand(batch, 16, tokens).transpose(1, 2)[:, :, None]), rand(3, slots, 6, 1, 16), positions, ())


def _check_kernels(device):
    """Each kernel (float32) against its reference run in float64 on the same inputs."""
    for name, reference, kernel, args, ring, positions, extra in _scan_cases(device):
        ring_ref = ring.double()
        want = reference(*(a.double() if a is not None else a for a in args), ring_ref, positions, *extra)
        got = kernel(*args, ring, positions, *extra)
        torch.testing.assert_close(got, want.to(got.dtype), atol=5e-5, rtol=1e-5, msg=f"{name} output")
        torch.testing.assert_close(ring, ring_ref.float(), atol=5e-5, rtol=1e-5, msg=f"{name} ring")  # written slots


def test_scan_kernels_interpreted_equal_the_reference():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 (set by conftest)")
    _check_kernels("cpu")


@pytest.mark.gpu
def test_scan_kernels_on_gpu_equal_the_reference():
    _check_kernels("cuda")


NEW_RINGS = [a for a in ("minimax", "recurrent_gemma", "rwkv", "xlstm") if a in ARCHS]


@pytest.mark.skipif("rwkv" not in ARCHS, reason="this transformers has no rwkv")
def test_rwkv_one_sequence_decodes_like_hf_generate():
    """Batch 1, where Hugging Face's stateful one-token step is right: its generate is the oracle itself."""
    split = ppsplit.split_model(cached("rwkv"), 2)
    with torch.no_grad():
        want = build("rwkv").generate(IDS[:1], max_new_tokens=10, do_sample=False)
    assert torch.equal(decode(split, IDS[:1], 10), want) and torch.equal(want, expected("rwkv")[:1])


@pytest.mark.parametrize("arch", NEW_RINGS)
def test_compiled_folder_keeps_the_rings_and_decodes_like_hf(arch, tmp_path):
    build(arch).save_pretrained(tmp_path / "ckpt")
    folder = ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "pp2"), pp=2, cache=CacheConfig(2, 32))
    loaded = ppsplit.load(folder)
    assert loaded.plan.state_slots == 8 and loaded.plan.paged, loaded.plan.lockstep_reason
    assert torch.equal(decode(loaded, IDS, 10), expected(arch))


@pytest.mark.parametrize("arch", NEW_RINGS)
def test_the_engine_serves_requests_arriving_at_different_steps_like_hf_alone(arch):
    """Continuous batching over the paged cache: prefill chunks, decode steps of other requests and a slot freed
    and reused in the same ragged steps; each sequence slot has its own ring of states."""
    import random

    from ppsplit.serve.engine import Engine
    from ppsplit.serve.sampling import SamplingParams

    model = build(arch)
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(batch_size=2, max_len=40,
                                                                            block_size=16)), 2)
    engine = Engine(split, max_num_batched_tokens=12)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, V) for _ in range(rng.randrange(2, 20))] for _ in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs, ids, step = {}, {}, 0
    while len(outputs) < len(prompts):
        if step < len(prompts):  # one new request a step, more than the two slots hold
            ids[engine.add_request(prompts[step], params)] = step
        outputs.update({ids[o.request_id]: o.token_ids for o in engine.step() if o.finished})
        step += 1
    for i, prompt in enumerate(prompts):
        with torch.no_grad():  # one sequence: Hugging Face's own generate is right for RWKV too
            want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert outputs[i] == want[0, len(prompt):].tolist(), i
