"""EAGLE-3 on the last stage: drafter loading, its forward against an independent reference, lossless speculative
decoding (greedy and sampling), a drafter trained here reaching real acceptance, errors, and the CLI."""
import math

import pytest
import torch
import torch.nn.functional as F

import ppsplit
from ppsplit import CacheConfig, ConfigError
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams, accept_sampled
from tests.support import drafter_config, random_drafter_tensors, write_drafter
from tests.support import VOCAB, tiny_model
from tests.serve.test_decode import CACHE, cached  # the same traced models as the decoding tests

SPEC_IDS = [0, 1, 3]  # eagle_aux_hidden_state_layer_ids as SpecForge writes them (layer outputs)
TAPS = [1, 2, 4]  # the same tensors in ppsplit numbering (+1)
_MODELS: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def traced(name):
    """(model, traced graph with a KV cache): llama and qwen3 shared with test_decode, plus a tied-embedding qwen3
    and a 32-token target for the training and sampling tests."""
    if name in ("llama", "qwen3"):
        return cached(name)
    if name not in _MODELS:
        if name == "qwen3_tied":
            model, cache = tiny_model("qwen3", tie_word_embeddings=True), CACHE
        else:  # "small": vocabulary 32 and no end-of-sequence token, a big batch for sampling statistics
            model, cache = tiny_model("llama", vocab_size=32, eos_token_id=None), CacheConfig(batch_size=2000, max_len=48)
        _MODELS[name] = (model, ppsplit.trace_model(model, cache=cache))
    return _MODELS[name]


def hf_greedy(model, ids, new_tokens):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False)


def drafter_on_disk(tmp_path, model, layout, seed=0, name=None, draft_vocab=None, **overrides):
    cfg = drafter_config(model.config, aux_ids=SPEC_IDS, draft_vocab=draft_vocab or model.config.vocab_size * 3 // 4,
                         **overrides)
    tensors = random_drafter_tensors(cfg, seed=seed)
    return write_drafter(str(tmp_path / (name or f"drafter-{layout}-{seed}")), cfg, tensors, layout), cfg, tensors


# -- lossless greedy decoding through 1, 2, 3 stages ----------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_tied"])
def test_speculative_greedy_equals_target_greedy(arch, tmp_path):
    model, graph = traced(arch)
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 7))
    expected = hf_greedy(model, ids, 12)
    stats = {}
    for pp, layout in ((1, "safetensors"), (2, "bin"), (3, "safetensors")):
        split = ppsplit.split_model(graph, pp, aux=TAPS)
        folder, _, _ = drafter_on_disk(tmp_path, model, layout)
        drafter = ppsplit.load_drafter(folder, split=split)
        assert drafter.taps == tuple(TAPS)
        out, stats[pp] = split.generate(ids, 12, drafter=drafter, num_draft_tokens=3, return_stats=True)
        assert torch.equal(out, expected), f"{arch} pp={pp}:\n{out[:, 7:]}\n{expected[:, 7:]}"
        s = stats[pp]
        assert s.verify_passes == s.steps > 0 and all(len(d) == 3 for d in s.draft_tokens)
    # The taps do not depend on the split, nor the drafter on the file layout: same drafts, same acceptance.
    assert stats[3].draft_tokens == stats[1].draft_tokens == stats[2].draft_tokens
    assert stats[3].accepted == stats[1].accepted
    if arch == "qwen3_tied":  # the tied table lives on stage 0 and as lm_head on the last stage; the drafter shares it
        table = dict(split.stages[0].named_parameters())["model.embed_tokens.weight"]
        assert drafter.embed_tokens.data_ptr() == table.data_ptr()


