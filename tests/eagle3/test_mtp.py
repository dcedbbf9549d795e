"""MTP layers shipped in the target's checkpoint (DeepSeek-V3: MLA + MoE; GLM-4.5: GQA + MoE; Qwen3-Next: full
attention + MoE) as the drafter on the last stage.

The checkpoint is written as the real ones are: the target's layers as transformers saves them, plus the MTP layer
under ``model.layers.{L}`` (its decoder block with per-expert tensors, ``enorm``, ``hnorm``, ``eh_proj``,
``embed_tokens``, ``shared_head.norm``, ``shared_head.head``; Qwen3-Next: under ``mtp.``), which transformers drops
on load. The reference is written from the DeepSeek-V3 report (section 2.2) and vLLM's ``deepseek_mtp.py`` (GLM-4.5's
``glm4_moe_mtp.py`` is the same; ``qwen3_next_mtp.py``), its decoder block run by transformers' own decoder layer (a
one-layer model holding the MTP block, the MTP norm and head as its norm and head).
"""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig, ConfigError
from ppsplit.core.ragged import RaggedStep, Segment
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams

V, H, L = 32, 64, 3
_COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_attention_heads=4, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, n_routed_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, tie_word_embeddings=False)
SHAPES = {  # the MTP layouts: DeepSeek-V3 (MLA) and GLM-4.5 (GQA with biases), both MoE
    "deepseek_v3": dict(_COMMON, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16),
    "glm4_moe": dict(_COMMON, num_key_value_heads=2, attention_bias=True),
    "qwen3_next": dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, tie_word_embeddings=False),
}
_QWEN35 = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
               tie_word_embeddings=False)
SHAPES.update({"qwen3_5_text": _QWEN35,  # Qwen3.5's text models, dense and MoE: Qwen3-Next's MTP layout
               "qwen3_5_moe_text": dict(_QWEN35, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=32)})
QWEN = "qwen3_next"  # its MTP layer under mtp.*, norms scaling by 1 + weight, the output after its norm fed back
QWENS = (QWEN, "qwen3_5_text", "qwen3_5_moe_text")
# (target, block) config fields: the MTP layer's type at index L (MoE; Qwen3-Next: full attention)
_LAYER_TYPE = {"deepseek_v3": (dict(first_k_dense_replace=1), dict(first_k_dense_replace=0)),
               "glm4_moe": (dict(first_k_dense_replace=1), dict(first_k_dense_replace=0)),
               **{q: (dict(layer_types=["linear_attention", "linear_attention", "full_attention"]),
                      dict(layer_types=["full_attention"])) for q in QWENS}}
_QWEN_NAMES = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
               "eh_proj.weight": "fc.weight"}
CACHE = CacheConfig(batch_size=8, max_len=64, block_size=16)


