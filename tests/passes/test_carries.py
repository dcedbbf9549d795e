"""Values other than the residual stream that cross stage boundaries ("carries"): Gemma 4's per-layer inputs
(made once from the tokens, read by every layer) and a long skip from the embedding. Oracles: the unsplit
Hugging Face model (logits, ``output_hidden_states``, greedy ``generate``), in process, from a compiled folder,
and through two processes."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING

import ppsplit
from tests.support import hf_greedy
from ppsplit import CacheConfig, CrossingError
from tests.processes import equal_to_hf, generate, launch

V, L = 128, 6
TAPS = (1, 3, 5)  # below L: Gemma 4's hidden_states[L] is taken after the final norm, ppsplit's tap L before it

pytestmark = pytest.mark.skipif("gemma4_text" not in CONFIG_MAPPING, reason="this transformers has no gemma4_text")


def gemma4(**overrides):
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=16, max_position_embeddings=256, sliding_window=4,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=V, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma4_text", **kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.fixture(scope="module")
def model():
    return gemma4()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def expected(model, ids):
    return hf_greedy(model, ids, 8)


@pytest.fixture(scope="module")
def cached(model):
    return ppsplit.trace_model(model, cache=CacheConfig(2, 32))


def test_per_layer_inputs_are_carried_and_the_split_equals_hf(model, ids):
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    traced = ppsplit.trace_model(model)
    for pp in (2, 3):
        split = ppsplit.split_model(traced, pp, aux=list(TAPS))
        plan = split.plan
        # Every later stage receives the per-layer input of each of its layers (8 floats a layer), and nothing else.
        for k in range(1, pp):
            layers_here_and_after = L - plan.stages[k].start
            assert plan.width(k) == 64 + 8 * layers_here_and_after
            assert all(c.shape == (8,) and c.dtype == "float32" for c, _ in plan.carried(k))
        assert "carried beside the residual stream" in plan.describe()
        logits, aux = split(ids)
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        for slot, tap in enumerate(TAPS):
            torch.testing.assert_close(aux[slot], ref.hidden_states[tap], atol=1e-5, rtol=0)


@pytest.mark.parametrize("pp", [2, 3])
def test_cached_greedy_decoding_through_the_stages_equals_hf(cached, ids, expected, pp):
    split = ppsplit.split_model(cached, pp, aux=[2])
    assert torch.equal(split.generate(ids, 8), expected)


def test_carries_and_replicas_survive_compile_load_and_two_processes(ids, tmp_path):
    # Per-layer inputs and a KV cache shared across the boundary (layer 5 reads layer 3's on stage 0).
    model = gemma4(num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    checkpoint = tmp_path / "tiny-gemma4"
    model.save_pretrained(checkpoint)
    folder = ppsplit.compile_model(str(checkpoint), str(tmp_path / "pp2"), pp=2, aux=list(TAPS),
                                   cache=CacheConfig(2, 32), balance=[4, 2])
    loaded = ppsplit.load(folder)
    in_process = ppsplit.split_model(model, 2, aux=list(TAPS), cache=CacheConfig(2, 32), balance=[4, 2]).plan
    assert loaded.plan.carries == in_process.carries != () and loaded.plan.replicas == in_process.replicas != ()
    assert any(c.token_dim == 2 for c in loaded.plan.carries)
    assert torch.equal(loaded.generate(ids, 8), expected)
    # KV sharing pages its cache (the sharing layers read the owner's pools, stage 1 a replica of them), so the
    # multi-process engine serves the folder: its tokens are Hugging Face's
    assert loaded.plan.paged, loaded.plan.lockstep_reason
    results = launch(2, generate, folder, ids, 8)
    assert results[0][0] == results[1][0] == "ok", results
    first, again = results[0][1]
    assert equal_to_hf(first, expected) and again == first


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.proj = torch.nn.Linear(h, h)
        self.table = torch.nn.Embedding(32, h)

    def forward(self, x, index=None):
        x = x + torch.tanh(self.proj(x))
        return x if index is None else x + self.table(index.squeeze(-1).long())


class SkipDecoder(torch.nn.Module):
    """Adds the embedding output (a long skip) to every layer's output; ``index_skip`` also gives every layer an
    integer value made from the tokens (carried as raw bytes in float32 elements); ``pooled`` adds the mean
    embedding of the sequence instead ([B, 1, H]: no token axis)."""

    _no_split_modules = ["Block"]

    def __init__(self, hidden_size=16, index_skip=False, pooled=False):
        from types import SimpleNamespace

        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=3, vocab_size=32, max_position_embeddings=64,
                                      hidden_size=hidden_size)
        self.index_skip, self.pooled = index_skip, pooled
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(Block(16) for _ in range(3))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, input_ids, position_ids=None, use_cache=None):
        x0 = h = self.embed(input_ids)
        index = (input_ids * 7 % 32).to(torch.int32).unsqueeze(-1) if self.index_skip else None  # [B, T, 1]
        if self.pooled:  # one value per sequence, not per token
            x0 = x0.mean(dim=1, keepdim=True)
        for layer in self.layers:
            h = layer(h, index) + x0
        return (self.head(h),)


class TwinBlock(Block):
    def forward(self, x, other):
        return x + torch.tanh(self.proj(x)) + other


class TwinDecoder(torch.nn.Module):
    """Every layer reads two embeddings of the same tokens: two [B, T, H] values made in the same place."""

    _no_split_modules = ["TwinBlock"]

    def __init__(self):
        from types import SimpleNamespace

        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=2, vocab_size=32, hidden_size=16)
        self.embed, self.other = torch.nn.Embedding(32, 16), torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(TwinBlock(16) for _ in range(2))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, input_ids, position_ids=None, use_cache=None):
        h, e = self.embed(input_ids), self.other(input_ids)
        for layer in self.layers:
            h = layer(h, e)
        return (self.head(h),)


@pytest.mark.parametrize("index_skip", [False, True])
def test_a_long_skip_is_carried_through_every_later_stage(index_skip):
    torch.manual_seed(0)
    model = SkipDecoder(index_skip=index_skip).eval()
    ids = torch.randint(0, 32, (2, 5))
    split = ppsplit.split_model(model, 3, aux=[1, 2])
    carries = split.plan.carries
    assert [c.stages for c in carries] == [(1, 2)] * len(carries)
    assert sorted(c.dtype for c in carries) == (["float32", "int32"] if index_skip else ["float32"])
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], model(ids)[0], atol=1e-6, rtol=0)


def test_uncarriable_values_and_an_unknown_residual_are_named():
    # Without the config's hidden_size ppsplit cannot tell the residual stream from the skip (tests/core/test_errors.py);
    # with it but two [B, T, H] values computed in the same place, neither.
    with pytest.raises(CrossingError, match=r"2 token-dependent values enter decoder layer 0 and ppsplit cannot tell "
                                            r"which is the residual stream \(the one value shaped \[batch, tokens, 16\]"):
        ppsplit.split_model(TwinDecoder(), 2)
    # A value without a token axis (here one number per sequence) cannot travel per token.
    with pytest.raises(CrossingError, match=r"is read by .* on stage 1, .* but it is not a tensor with one dimension "
                                            r"of batch and one of tokens"):
        ppsplit.split_model(SkipDecoder(pooled=True), 2)


def test_shared_kv_across_stages_keeps_a_replica_and_equals_hf(ids):
    # Gemma's KV sharing: the last 2 layers read the keys and values of the last earlier layer of their type.
    model = gemma4(num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3)
    with torch.no_grad():
        ref = model(ids).logits
    traced = ppsplit.trace_model(model)
    for pp in (2, 3):
        split = ppsplit.split_model(traced, pp)
        # Without a cache the shared keys and values themselves ([B, heads, T, dim]) are carried.
        assert any(c.token_dim == 2 for c in split.plan.carries)
        torch.testing.assert_close(split(ids)[0], ref, atol=1e-5, rtol=0)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    cached = ppsplit.trace_model(model, cache=CacheConfig(2, 32))
    for pp in (2, 3):
        split = ppsplit.split_model(cached, pp)
        # With a cache, the later stage keeps its own copy of the shared layer's cache, written from the carried
        # new keys and values of each step.
        assert split.plan.replicas and all(s > 0 for s, _, _ in split.plan.replicas)
        assert "replica of kv_cache." in split.plan.describe()
        assert torch.equal(split.generate(ids, 8), expected), pp


def test_zamba2_shared_block_reads_the_embedding_on_every_stage():
    # Zamba2's shared attention blocks read the original embedding beside the residual stream; its Mamba-2 layers
    # keep their state in the cache's ring (tests/architectures/test_recurrent_cache.py), so it decodes through the stages too.
    if "zamba2" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no zamba2")
    torch.manual_seed(0)
    config = AutoConfig.for_model("zamba2", vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  layers_block_type=["mamba", "hybrid"] * 2, mamba_d_state=8, mamba_headdim=8,
                                  n_mamba_heads=16, mamba_ngroups=1, num_mem_blocks=1, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    traced = ppsplit.trace_model(model)
    for pp in (2, 3):
        split = ppsplit.split_model(traced, pp, aux=[1, 3])
        assert split.plan.carries and all(c.shape == (64,) for c in split.plan.carries)
        logits, aux = split(ids)
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        for slot, tap in enumerate((1, 3)):
            torch.testing.assert_close(aux[slot], ref.hidden_states[tap], atol=1e-5, rtol=0)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    cached = ppsplit.trace_model(model, cache=CacheConfig(2, 32))  # export fixes the batch to the cache's 2 rows
    for pp in (2, 3):
        split = ppsplit.split_model(cached, pp)
        assert split.plan.carries and split.plan.state_slots
        assert torch.equal(split.generate(ids, 8), expected), pp


@pytest.mark.gpu
def test_captured_stages_with_carries_and_replicas_equal_eager_on_gpu(ids):
    """bf16 on one GPU: per-layer inputs and shared keys and values carried, a cache replica on stage 1; the CUDA
    graphs replay the same greedy tokens as the eager stages, and the logits stay close."""
    model = gemma4(num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3)
    model = model.to("cuda", torch.bfloat16)
    split = ppsplit.split_model(model, 2, aux=list(TAPS), cache=CacheConfig(2, 32), balance=[4, 2])
    assert split.plan.replicas and any(c.token_dim == 2 for c in split.plan.carries)
    prompt = ids.cuda()
    eager = split.generate(prompt, 8)
    split.reset_cache()
    split.capture(2, [prompt.shape[1], 1])
    assert torch.equal(split.generate(prompt, 8), eager)


@pytest.mark.gpu
def test_nccl_two_gpus_carry_per_layer_inputs_and_shared_kv(ids, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    model = gemma4(num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3)
    model.save_pretrained(tmp_path / "ckpt")
    folder = ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "pp2"), pp=2, aux=list(TAPS),
                                   cache=CacheConfig(2, 32), balance=[4, 2])
    for cuda_graphs in (False, True):
        res = launch(2, generate, folder, [ids], 8, False, cuda_graphs, timeout=60, deadline=150, backend="nccl")
        assert res[0][0] == res[1][0] == "ok", res
        (first, again), _ = res[0][1]
        expected = ppsplit.load(folder, ["cuda:0", "cuda:0"]).generate(ids.cuda(), 8).cpu()
        assert torch.equal(first[0], expected) and torch.equal(again[0], expected), cuda_graphs