def test_batch_sequences_accept_and_commit_on_their_own(tmp_path):
    """Drafts that are right for sequence 0 and wrong from index 1 on for sequence 1, in one batch: each sequence
    accepts and commits its own count (0: all four, 1: one), and the output still equals greedy decoding (the
    lockstep loop committed the batch's minimum)."""

    model, graph = traced("llama")
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    folder, _, _ = drafter_on_disk(tmp_path, model, "safetensors")
    drafter = ppsplit.load_drafter(folder, split=split)
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (2, 6))
    expected = hf_greedy(model, ids, 20)
    truth = expected[:, 6:]
    full = {0: [], 1: []}  # per verify pass: did the oracle have K true tokens left to propose

    engine = Engine(split, drafter=drafter, num_draft_tokens=4)

    def oracle(aux, ids, positions, batch, last, token, sampler, *flags):  # the draft loop's drafts, from the truth
        if last is None:
            return None
        drafts = []
        for slot in batch.slot[batch.drawing].tolist():
            b = next(int(q.id) for q in engine.scheduler.running if q.slot == slot)
            done = int(sampler.index[slot])  # the request's tokens after this step's commit
            proposal = truth[b, done:done + 4].tolist() + [5] * 4
            drafts.append(proposal[:4] if b == 0 else proposal[:1] + [(d + 1) % VOCAB for d in proposal[1:4]])
            full[b].append(done + 4 <= truth.shape[1])
        return torch.tensor(drafts)

    engine.runner.sampler.proposer.feed = oracle
    outs = engine.generate(list(ids), SamplingParams(max_tokens=20))
    assert [o.token_ids for o in outs] == truth.tolist()
    for b, right in ((0, 4), (1, 1)):
        passes = [i for i, f in enumerate(full[b][:len(outs[b].accepted)]) if f]
        assert len(passes) >= 3 and all(outs[b].accepted[i] == right for i in passes), (b, outs[b].accepted)