def _random(config, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # no weight left at exactly 0 or 1: a wrong or missing one shows
            p.add_(torch.randn_like(p) * 0.05)
    return model


def mtp_parts(seed=1, arch="deepseek_v3", **shape):
    """The MTP layer: a one-layer DeepseekV3 whose layer 0 (MoE, as the MTP layer at index L is) is the block, its
    norm ``shared_head.norm`` and its head ``shared_head.head``; and ``enorm``, ``hnorm``, ``eh_proj``."""
    block = _random(AutoConfig.for_model(arch, **{**SHAPES[arch], **shape}, num_hidden_layers=1,
                                         **_LAYER_TYPE[arch][1]), seed)
    g = torch.Generator().manual_seed(seed)
    one = 0 if arch in QWENS else 1  # Qwen3-Next's norms scale by 1 + weight
    own = {"enorm.weight": one + 0.1 * torch.randn(H, generator=g),
           "hnorm.weight": one + 0.1 * torch.randn(H, generator=g),
           "eh_proj.weight": torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5}
    return block, own


def write_checkpoint(folder, target, block, own, drop=(), extra=None, layers=1):
    """``target`` saved by transformers, plus the MTP layer at ``model.layers.{L}`` in DeepSeek-V3's layout (or
    under ``mtp.`` in Qwen3-Next's)."""
    target.save_pretrained(folder)
    tmp = f"{folder}-block"
    block.save_pretrained(tmp)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    if target.config.model_type in QWENS:
        for name, t in load_file(os.path.join(tmp, "model.safetensors")).items():
            if name.startswith("model.layers.0."):
                tensors["mtp.layers.0." + name[len("model.layers.0."):]] = t
        tensors["mtp.norm.weight"] = block.model.norm.weight.detach().clone()
        tensors.update({"mtp." + _QWEN_NAMES[k]: v for k, v in own.items()})
        tensors.update(extra or {})
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**cfg, "mtp_num_hidden_layers": 1}, f)
        return str(folder)
    prefix = f"model.layers.{L}."
    for name, t in load_file(os.path.join(tmp, "model.safetensors")).items():
        if name.startswith("model.layers.0."):
            tensors[prefix + name[len("model.layers.0."):]] = t
    tensors[prefix + "shared_head.norm.weight"] = block.model.norm.weight.detach().clone()
    tensors[prefix + "shared_head.head.weight"] = block.lm_head.weight.detach().clone()
    tensors[prefix + "embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()  # as DeepSeek ships
    tensors.update({prefix + k: v for k, v in own.items()})
    tensors.update(extra or {})
    for name in drop:
        del tensors[prefix + name]
    for k in range(1, layers):  # further MTP layers: copies of the first under model.layers.{L + k}
        tensors.update({f"model.layers.{L + k}." + name[len(prefix):]: t.clone() for name, t in list(tensors.items())
                        if name.startswith(prefix)})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["num_nextn_predict_layers"] == 1  # transformers writes DeepSeek's key
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": layers}, f)
    return str(folder)


def build(folder, cache=CACHE, head_scale=1.0, arch="deepseek_v3", **shape):
    """(target, MTP block model, own tensors, checkpoint folder, traced target); ``head_scale`` sharpens the
    target's next-token distributions."""
    target = _random(AutoConfig.for_model(arch, **{**SHAPES[arch], **shape}, num_hidden_layers=L,
                                          **_LAYER_TYPE[arch][0]), 0)
    block, own = mtp_parts(arch=arch, **shape)
    with torch.no_grad():
        target.lm_head.weight.mul_(head_scale)
        if arch in QWENS:  # Qwen3-Next's MTP layer drafts through the target's lm_head
            block.lm_head.weight.copy_(target.lm_head.weight)
    folder = write_checkpoint(folder, target, block, own)
    return target, block, own, folder, ppsplit.trace_model(target, cache=cache)


_BUILT: dict = {}


def built(arch, tmp_path_factory):
    if arch not in _BUILT:
        _BUILT[arch] = build(tmp_path_factory.mktemp(arch) / "ckpt", arch=arch)
    return _BUILT[arch]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return built("deepseek_v3", tmp_path_factory)


def rms(x, w, eps=1e-6, offset=False):
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1 + w.float())).to(x.dtype) if offset else w * normed.to(x.dtype)


@torch.no_grad()
def reference(target, block, own, ids, chain=()):
    """Draft logits of every position of ``ids [T]`` (depth 1: position i reads the target's final hidden state of
    i and the embedding of token i + 1, zeroed at position 0 as vLLM does), then of each token of ``chain`` in
    turn at the positions after (each fed the previous row's block output before ``shared_head.norm``). Qwen3-Next
    (vLLM qwen3_next_mtp.py): no zeroing, norms scaling by 1 + weight, the output after the MTP norm fed back."""
    eps, qwen = target.config.rms_norm_eps, target.config.model_type in QWENS
    h = target(ids[None], output_hidden_states=True).hidden_states[-1][0]  # after the final norm (vLLM's output)
    embed = target.model.embed_tokens.weight
    nxt = torch.cat([ids[1:], torch.tensor(chain[:1], dtype=ids.dtype)])
    x = F.embedding(nxt, embed)
    if not qwen:
        x[0] = 0  # vLLM's DeepSeekMultiTokenPredictorLayer: inputs_embeds[positions == 0] = 0
    rows = F.linear(torch.cat([rms(x, own["enorm.weight"], eps, qwen), rms(h, own["hnorm.weight"], eps, qwen)], -1),
                    own["eh_proj.weight"])
    out = {}
    hook = block.model.layers[0].register_forward_hook(
        lambda m, i, o: out.update(pre=o[0] if isinstance(o, tuple) else o))
    logits = [block(inputs_embeds=rows[None]).logits[0]]
    for j, token in enumerate(chain[1:] + (None,)):
        if token is None:
            break
        prev = out["pre"][0, -1]
        if qwen:
            prev = block.model.norm(prev)
        e = F.embedding(torch.tensor([token]), embed)
        row = F.linear(torch.cat([rms(e, own["enorm.weight"], eps, qwen),
                                  rms(prev[None], own["hnorm.weight"], eps, qwen)], -1), own["eh_proj.weight"])
        rows = torch.cat([rows, row])
        logits.append(block(inputs_embeds=rows[None]).logits[0, -1:])
    hook.remove()
    return torch.cat(logits)


