"""Static KV cache through the stages: prefill, decode and verification against Hugging Face's own decoding."""
import pytest
import torch

import ppsplit
from ppsplit import CacheConfig, ConfigError
from tests.support import ARCHS, VOCAB, tiny_model, traced_with_cache

CACHE = CacheConfig(batch_size=2, max_len=48)
def cached(arch):
    return traced_with_cache(arch, CACHE)


def hf_greedy(model, ids, new_tokens):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False)


@pytest.mark.parametrize("arch,pp", [(a, 2 + i % 3) for i, a in enumerate(ARCHS)])
def test_greedy_generate_matches_hf(arch, pp):
    model, traced = cached(arch)
    split = ppsplit.split_model(traced, pp, aux=[1, 3])
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 7))
    expected = hf_greedy(model, ids, 16)
    out = split.generate(ids, 16)
    assert torch.equal(out, expected), f"{arch} pp={pp}:\n{out[:, 7:]}\n{expected[:, 7:]}"
    # A smaller batch than the cache holds uses its leading rows.
    assert torch.equal(split.generate(ids[:1], 16), hf_greedy(model, ids[:1], 16))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2", "mixtral"])
def test_verify_with_rejected_drafts_then_decode(arch):
    """Prefill, one verification step of K=4 drafts whose last two are wrong, then decode: the accepted
    tokens and everything after equal HF greedy decoding; the stale cache entries are simply overwritten."""
    model, traced = cached(arch)
    split = ppsplit.split_model(traced, 3, aux=[0, 2, 5])
    torch.manual_seed(1)
    prompt = torch.randint(3, VOCAB, (1, 6))
    T = prompt.shape[1]
    reference = hf_greedy(model, prompt, 14)[0, T:]  # the tokens greedy decoding produces

    logits, _ = split(prompt, torch.arange(T))
    first = logits[0, -1].argmax()
    assert first == reference[0]
    wrong = (reference[3:5] + 1) % VOCAB
    drafts = torch.cat([reference[1:3], wrong])  # d1, d2 right; d3, d4 wrong
    verify_in = torch.cat([first[None], drafts])[None]  # K + 1 = 5 tokens
    logits, aux = split(verify_in, torch.arange(T, T + 5))
    preds = logits[0].argmax(-1)
    # Verification logits equal the unsplit model's on the same (teacher-forced) sequence.
    with torch.no_grad():
        full = model(torch.cat([prompt, verify_in], 1), output_hidden_states=True)
    torch.testing.assert_close(logits[0], full.logits[0, T:], atol=1e-4, rtol=1e-4)
    for slot, tap in enumerate((0, 2)):
        torch.testing.assert_close(aux[slot, 0], full.hidden_states[tap][0, T:], atol=1e-4, rtol=1e-4)
    assert not aux.isnan().any()
    accepted = 0
    while accepted < 4 and preds[accepted] == drafts[accepted]:
        accepted += 1
    assert accepted == 2
    bonus = preds[accepted]  # the target's own token after the accepted drafts
    assert bonus == reference[3]

    # Continue decoding from the accepted position: positions T+3.. overwrite the rejected drafts' entries.
    tokens = [first, *drafts[:accepted], bonus]
    pos = T + accepted + 1
    while len(tokens) < len(reference):
        logits, _ = split(tokens[-1].view(1, 1), torch.tensor([pos]))
        tokens.append(logits[0, -1].argmax())
        pos += 1
    assert torch.equal(torch.stack(tokens), reference)


def test_stages_own_their_layers_cache():
    model, traced = cached("llama")
    split = ppsplit.split_model(traced, 3)
    for stage, sp in zip(split.stages, split.plan.stages):
        caches = {n for n, _ in stage.named_buffers() if n.startswith("kv_cache.")}
        assert caches == {f"kv_cache.{i}.{kind}" for i in range(sp.start, sp.end) for kind in ("keys", "values")}
        assert not any(n.startswith("kv_cache.") for n in stage.state_dict())  # state, not weights
        keys = dict(stage.named_buffers())[f"kv_cache.{sp.start}.keys"]
        assert keys.shape == (CACHE.pool_blocks, CACHE.block_size, 2, 16)  # the paged pool: blocks x positions
        assert sp.cache_bytes == 2 * sp.num_layers * keys.numel() * keys.element_size()
    assert split.plan.max_batch == 2 and split.plan.max_len == 48


def test_one_module_serves_prefill_decode_and_verify():
    model, traced = cached("qwen3")
    split = ppsplit.split_model(traced, 2, aux=[2])
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
    chunks = [(0, 8), (8, 9), (9, 12)]  # prefill 8, decode 1, verify 3
    for lo, hi in chunks:
        logits, aux = split(ids[:, lo:hi], torch.arange(lo, hi))
        torch.testing.assert_close(logits, full[:, lo:hi], atol=1e-4, rtol=1e-4)
        assert aux.shape == (1, 2, hi - lo, 64)


def test_generate_errors():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="has no KV cache: pass cache=CacheConfig"):
        ppsplit.split_model(model, 2).generate(torch.zeros(1, 3, dtype=torch.long), 2)
    _, traced = cached("llama")
    split = ppsplit.split_model(traced, 2)
    with pytest.raises(ConfigError, match="needs 50 positions, but a sequence of the cache holds 48"):
        split.generate(torch.zeros(1, 40, dtype=torch.long), 10)
    with pytest.raises(ConfigError, match="CacheConfig.max_len must be a positive integer"):
        CacheConfig(batch_size=1, max_len=0)


def test_placing_a_split_leaves_the_other_splits_of_its_trace_where_they_are():
    # Splits of one trace share their Parameter objects; Module.to would move them in place, under the other split.
    model = tiny_model("llama")
    graph = ppsplit.trace_model(model, cache=CacheConfig(2, 32))
    kept, moved = ppsplit.split_model(graph, 2), ppsplit.split_model(graph, 2)
    moved.place(["meta", "meta"])
    assert {t.device.type for s in moved.stages for t in [*s.parameters(), *s.buffers()]} == {"meta"}
    assert {t.device.type for s in kept.stages for t in [*s.parameters(), *s.buffers()]} == {"cpu"}
    ids = torch.randint(3, 100, (2, 5))
    with torch.no_grad():
        assert torch.equal(kept.generate(ids, 6), model.generate(ids, max_new_tokens=6, do_sample=False))