# -- the drafter's forward against a reference written from the published description ---------------------------
def reference_drafts(t, cfg, taps_hidden, tokens, embed, k=2):
    """EAGLE-3 drafting in plain torch, recomputed over the whole sequence at each step (no cache): returns the
    first-call logits [T, V_draft] and ``k`` target-vocab draft ids."""
    eps, h = cfg["rms_norm_eps"], cfg["hidden_size"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def layer(x, toks):  # x [n, H]: fc output or the previous step's pre-norm output; toks [n]; positions 0..n-1
        n = x.shape[0]
        pos = torch.arange(n, dtype=torch.float32)
        inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)

        def rope(v):  # v [heads, n, hd]
            rot = torch.cat([-v[..., hd // 2:], v[..., :hd // 2]], -1)
            return v * ang.cos() + rot * ang.sin()

        hn = rms(x, t["midlayer.hidden_norm.weight"])
        residual = hn if cfg.get("norm_before_residual") else x
        e = rms(embed[toks], t["midlayer.input_layernorm.weight"])
        both = torch.cat([e, hn], -1)  # embedding first, width 2H
        q = rope((both @ t["midlayer.self_attn.q_proj.weight"].T).view(n, nh, hd).transpose(0, 1))
        kk = rope((both @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kvh, hd).transpose(0, 1))
        vv = (both @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kvh, hd).transpose(0, 1)
        kk, vv = kk.repeat_interleave(nh // kvh, 0), vv.repeat_interleave(nh // kvh, 0)
        scores = q @ kk.transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = (scores.softmax(-1) @ vv).transpose(0, 1).reshape(n, nh * hd) @ t["midlayer.self_attn.o_proj.weight"].T
        mid = residual + attn
        m = rms(mid, t["midlayer.post_attention_layernorm.weight"])
        out = mid + (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) \
            @ t["midlayer.mlp.down_proj.weight"].T
        return rms(out, t["norm.weight"]) @ t["lm_head.weight"].T, out

    x = torch.cat(taps_hidden, -1) @ t["fc.weight"].T  # taps in ascending order
    toks = tokens.clone()
    first_logits, ids = None, []
    for _ in range(k):
        logits, out = layer(x, toks)
        first_logits = logits if first_logits is None else first_logits
        d = int(logits[-1].argmax())
        ids.append(d + int(t["d2t"][d]))
        x = torch.cat([x, out[-1:]])  # the next step reads the pre-norm output, not fc
        toks = torch.cat([toks, torch.tensor([ids[-1]])])
    return first_logits, ids


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafter_matches_independent_reference(norm_before_residual, tmp_path):
    model, graph = traced("llama")
    split = ppsplit.split_model(graph, 3, aux=TAPS)
    folder, cfg, t = drafter_on_disk(tmp_path, model, "bin", seed=1, norm_before_residual=norm_before_residual)
    drafter = ppsplit.load_drafter(folder, split=split)
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (1, 9))
    T = ids.shape[1]
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True)
    next_token = hf.logits[0, -1].argmax()
    tokens = torch.cat([ids[0, 1:], next_token[None]])  # taps of position i pair with token i + 1
    embed = model.get_input_embeddings().weight.detach()
    ref_logits, ref_ids = reference_drafts(t, cfg, [hf.hidden_states[j][0] for j in TAPS], tokens, embed, k=2)

    _, aux = split(ids, torch.arange(T))
    with torch.no_grad():
        logits, _ = drafter(aux, tokens[None], torch.arange(T))
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=1e-4)
    # The engine's draft loop: after the prompt's step, the first window verifies the chain drafted from its last row.
    out = Engine(split, drafter=drafter, num_draft_tokens=2).generate([ids[0]], SamplingParams(max_tokens=2,
                                                                                               ignore_eos=True))[0]
    assert out.token_ids[0] == int(next_token) and out.drafts[0] == ref_ids


def test_adapter_never_concatenates_and_matches_fc(tmp_path):
    model, graph = traced("llama")
    split = ppsplit.split_model(graph, 1, aux=[0, *TAPS])  # an extra tap the drafter does not read (slot 0)
    folder, _, t = drafter_on_disk(tmp_path, model, "safetensors")
    drafter = ppsplit.load_drafter(folder, split=split)
    assert drafter.slots == (1, 2, 3)
    aux = torch.randn(4, 2, 5, 64)
    expected = torch.cat([aux[1], aux[2], aux[3]], -1) @ t["fc.weight"].T
    torch.testing.assert_close(drafter.adapt(aux), expected, atol=1e-5, rtol=1e-5)
    with torch.profiler.profile() as prof:
        drafter.adapt(aux)
    ops = {e.name for e in prof.events()}
    assert "aten::cat" not in ops and "aten::addmm" in ops


# -- a drafter trained here: accepted tokens skip target passes ----------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A drafter trained for 300 Adam steps on the 32-token target's own greedy continuations (teacher forcing on
    the target's taps, plus one step on the drafter's own output as EAGLE-3's training-time test does)."""
    model, graph = traced("small")
    split = ppsplit.split_model(graph, 1, aux=TAPS, fuse=False)  # big batches: plain ops beat the Triton interpreter
    folder, cfg, _ = drafter_on_disk(tmp_path_factory.mktemp("d"), model, "safetensors", draft_vocab=32)
    drafter = ppsplit.load_drafter(folder, split=split)
    g = torch.Generator().manual_seed(0)
    seqs = split.generate(torch.randint(3, 32, (64, 4), generator=g), 40)
    with torch.no_grad():
        _, aux = split(seqs, torch.arange(seqs.shape[1]))
    T = seqs.shape[1]
    to_draft = torch.full((32,), -100, dtype=torch.long)
    to_draft[drafter.target_ids] = torch.arange(drafter.target_ids.numel())  # target ids outside the draft vocab: ignored
    torch.manual_seed(0)
    drafter.train()
    params = [p for p in drafter.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(300):
        pick = torch.randint(0, 64, (16,), generator=g)
        s, f = seqs[pick], aux[:, pick, :T - 2]
        logits, out = drafter(f, s[:, 1:T - 1], torch.arange(T - 2))
        loss = F.cross_entropy(logits.flatten(0, 1), to_draft[s[:, 2:]].flatten())
        logits2, _ = drafter(out[:, :-1], s[:, 2:T - 1], torch.arange(1, T - 2))
        loss = loss + F.cross_entropy(logits2.flatten(0, 1), to_draft[s[:, 3:]].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    for p in params:
        p.requires_grad_(False)
    return model, split, drafter, g


def test_trained_drafter_accepts_and_skips_target_passes(trained):
    model, split, drafter, g = trained
    prompts = torch.randint(3, 32, (3, 4), generator=g)  # unseen prompts
    calls = []
    stage0 = split.stages[0]
    hook = stage0.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[-1]))  # ids [N] (a step)
    try:
        lengths = []
        for b in range(prompts.shape[0]):
            calls.clear()
            out, stats = split.generate(prompts[b:b + 1], 24, drafter=drafter, num_draft_tokens=4, return_stats=True)
            assert torch.equal(out, hf_greedy(model, prompts[b:b + 1], 24))
            # One prefill, then exactly one K + 1 = 5 token pass per verify step; no other target pass.
            assert calls == [4] + [5] * stats.steps and stats.verify_passes == stats.steps
            assert stats.steps < 23  # accepted drafts skipped target passes
            lengths.append(stats.mean_acceptance_length)
    finally:
        hook.remove()
    mean = sum(lengths) / len(lengths)
    print(f"trained drafter: mean acceptance length {mean:.2f} at K=4 (per prompt {[round(x, 2) for x in lengths]})")
    assert mean >= 2.0, lengths


def test_a_batch_of_8_keeps_each_requests_own_acceptance(trained):
    """8 unseen prompts in one batch through the engine: each request's drafts and acceptances are those it gets
    alone, so the batch's tokens per verify pass average at least 0.95 of the requests' own mean acceptance length
    (a batch that committed the minimum acceptance of its members, the lockstep rule, would fall well below)."""

    model, split, drafter, g = trained
    prompts = [p.tolist() for p in torch.randint(3, 32, (8, 4), generator=g)]
    params = SamplingParams(max_tokens=24)
    batch = Engine(split, drafter=drafter, num_draft_tokens=4).generate(prompts, params)
    alone = [Engine(split, drafter=drafter, num_draft_tokens=4).generate([p], params)[0] for p in prompts]
    for prompt, b, a in zip(prompts, batch, alone):
        assert b.token_ids == hf_greedy(model, torch.tensor([prompt]), 24)[0, len(prompt):].tolist()
        assert b.accepted == a.accepted
    own = sum(a.mean_acceptance_length for a in alone) / len(alone)
    per_pass = sum(b.mean_acceptance_length for b in batch) / len(batch)  # each request's tokens per verify pass
    rounds = max(len(b.accepted) for b in batch)
    minimum = [min(b.accepted[i] for b in batch if i < len(b.accepted)) for i in range(rounds)]
    print(f"batch of 8: {per_pass:.2f} tokens per verify pass, the requests' own mean acceptance length {own:.2f}, "
          f"the batch minimum rule {1 + sum(minimum) / len(minimum):.2f}")
    assert own >= 2.0 and per_pass >= 0.95 * own, (per_pass, own)


# -- sampling is lossless -----------------------------------------------------------------------------------------
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells expecting fewer than ``min_expected`` are pooled."""
    expected = probs.double() * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def check_joint_sampling(model, split, drafter, k: int):
    """2000 copies of one prompt, two new tokens sampled at temperature 0.8 with ``k`` drafts: the joint distribution
    of (first, second) token equals the target's p(t0) p(t1 | t0) (chi-square), and the test has power: the same
    samples are told apart from the target at temperature 1.2. Returns the run's ``SpeculativeStats``."""
    prompt = torch.tensor([[5, 9, 17, 3, 11]])
    N, V, temp = 2000, 32, 0.8
    out, stats = split.generate(prompt.expand(N, -1), 2, drafter=drafter, num_draft_tokens=k, temperature=temp,
                                generator=torch.Generator().manual_seed(1), return_stats=True)
    with torch.no_grad():
        p0 = torch.softmax(model(prompt).logits[0, -1] / temp, -1)
        after = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
        p1 = torch.softmax(model(after).logits[:, -1] / temp, -1)
        hot = torch.softmax(model(prompt).logits[0, -1] / 1.2, -1)[:, None] \
            * torch.softmax(model(after).logits[:, -1] / 1.2, -1)
    counts = torch.bincount(out[:, 5] * V + out[:, 6], minlength=V * V)
    assert chi2_pvalue(counts, (p0[:, None] * p1).flatten()) > 1e-3
    assert chi2_pvalue(counts, hot.flatten()) < 1e-3
    return stats


def test_acceptance_rule_is_lossless_at_every_index():
    g = torch.Generator().manual_seed(0)
    V, K, N = 8, 3, 200_000
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    q[:, 0] = 0  # the drafter never proposes token 0: only the residual can produce it
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], 1)
    p = torch.softmax(target_logits, -1)
    n, token = accept_sampled(p.expand(N, K + 1, V), q.expand(N, K, V), drafts, torch.full((N,), K),
                              torch.rand(N, K, generator=g), lambda taken: torch.rand(N, generator=g))
    full = torch.cat([drafts, drafts[:, :1]], 1)
    for i in range(K + 1):
        reached = n >= i
        x = torch.where(n[reached] > i, full[reached, i], token[reached])
        assert chi2_pvalue(torch.bincount(x, minlength=V), p[i]) > 1e-3, f"index {i}"
    assert 0 < (n == 0).float().mean() < 1 and (n == K).any()  # both rejections and full acceptance happen
    # The test has power: the raw drafts (distributed as q) are told apart from p.
    assert chi2_pvalue(torch.bincount(drafts[:, 0], minlength=V), p[0]) < 1e-6