@pytest.mark.parametrize("arch", list(SHAPES))
def test_draft_logits_equal_the_reference(arch, tmp_path_factory):
    """Prefill rows of one sequence (every position's depth-1 draft), then two chain steps with the layer reused,
    as the engine runs them: logits equal the reference's, and the drafter holds exactly the MTP tensors."""
    target, block, own, folder, traced = built(arch, tmp_path_factory)
    split = ppsplit.split_model(traced, 2, aux=[L])
    drafter = ppsplit.load_mtp(folder, split=split)
    assert drafter.taps == (L,)
    block_params = {n for n, _ in drafter.block.named_parameters()}
    attention = {"deepseek_v3": "kv_a_proj", "glm4_moe": "k_proj.bias"}.get(arch, "q_norm")
    assert any("experts" in n for n in block_params) == (arch != "qwen3_5_text")
    assert any(attention in n for n in block_params)
    assert all(n.startswith(("model.layers.1.", "model.norm.", "lm_head.")) for n in block_params)
    torch.manual_seed(7)
    ids = torch.randint(3, V, (11,))
    T = ids.shape[0]
    step = RaggedStep.build([Segment(0, 0, T)], {0: [0]}, split.layout)
    _, aux = split.step(ids, step)
    chain = (9, 21, 30)  # the token after ids, then two drafts
    nxt = torch.cat([ids[1:], torch.tensor([chain[0]])])
    logits, hidden = drafter(aux[:, None], nxt[None], step)
    got = [logits[0]]
    for j, token in enumerate(chain[1:]):
        one = RaggedStep.build([Segment(0, T + j, 1)], {0: [0]}, split.layout)
        logits, hidden = drafter(hidden[:, -1:], torch.tensor([[token]]), one)
        got.append(logits[0])
    ref = reference(target, block, own, ids, chain)
    torch.testing.assert_close(torch.cat(got), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, pp, k", [("deepseek_v3", 1, 1), ("deepseek_v3", 2, 2), ("deepseek_v3", 3, 3),
                                         ("glm4_moe", 2, 3), (QWEN, 2, 3), ("qwen3_5_text", 2, 3),
                                         ("qwen3_5_moe_text", 1, 2)])