def test_speculative_sampling_matches_target_distribution(tmp_path):
    """2000 copies of one prompt, two new tokens: the joint distribution of (first, second) token equals the
    target's p(t0) p(t1 | t0); the second token comes from the acceptance rule of the first verify pass."""
    model, graph = traced("small")
    split = ppsplit.split_model(graph, 2, aux=TAPS, fuse=False)
    folder, _, _ = drafter_on_disk(tmp_path, model, "safetensors", seed=3)
    drafter = ppsplit.load_drafter(folder, split=split)
    stats = check_joint_sampling(model, split, drafter, 2)
    assert stats.verify_passes == 1


# -- errors -------------------------------------------------------------------------------------------------------
def test_drafter_errors(tmp_path):
    model, graph = traced("llama")
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    ok, cfg, t = drafter_on_disk(tmp_path, model, "safetensors")

    def variant(name, cfg_over=None, drop=(), replace=None):
        c = dict(cfg, **(cfg_over or {}))
        tensors = {k: v for k, v in t.items() if k not in drop}
        tensors.update(replace or {})
        return write_drafter(str(tmp_path / name), c, tensors)

    with pytest.raises(ConfigError, match="load_drafter needs split="):
        ppsplit.load_drafter(ok)
    with pytest.raises(ConfigError, match=r"reads taps \[0, 1, 3\] but the split carries \[1, 2, 4\]"):
        ppsplit.load_drafter(ok, split=split, aux_convention="vllm")
    with pytest.raises(ConfigError, match="drafter tap id 5 is out of range"):
        ppsplit.load_drafter(variant("range", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}),
                             split=split)
    with pytest.raises(ConfigError, match="expects target hidden size 32 but the target has 64"):
        ppsplit.load_drafter(variant("hidden", {"target_hidden_size": 32}), split=split)
    with pytest.raises(ConfigError, match=r"vocabulary x hidden \(100 x 64\) does not match the target's embedding"):
        ppsplit.load_drafter(variant("vocab", {"vocab_size": 100}), split=split)
    with pytest.raises(ConfigError, match="no d2t tensor but its draft vocabulary \\(96\\) is smaller"):
        ppsplit.load_drafter(variant("d2t", drop=("d2t",)), split=split)
    with pytest.raises(ConfigError, match="has no fc.weight tensor"):
        ppsplit.load_drafter(variant("fc", drop=("fc.weight",)), split=split)
    with pytest.raises(ConfigError, match="aux_convention must be 'sglang'"):
        ppsplit.load_drafter(ok, split=split, aux_convention="hf")
    drafter = ppsplit.load_drafter(ok, split=split)
    ids = torch.randint(3, VOCAB, (1, 5))
    with pytest.raises(ConfigError, match="num_draft_tokens must be an integer >= 1, but got 0"):
        split.generate(ids, 4, drafter=drafter, num_draft_tokens=0)
    with pytest.raises(ConfigError, match=r"reads taps \[1, 2, 4\] but the split carries \[1, 3\]"):
        ppsplit.split_model(graph, 2, aux=[1, 3]).generate(ids, 4, drafter=drafter)
    sampled = split.generate(ids, 4, temperature=1.0, seed=3)  # a paged split samples without a drafter too
    assert sampled.shape == (1, 9) and torch.equal(sampled, split.generate(ids, 4, temperature=1.0, seed=3))


# -- compiled folder and command line -----------------------------------------------------------------------------
def publish(model, drafter, root, layout: str) -> str:
    """Save the target to ``root/target`` and the trained drafter as a published checkpoint (SpecForge ids, no
    embedding: the target's is used) to ``root/published``; returns the drafter's folder."""
    model.save_pretrained(root / "target", safe_serialization=True)
    drafter.save(str(root / "trained"), format="specforge")
    cfg, tensors = ppsplit.eagle3.formats.read_drafter(str(root / "trained"))
    return write_drafter(str(root / "published"), cfg, tensors, layout)


def test_compile_with_drafter_generate_and_check_drafter(trained, tmp_path, capsys):
    from ppsplit.cli import main

    model, split, drafter, _ = trained
    published = publish(model, drafter, tmp_path, "bin")

    out_dir = str(tmp_path / "compiled")
    assert main(["compile", str(tmp_path / "target"), "--pp", "2", "--drafter", published, "-o", out_dir,
                 "--max-batch", "1", "--max-len", "64"]) == 0
    loaded = ppsplit.load(out_dir)
    assert loaded.plan.taps == tuple(TAPS) and loaded.drafter.taps == tuple(TAPS)
    prompt = torch.tensor([[7, 20, 4, 13]])
    expected = hf_greedy(model, prompt, 24)
    out, stats = loaded.generate(prompt, 24, drafter=loaded.drafter, return_stats=True)
    assert torch.equal(out, expected) and stats.mean_acceptance_length > 1.5
    capsys.readouterr()
    assert main(["generate", out_dir, "--prompt-ids", "7,20,4,13", "--max-new-tokens", "24", "-k", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == ",".join(map(str, expected[0, 4:].tolist()))
    assert "tokens/s" in printed and f"mean acceptance length {stats.mean_acceptance_length:.2f}" in printed

    assert main(["check-drafter", str(tmp_path / "target"), published, "--prompts", "3"]) == 0
    printed = capsys.readouterr().out
    assert "fits: sglang" in printed, printed
    assert main(["generate", out_dir, "--prompt-ids", "1,x"]) == 2


@pytest.fixture(scope="module")
def compiled_with_drafter(trained, tmp_path_factory):
    """The trained drafter as a published checkpoint, compiled with the 32-token target at pp=1, 2, 3 and 4."""
    from ppsplit.cli import main

    model, _, drafter, _ = trained
    root = tmp_path_factory.mktemp("spec-mp")
    published = publish(model, drafter, root, "safetensors")
    folders = {}
    for pp in (1, 2, 3, 4):
        folders[pp] = str(root / f"pp{pp}")
        assert main(["compile", str(root / "target"), "--pp", str(pp), "--drafter", published, "-o", folders[pp],
                     "--max-batch", "4", "--max-len", "64"]) == 0
    return model, folders


def _spec_prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 32, (t,), generator=g).tolist() for t in (4, 4, 6, 6)]


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_speculative_through_processes_equals_single_process(pp, compiled_with_drafter):
    """One process per stage (gloo; pp=1: one rank holds everything), four requests, the drafter on the last rank:
    each request's tokens, drafts and acceptances per verify pass equal the in-process engine's, and its tokens
    equal Hugging Face greedy of its prompt alone; sampling (temperature 0.8, a seed per request) gives the
    in-process engine's tokens too."""
    from tests.processes import generate, launch

    model, folders = compiled_with_drafter
    prompts = _spec_prompts()
    params = SamplingParams(max_tokens=20)
    res = launch(pp, generate, folders[pp], prompts, params, 4, timeout=30, deadline=150)
    assert all(res[r][0] == "ok" for r in range(pp)), {r: res[r][-1][-800:] for r in range(pp)}
    single = ppsplit.load(folders[pp])
    ref = Engine(single, drafter=single.drafter, num_draft_tokens=4).generate(prompts, params)
    for (tokens, accepted, drafts), expected, prompt in zip(res[0][1][0], ref, prompts):
        assert tokens == expected.token_ids == hf_greedy(model, torch.tensor([prompt]), 20)[0, len(prompt):].tolist()
        assert accepted == expected.accepted and drafts == expected.drafts
        assert len(accepted) < 19  # accepted drafts skipped target passes
    print(f"pp={pp}: mean acceptance length {[round(o.mean_acceptance_length, 2) for o in ref]}")

    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=5 + i, ignore_eos=True) for i in range(4)]
    res = launch(pp, generate, folders[pp], prompts, params, 3, timeout=30, deadline=150)
    assert all(res[r][0] == "ok" for r in range(pp)), {r: res[r][-1][-800:] for r in range(pp)}
    ref = Engine(single, drafter=single.drafter, num_draft_tokens=3).generate(prompts, params)
    assert [o[0] for o in res[0][1][0]] == [o.token_ids for o in ref]