def test_engine_output_equals_greedy(arch, pp, k, tmp_path_factory):
    """Requests of different lengths batched, K drafts by chaining the one MTP layer K times: each output equals
    Hugging Face's greedy generate of the target alone."""
    target, _, _, folder, traced = built(arch, tmp_path_factory)
    split = ppsplit.split_model(traced, pp, aux=[L])
    drafter = ppsplit.load_mtp(folder, split=split)
    gen = torch.Generator().manual_seed(pp)
    prompts = [torch.randint(3, V, (n,), generator=gen) for n in (4, 9, 13)]
    outs = Engine(split, drafter=drafter, num_draft_tokens=k).generate(prompts, SamplingParams(max_tokens=12,
                                                                                              ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            greedy = target.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert out.token_ids == greedy[0, len(prompt):].tolist()
        assert all(0 <= a <= k for a in out.accepted)


def test_further_mtp_layers_are_left_unused(deepseek, tmp_path):
    """A checkpoint with two MTP layers drafts with the first only, as vLLM's proposer does: the same logits as the
    one-layer checkpoint."""
    target, block, own, folder, traced = deepseek
    split = ppsplit.split_model(traced, 1, aux=[L])
    two = write_checkpoint(tmp_path / "two", target, block, own, layers=2)
    ids = torch.randint(3, V, (7,), generator=torch.Generator().manual_seed(2))
    step = RaggedStep.build([Segment(0, 0, 7)], {0: [0]}, split.layout)
    _, aux = split.step(ids, step)
    nxt = torch.cat([ids[1:], ids[:1]])[None]
    one_logits, _ = ppsplit.load_mtp(folder, split=split)(aux[:, None], nxt, step)
    two_logits, _ = ppsplit.load_mtp(two, split=split)(aux[:, None], nxt, step)
    assert torch.equal(one_logits, two_logits)


def _refused(folder, split, message):
    with pytest.raises(ConfigError) as e:
        ppsplit.load_mtp(folder, split=split)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_checkpoints_are_refused_in_one_line(deepseek, tmp_path, tmp_path_factory):
    """A missing MTP tensor, an unknown one, a split without tap L, a model type not supported, no MTP layers; and
    ``load_drafter`` given the target's checkpoint says where MTP layers load."""
    target, block, own, folder, traced = deepseek
    split = ppsplit.split_model(traced, 2, aux=[L])
    _refused(write_checkpoint(tmp_path / "a", target, block, own, drop=("hnorm.weight",)), split,
             f"no model.layers.{L}.hnorm.weight")
    _refused(write_checkpoint(tmp_path / "b", target, block, own, drop=("mlp.experts.2.up_proj.weight",)), split,
             f"lacks model.layers.{L}.mlp.experts.2.up_proj.weight")
    extra = {f"model.layers.{L}.mlp.mystery.weight": torch.ones(3)}
    _refused(write_checkpoint(tmp_path / "c", target, block, own, extra=extra), split,
             f"does not account for: model.layers.{L}.mlp.mystery.weight")
    _refused(folder, ppsplit.split_model(traced, 2, aux=[1]), f"split with aux including {L}")
    qwen_target, qwen_block, qwen_own, _, qwen_traced = built(QWEN, tmp_path_factory)
    qwen_split = ppsplit.split_model(qwen_traced, 2, aux=[L])
    stray = {"mtp.layers.1.input_layernorm.weight": torch.ones(H)}  # a second Qwen3-Next MTP layer: not read
    _refused(write_checkpoint(tmp_path / "q", qwen_target, qwen_block, qwen_own, extra=stray), qwen_split,
             "tensors ppsplit does not account for: mtp.layers.1.input_layernorm.weight")
    with pytest.raises(ConfigError, match="is a target checkpoint with MTP layers, not a drafter; load them with "
                                          r"ppsplit.load_mtp\(folder, split=split\)"):
        ppsplit.load_drafter(folder, split=split)
    for change, message in (({"model_type": "llama"}, "model_type 'llama' are not supported"),
                            ({"num_nextn_predict_layers": 0}, "has no MTP layers")):
        bad = tmp_path / f"cfg{len(message)}"
        os.makedirs(bad)
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        with open(bad / "config.json", "w") as f:
            json.dump({**cfg, **change}, f)
        os.symlink(os.path.join(folder, "model.safetensors"), bad / "model.safetensors")
        _refused(str(bad), split, message)


def test_sampling_keeps_the_target_distribution(tmp_path):
    """400 copies of one prompt, two new tokens at T=0.8 with two MTP drafts drawn from the layer's distributions:
    the joint distribution of (first, second) token equals the target's p(t0) p(t1 | t0), and the test has power
    (it rejects T=1.2)."""
    from tests.eagle3.test_eagle3 import chi2_pvalue

    v = 8  # no end-of-sequence token: every copy gives two tokens
    target, _, _, folder, traced = build(tmp_path / "ckpt", CacheConfig(batch_size=400, max_len=16), head_scale=4.0,
                                         vocab_size=v, eos_token_id=None)
    split = ppsplit.split_model(traced, 1, aux=[L])
    drafter = ppsplit.load_mtp(folder, split=split)
    prompt = torch.tensor([[5, 1, 6, 3, 4]])
    n, temp = 400, 0.8
    out, stats = split.generate(prompt.expand(n, -1), 2, drafter=drafter, num_draft_tokens=2, temperature=temp,
                                generator=torch.Generator().manual_seed(1), return_stats=True)
    assert stats.verify_passes == 1
    with torch.no_grad():
        first = target(prompt).logits[0, -1]
        after = target(torch.cat([prompt.expand(v, -1), torch.arange(v)[:, None]], 1)).logits[:, -1]
    joint = lambda t: (torch.softmax(first / t, -1)[:, None] * torch.softmax(after / t, -1)).flatten()
    counts = torch.bincount(out[:, 5] * v + out[:, 6], minlength=v * v)
    assert chi2_pvalue(counts, joint(temp)) > 1e-3
    assert chi2_pvalue(counts, joint(1.2)) < 1e-3


@pytest.fixture(scope="module")
def trained(deepseek, tmp_path_factory):
    """The MTP layer trained here (250 Adam steps, transformers' own DeepseekV3 layer as its block) to predict the
    target's greedy token at i + 2 from the target's hidden state at i and the token at i + 1; its checkpoint."""
    target, block, own, _, traced = deepseek
    block, own = mtp_parts(seed=2)
    own = {k: torch.nn.Parameter(v.clone()) for k, v in own.items()}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        seqs = target.generate(torch.randint(3, V, (128, 4), generator=g), max_new_tokens=28, do_sample=False,
                               eos_token_id=None)
        h = target(seqs, output_hidden_states=True).hidden_states[-1]
    eps = target.config.rms_norm_eps
    embed = target.model.embed_tokens.weight.detach()
    opt = torch.optim.Adam([*block.parameters(), *own.values()], lr=1e-2)
    block.train()
    for _ in range(250):
        pick = torch.randint(0, 128, (16,), generator=g)
        s, hs = seqs[pick], h[pick, :-1]
        e = F.embedding(s[:, 1:], embed)
        e[:, 0] = 0  # position 0, as vLLM runs it
        rows = F.linear(torch.cat([rms(e, own["enorm.weight"], eps), rms(hs, own["hnorm.weight"], eps)], -1),
                        own["eh_proj.weight"])
        logits = block(inputs_embeds=rows).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), s[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    block.eval()
    own = {k: v.detach() for k, v in own.items()}
    folder = write_checkpoint(tmp_path_factory.mktemp("trained") / "ckpt", target, block, own)
    return target, folder, traced


@pytest.mark.parametrize("k", [3])
def test_trained_layer_accepts_more_than_one_token_per_pass(trained, k):
    """A batch of 8 requests, K = 3 (the one layer chained three times): every request averages more than one token per
    verify pass, each gets the acceptance it gets alone, and the outputs stay the target's greedy ones."""
    target, folder, traced = trained
    split = ppsplit.split_model(traced, 2, aux=[L])
    drafter = ppsplit.load_mtp(folder, split=split)
    prompts = torch.randint(3, V, (8, 4), generator=torch.Generator().manual_seed(5))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = Engine(split, drafter=drafter, num_draft_tokens=k).generate(list(prompts), params)
    with torch.no_grad():
        greedy = target.generate(prompts, max_new_tokens=24, do_sample=False, eos_token_id=None)[:, 4:].tolist()
    assert [o.token_ids for o in outs] == greedy
    lengths = [o.mean_acceptance_length for o in outs]
    print(f"trained MTP layer, K={k}, batch of 8: tokens per verify pass {[round(x, 2) for x in lengths]}, "
          f"mean {sum(lengths) / len(lengths):.2f}")
    assert min(lengths) > 1.0, lengths
    alone = Engine(split, drafter=drafter, num_draft_tokens=k).generate([prompts[3]], params)
    assert alone[0].accepted == outs[3].accepted


def check_folder_drafts_as_load_mtp(target, folder, traced, loaded, prompts, max_tokens: int):
    """The MTP layer of a compiled folder (``loaded``, K = 3) against ``load_mtp(folder)`` over a pp-2 split of
    ``traced``: every prompt's output is Hugging Face's greedy one, and its drafts and acceptance per verify pass are
    the in-process layer's. Returns the folder's outputs."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = Engine(loaded, drafter=loaded.drafter, num_draft_tokens=3).generate(prompts, params)
    split = ppsplit.split_model(traced, 2, aux=[L])
    ref = Engine(split, drafter=ppsplit.load_mtp(folder, split=split), num_draft_tokens=3).generate(prompts, params)
    for prompt, got, expected in zip(prompts, outs, ref):
        with torch.no_grad():
            greedy = target.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                     eos_token_id=None)[0, len(prompt):].tolist()
        assert got.token_ids == greedy == expected.token_ids
        assert got.accepted == expected.accepted and got.drafts == expected.drafts
    return outs


def test_compiled_folder_speculates_with_its_mtp_layer(trained, tmp_path, capsys):
    """``ppsplit compile CKPT --pp 2 --mtp`` stores the MTP layer in DIR/mtp (the block's program and tensors, its
    own tensors beside them); ``ppsplit.load`` attaches it, and the folder's greedy output equals Hugging Face's with
    the acceptance of ``load_mtp`` over an in-process split; ``ppsplit generate -k`` prints the same."""
    from ppsplit.cli import main

    target, folder, traced = trained
    out = str(tmp_path / "pp2")
    assert main(["compile", folder, "--pp", "2", "--mtp", "-o", out, "--max-batch", "8", "--max-len", "64"]) == 0
    assert sorted(os.listdir(os.path.join(out, "mtp"))) == ["block.json", "block.safetensors", "config.json",
                                                            "drafter.safetensors"]
    loaded = ppsplit.load(out)
    assert loaded.plan.taps == (L,) and loaded.drafter.family == "mtp"
    prompts = [p.tolist() for p in torch.randint(3, V, (4, 4), generator=torch.Generator().manual_seed(5))]
    outs = check_folder_drafts_as_load_mtp(target, folder, traced, loaded, prompts, 16)
    lengths = [o.mean_acceptance_length for o in outs]
    with capsys.disabled():
        print(f"MTP layer from the compiled folder, K=3: tokens per verify pass {[round(x, 2) for x in lengths]}")
    assert sum(lengths) / len(lengths) > 1.2
    capsys.readouterr()
    assert main(["generate", out, "--prompt-ids", ",".join(map(str, prompts[0])), "--max-new-tokens", "16",
                 "--ignore-eos", "-k", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == ",".join(map(str, outs[0].token_ids))
    assert f"mean acceptance length {outs[0].mean_acceptance_length:.2f}" in printed, printed
    assert main(["inspect", out]) == 0
    for command, message in ((["save-drafter", out, "-o", str(tmp_path / "x")], "--format speculators --verifier"),):
        capsys.readouterr()
        assert main(command) == 2
        assert message in capsys.readouterr().err
    # a tampered stored config is refused in one line, by inspect and by load
    where = os.path.join(out, "mtp", "config.json")
    cfg = json.loads(open(where).read())
    for change, message in (({"ppsplit_taps": [1]}, "the MTP layer reads taps [1]"),
                            ({"hidden_size": "64"}, "hidden_size must be"),
                            ({"run": "os.system"}, "'run', which ppsplit does not write there")):
        with open(where, "w") as f:
            json.dump({**cfg, **change}, f)
        with pytest.raises(ConfigError) as e:
            ppsplit.load(out)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert main(["inspect", out]) == 2


@pytest.mark.parametrize("arch", ["glm4_moe", QWEN, "qwen3_5_moe_text"])
def test_compiled_folder_keeps_each_layout(arch, tmp_path, tmp_path_factory):
    """GLM-4.5 (GQA + biases) and Qwen3-Next (offset norms, the target's head, the normed output fed back) stored by
    ``compile --mtp`` draft exactly what ``load_mtp`` drafts, and the output stays Hugging Face's greedy one."""
    from ppsplit.cli import main

    target, _, _, folder, traced = built(arch, tmp_path_factory)
    out = str(tmp_path / "pp2")
    assert main(["compile", folder, "--pp", "2", "--mtp", "-o", out, "--max-batch", "8", "--max-len", "64"]) == 0
    prompts = [p.tolist() for p in torch.randint(3, V, (3, 6), generator=torch.Generator().manual_seed(3))]
    check_folder_drafts_as_load_mtp(target, folder, traced, ppsplit.load(out), prompts, 10)


def test_compile_mtp_refuses_a_checkpoint_without_mtp_layers(deepseek, tmp_path, capsys):
    """``--mtp`` on a checkpoint with no MTP layers, or of a model type without a layout, is one line and writes
    nothing."""
    from ppsplit.cli import main

    target, _, _, folder, _ = deepseek
    for change, message in (({"num_nextn_predict_layers": 0}, "has no MTP layers"),
                            ({"model_type": "llama"}, "model_type 'llama' are not supported")):
        bad = tmp_path / f"cfg{len(message)}"
        os.makedirs(bad)
        cfg = json.loads(open(os.path.join(folder, "config.json")).read())
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        os.symlink(os.path.join(folder, "model.safetensors"), bad / "model.safetensors")
        capsys.readouterr()
        assert main(["compile", str(bad), "--pp", "2", "--mtp", "-o", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not os.path.exists(tmp_path / "out")


def test_a_bf16_split_of_a_float32_checkpoint(tmp_path):
    """The split in bf16, the checkpoint in float32: the layer's tensors take the split's dtype, the block's rotary
    buffers stay as traced (float32), and the engine runs (it failed with a dtype mismatch before)."""
    target, _, _, folder, _ = build(tmp_path / "ckpt")
    target = target.to(torch.bfloat16)
    split = ppsplit.split_model(target, 2, aux=[L], cache=CacheConfig(batch_size=4, max_len=48))
    drafter = ppsplit.load_mtp(folder, split=split)
    assert drafter.eh_proj.weight.dtype == drafter.embed_tokens.dtype == torch.bfloat16
    assert any(b.dtype == torch.float32 for name, b in drafter.block.named_buffers() if "inv_freq" in name)
    out = Engine(split, drafter=drafter, num_draft_tokens=2).generate([[5, 9, 3]], SamplingParams(max_tokens=6))
    assert len(out[0].token_ids) == 6
    # compiled in bf16 with --mtp: the stored block keeps the float32 rotary buffers, and drafts as load_mtp does
    from ppsplit.cli import main

    assert main(["compile", folder, "--pp", "2", "--mtp", "--dtype", "bfloat16", "-o", str(tmp_path / "bf16"),
                 "--max-batch", "4", "--max-len", "48"]) == 0
    loaded = ppsplit.load(str(tmp_path / "bf16"))
    assert loaded.drafter.eh_proj.weight.dtype == torch.bfloat16
    again = Engine(loaded, drafter=loaded.drafter, num_draft_tokens=2).generate([[5, 9, 3]], SamplingParams(max_tokens=6))
    assert (again[0].token_ids, again[0].drafts) == (out[0].token_ids, out[0].drafts)


# -- across ranks: the MTP layer on the last rank ---------------------------------------------------------------------
_FOLDERS: dict = {}


def mtp_folder(arch, pp, tmp_path_factory, request):
    """``ppsplit compile CKPT --pp N --mtp`` (DeepSeek-V3: the trained layer, so drafts get accepted); (target,
    folder)."""
    from ppsplit.cli import main

    if (arch, pp) not in _FOLDERS:
        if arch == "deepseek_v3":
            target, ckpt, _ = request.getfixturevalue("trained")
        else:
            target, _, _, ckpt, _ = built(arch, tmp_path_factory)
        out = str(tmp_path_factory.mktemp(f"{arch}-pp{pp}") / "folder")
        assert main(["compile", ckpt, "--pp", str(pp), "--mtp", "-o", out, "--max-batch", "4", "--max-len", "64"]) == 0
        _FOLDERS[arch, pp] = target, out
    return _FOLDERS[arch, pp]


def _rank_prompts():
    return [p.tolist() for p in torch.randint(3, V, (4, 5), generator=torch.Generator().manual_seed(11))]


def check_mtp_across_ranks(target, folder, pp: int):
    """``_rank_prompts`` on ``pp`` gloo ranks of a folder holding an MTP layer (K = 3, requests arriving over two
    steps): tokens are Hugging Face's greedy ones, each request's drafts and acceptance per step the in-process
    engine's over the same folder, and no block is left in use. Returns rank 0's outputs and the in-process
    engine's."""
    from tests.processes import launch, serve

    prompts, params = _rank_prompts(), SamplingParams(max_tokens=14, ignore_eos=True)
    res = launch(pp, serve, folder, [(p, params, i // 2) for i, p in enumerate(prompts)], 3, timeout=60, deadline=240)
    assert all(res[r][0] == "ok" for r in range(pp)), {r: res[r][-1][-800:] for r in range(pp)}
    outputs, in_use, _, _ = res[0][1]
    assert in_use == 0 and sorted(outputs) == ["0", "1", "2", "3"]
    single = ppsplit.load(folder)
    assert single.drafter.family == "mtp"
    ref = Engine(single, drafter=single.drafter, num_draft_tokens=3).generate(prompts, params)
    for i, (prompt, expected) in enumerate(zip(prompts, ref)):
        tokens, _, accepted, drafts = outputs[str(i)]
        with torch.no_grad():
            greedy = target.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                                     eos_token_id=None)[0, len(prompt):].tolist()
        assert tokens == greedy == expected.token_ids
        assert (accepted, drafts) == (expected.accepted, expected.drafts)
    return outputs, ref


@pytest.mark.parametrize("arch, pp", [("deepseek_v3", 2), ("deepseek_v3", 1), (QWEN, 2)])
def test_mtp_across_ranks_equals_the_in_process_engine(arch, pp, tmp_path_factory, request):
    """One gloo process per stage, the folder's MTP layer (its block, own tensors and embedding copy from DIR/mtp) on
    the last rank reading the tap L the pipe carries: requests arriving over several steps give Hugging Face's greedy
    output, and each step's drafts and acceptance equal the in-process engine's over the same folder."""
    target, folder = mtp_folder(arch, pp, tmp_path_factory, request)
    outputs, _ = check_mtp_across_ranks(target, folder, pp)
    if arch == "deepseek_v3":  # the trained layer: the drafts the ranks compare are mostly accepted ones
        lengths = [1 + sum(outputs[str(i)][2]) / len(outputs[str(i)][2]) for i in range(4)]
        print(f"MTP across {pp} ranks, K=3: tokens per verify pass {[round(x, 2) for x in lengths]}")
        assert sum(lengths) / len(lengths) > 1.2, lengths


def test_cli_run_with_an_mtp_folder(tmp_path_factory, request, capfd):
    """``ppsplit run DIR -k 3`` on a folder compiled with ``--mtp``: one process per stage, the MTP layer on the last;
    it prints Hugging Face's greedy tokens and the in-process engine's acceptance."""
    from ppsplit.cli import main

    target, folder = mtp_folder("deepseek_v3", 2, tmp_path_factory, request)
    prompt = _rank_prompts()[0]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    single = ppsplit.load(folder)
    expected = Engine(single, drafter=single.drafter, num_draft_tokens=3).generate([prompt], params)[0]
    capfd.readouterr()
    code = main(["run", folder, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "14", "--ignore-eos",
                 "-k", "3", "--timeout", "60"])
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    assert lines[0] == ",".join(map(str, expected.token_ids)), out
    assert f"K=3, mean acceptance length {expected.mean_acceptance_length:.2f}" in lines[1], out


def test_mtp_failures_across_ranks_end_every_rank(tmp_path_factory, request, tmp_path):
    """A stored MTP config tampered with fails the last rank's load, and every rank ends with that one-line error; the
    last rank dying inside the MTP chain mid-run ends rank 0 with an error naming it. Nothing hangs."""
    import shutil

    from tests.processes import generate_and_fail, launch

    _, folder = mtp_folder("deepseek_v3", 2, tmp_path_factory, request)
    bad = str(tmp_path / "bad")
    shutil.copytree(folder, bad)
    where = os.path.join(bad, "mtp", "config.json")
    cfg = json.loads(open(where).read())
    with open(where, "w") as f:
        json.dump({**cfg, "ppsplit_taps": [1]}, f)
    prompts, params = _rank_prompts(), SamplingParams(max_tokens=14, ignore_eos=True)
    res = launch(2, generate_and_fail, bad, prompts, params, 1, 0, "kill", 3, timeout=30, deadline=120)
    for r in (0, 1):
        assert res[r][:2] == ("error", "ConfigError"), res[r]
        assert "the MTP layer reads taps [1]" in res[r][2] and "\n" not in res[r][2], res[r][2]
    assert res["alive"] == []
    # the chain's third call on the last rank kills it: rank 0 fails naming rank 1
    res = launch(2, generate_and_fail, folder, prompts, params, 1, 3, "kill", 3, "drafter", timeout=15, deadline=120)
    assert res[1] == ("exit", -9), res[1]
    assert res[0][:2] == ("error", "PipelineError") and "rank 1 died" in res[0][2], res[0]
    assert res["alive"] == []


def test_serve_ranks_with_an_mtp_folder(trained, tmp_path):
    """``ppsplit serve DIR --ranks 2 -k 3`` on a folder compiled with ``--mtp`` (a word-level tokenizer added): a
    batch of four prompts in one request gives the in-process engine's text, and the server counts its drafts and
    acceptances."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ppsplit.cli import main
    from tests.serve.test_server import MODEL, Live

    _, ckpt, _ = trained
    shutil.copytree(ckpt, tmp_path / "ckpt")
    word = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w3"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, unk_token="w3", eos_token="w2", pad_token="w0")
    tok.save_pretrained(tmp_path / "ckpt")
    folder = str(tmp_path / "pp2")
    assert main(["compile", str(tmp_path / "ckpt"), "--pp", "2", "--mtp", "-o", folder, "--max-batch", "4",
                 "--max-len", "64"]) == 0
    prompts, params = _rank_prompts(), SamplingParams(max_tokens=14)
    single = ppsplit.load(folder)
    ref = Engine(single, drafter=single.drafter, num_draft_tokens=3).generate(prompts, params)
    server = Live(folder, "--ranks", "2", "-k", "3")
    try:
        status, data = server.post("/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 14,
                                                       "temperature": 0})
        assert status == 200, data
        texts = [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])]
        assert texts == [tok.decode(r.token_ids, skip_special_tokens=True) for r in ref]
        metrics = server.metrics()
        assert metrics["ppsplit_spec_decode_accepted_tokens_total"] == sum(sum(r.accepted) for r in ref) > 0
        assert metrics["ppsplit_spec_decode_draft_tokens_total"] == sum(len(d) for r in ref for d in r.drafts)
    finally:
        server.proc.terminate()
        server.proc.wait(30)