def test_slot_reused_while_drafts_are_in_flight_through_four_ranks(compiled_with_drafter):
    """A request aborted while its verify window is in flight through 4 ranks, its slot given at once to a new
    request (the old micro-step still in the pipe): the new request's tokens equal its solo run, the others are
    untouched, and the pool is whole at the end."""
    from tests.processes import AbortInFlight, launch, serve

    model, folders = compiled_with_drafter
    prompts = _spec_prompts()
    params = SamplingParams(max_tokens=24)
    fresh = [9, 4, 17, 3, 22]
    script = AbortInFlight("1", fresh, params)
    res = launch(4, serve, folders[4], [(p, params, 0) for p in prompts], 3, None, script, timeout=30, deadline=200)
    assert all(res[r][0] == "ok" for r in range(4)), {r: res[r][-1][-800:] for r in range(4)}
    outputs, in_use, _, script = res[0][1]
    old_slot, new_slot, in_pipe = script.seen
    assert old_slot == new_slot and in_pipe
    assert in_use == 0 and "1" not in outputs
    assert outputs["new"][0] == hf_greedy(model, torch.tensor([fresh]), 24)[0, len(fresh):].tolist()
    for i in (0, 2, 3):
        assert outputs[str(i)][0] == hf_greedy(model, torch.tensor([prompts[i]]), 24)[0, len(prompts[i]):].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_speculative_nccl_two_gpus_equals_single_process(cuda_graphs, compiled_with_drafter):
    """NCCL, rank r on cuda:r, the drafter on rank 1 (every bucket replayed from CUDA graphs, or eager): tokens,
    drafts and acceptances equal the in-process engine on one GPU."""
    from tests.processes import launch, serve

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _, folders = compiled_with_drafter
    prompts = _spec_prompts()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    res = launch(2, serve, folders[2], [(p, params, i) for i, p in enumerate(prompts)], 4,
                 {"cuda_graphs": cuda_graphs, "max_num_batched_tokens": 32}, timeout=60, deadline=200, backend="nccl")
    assert all(res[r][0] == "ok" for r in range(2)), {r: res[r][-1][-800:] for r in range(2)}
    outputs = res[0][1][0]
    single = ppsplit.load(folders[2], ["cuda:0", "cuda:0"])
    ref = Engine(single, drafter=single.drafter, num_draft_tokens=4).generate(prompts, params)
    for i, expected in enumerate(ref):
        tokens, _, accepted, drafts = outputs[str(i)]
        assert tokens == expected.token_ids and accepted == expected.accepted and drafts == expected.drafts


def test_cli_run_speculative(compiled_with_drafter, capfd):
    """``ppsplit run DIR -k 4``: one process per stage, the drafter on the last; prints HF's greedy tokens and the
    mean acceptance length. ``-k`` on a folder without a drafter fails before any process starts."""
    from ppsplit.cli import main

    model, folders = compiled_with_drafter
    expected = hf_greedy(model, torch.tensor([[7, 20, 4, 13]]), 16)[0, 4:].tolist()
    code = main(["run", folders[2], "--prompt-ids", "7,20,4,13", "--max-new-tokens", "16", "-k", "4",
                 "--timeout", "30"])
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    assert lines[0] == ",".join(map(str, expected)), out
    assert "(2 stages, gloo, 1 request, K=4, mean acceptance length" in lines[1], out
    assert main(["run", folders[2], "--prompt-ids", "1,2", "-k", "0"]) == 2
    assert "-k/--num-draft-tokens must be an integer >= 1, but got 0" in capfd.readouterr().err


def test_speculative_through_processes_errors(compiled_with_drafter, tmp_path):
    """Errors end every rank with the same one-line ConfigError: no drafter on the last rank, K < 1."""
    import shutil

    from tests.processes import generate, launch

    _, folders = compiled_with_drafter
    bare = shutil.copytree(folders[2], tmp_path / "no-drafter", ignore=shutil.ignore_patterns("drafter"))
    res = launch(2, generate, str(bare), [[5, 6, 7]], None, 2, timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError") and "needs a drafter on the last rank" in res[r][2]
    res = launch(2, generate, folders[2], [[5, 6, 7]], None, -1, timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError") and "num_draft_tokens must be an integer >= 1" in res[r][2]
    assert res["alive"] == []


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_the_draft_loop_on_cuda_drafts_like_the_cpu(tmp_path, compiled):
    """The engine's draft loop on a GPU (fp32; the stages captured, async scheduling): every request's tokens, drafts
    and acceptances equal the same engine's on the CPU. ``compiled``: the drafter's forward handed to Inductor
    (``load_drafter(compile=True)``), whose fused kernels may round differently: its outputs still equal greedy."""
    from tests.serve.test_engine import hf

    model, graph = traced("llama")
    folder, _, _ = drafter_on_disk(tmp_path, model, "safetensors", seed=2)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 14, 6, 11)]
    params = [SamplingParams(max_tokens=m) for m in (10, 12, 8, 15, 9)]
    runs = []
    for device in ("cpu", "cuda"):
        split = ppsplit.split_model(graph, 2, aux=TAPS)
        if device == "cuda":
            split.place(["cuda", "cuda"])
        drafter = ppsplit.load_drafter(folder, split=split, compile=compiled and device == "cuda")
        outs = Engine(split, drafter=drafter, num_draft_tokens=3).generate(prompts, params)
        runs.append([(o.token_ids, o.drafts, o.accepted) for o in outs])
    for prompt, p, out in zip(prompts, params, runs[1]):
        assert out[0] == hf(model, prompt, p)
    if not compiled:
        assert runs[1] == runs[0]


def test_load_drafter_compile_hands_the_forward_to_inductor(tmp_path):
    # What compile=True does (its numbers are checked on the GPU above): nn.Module.compile, nothing run here.
    model, graph = traced("llama")
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    folder, _, _ = drafter_on_disk(tmp_path, model, "safetensors")
    assert ppsplit.load_drafter(folder, split=split)._compiled_call_impl is None
    assert ppsplit.load_drafter(folder, split=split, compile=True)._compiled_call_impl is not None
