"""MiMo-V2-Flash's MTP layers (``model.mtp.layers.{i}``) as the drafter on the last stage, and MiMo-7B's refused.

The target is a tiny ``MiMoV2FlashForCausalLM`` (transformers' own class: full and sliding-window attention with
sinks, a dense layer 0 then MoE) saved by ``save_pretrained``; three MTP layers are written into its safetensors as
the real checkpoint names them (vLLM ``mimo_v2_mtp.py``: ``enorm``, ``hnorm``, ``eh_proj``, ``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``self_attn.attention_sink_bias``, ``pre_mlp_layernorm``, ``mlp.{gate,up,down}_proj``,
``final_layernorm``), which transformers drops on load. The reference (``VllmMTPLayer``) is written from vLLM's
``MiMoV2MTPLayer.forward`` and ``MiMoV2Attention``, not from transformers' decoder layer.
"""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import ppsplit
from ppsplit import ConfigError
from ppsplit.core.ragged import RaggedStep, Segment
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.eagle3.test_mtp import CACHE, check_folder_drafts_as_load_mtp, rms
from tests.support import random_model

V, H, L, HEADS, KV, D, DV, FFN = 32, 64, 3, 4, 1, 16, 8, 96
ROPE = {kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}
        for kind, theta in (("full_attention", 50000.0), ("sliding_attention", 1000.0))}
SHAPE = dict(vocab_size=V, hidden_size=H, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=HEADS,
             num_key_value_heads=KV, head_dim=D, v_head_dim=DV, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, sliding_window=4, attention_value_scale=0.6, rope_parameters=ROPE,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
PREFIX = "model.mtp.layers."


def mtp_layer(seed):
    """One MTP layer's tensors under the names of the real checkpoint: a sliding-window attention (twice the KV heads
    of a full-attention layer, as the target's sliding layers have) with sinks, and a dense MLP."""
    g = torch.Generator().manual_seed(seed)
    kv = 2 * KV

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)

    def norm():
        return 1 + 0.1 * torch.randn(H, generator=g)

    return {"enorm.weight": norm(), "hnorm.weight": norm(), "eh_proj.weight": w(H, 2 * H),
            "input_layernorm.weight": norm(), "self_attn.q_proj.weight": w(HEADS * D, H),
            "self_attn.k_proj.weight": w(kv * D, H), "self_attn.v_proj.weight": w(kv * DV, H),
            "self_attn.o_proj.weight": w(H, HEADS * DV), "self_attn.attention_sink_bias": w(HEADS, scale=1.0),
            "pre_mlp_layernorm.weight": norm(), "mlp.gate_proj.weight": w(FFN, H), "mlp.up_proj.weight": w(FFN, H),
            "mlp.down_proj.weight": w(H, FFN), "final_layernorm.weight": norm()}


def write_checkpoint(folder, target, layers, extra=None, drop=(), count=None):
    """``target`` saved by transformers, plus MTP layers ``layers`` at ``model.mtp.layers.{i}``; ``count``: the
    ``num_nextn_predict_layers`` written to config.json (None: none, as transformers' config declares none)."""
    target.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for i, layer in enumerate(layers):
        tensors.update({f"{PREFIX}{i}.{name}": t for name, t in layer.items() if name not in drop})
    tensors.update(extra or {})
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    if count is not None:
        cfg = json.loads(open(os.path.join(folder, "config.json")).read())
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**cfg, "num_nextn_predict_layers": count}, f)
    return str(folder)


class VllmMTPLayer(torch.nn.Module):
    """vLLM's ``MiMoV2MTPLayer.forward`` for the rows of one sequence at positions ``0..N-1``::

        h = eh_proj(cat(enorm(embed), hnorm(previous_hidden)))
        h = h + attn(input_layernorm(h))          MiMoV2Attention, the SWA configuration: partial neox rotary,
                                                  v * attention_value_scale, sinks, GQA, scale head_dim ** -0.5
        h = h + mlp(pre_mlp_layernorm(h))         MiMoV2MLP: down(silu(gate) * up)
        return final_layernorm(h)                 then the target's lm_head

    The window counts keys the way the target's transformers config does (``sliding_window`` keys, the query's own
    included), the same window as the target's sliding layers."""

    def __init__(self, t, config):
        super().__init__()
        self.t, self.eps = t, config.rms_norm_eps
        rope = config.rope_parameters["sliding_attention"]
        self.rot = int(D * rope["partial_rotary_factor"])
        self.inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, self.rot, 2).float() / self.rot)
        self.window, self.v_scale = config.sliding_window, config.attention_value_scale

    def rope(self, x, pos):
        freqs = pos[:, None].float() * self.inv_freq
        cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
        r, rest = x[..., :self.rot], x[..., self.rot:]
        half = torch.cat([-r[..., self.rot // 2:], r[..., :self.rot // 2]], -1)
        return torch.cat([r * cos + half * sin, rest], -1)

    def attn(self, x):
        t, n = self.t, x.shape[0]
        pos = torch.arange(n)
        q = self.rope(F.linear(x, t["self_attn.q_proj.weight"]).view(n, HEADS, D), pos)
        k = self.rope(F.linear(x, t["self_attn.k_proj.weight"]).view(n, -1, D), pos)
        v = F.linear(x, t["self_attn.v_proj.weight"]).view(n, -1, DV) * self.v_scale
        k, v = k.repeat_interleave(HEADS // k.shape[1], 1), v.repeat_interleave(HEADS // v.shape[1], 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        seen = (pos[:, None] >= pos[None]) & (pos[:, None] - pos[None] < self.window)
        scores = scores.masked_fill(~seen, float("-inf"))
        sink = t["self_attn.attention_sink_bias"][:, None, None].expand(-1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]  # the sink takes mass, gives no value
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, HEADS * DV)
        return F.linear(out, t["self_attn.o_proj.weight"])

    def forward(self, embeds, previous_hidden):
        t, eps = self.t, self.eps
        h = F.linear(torch.cat([rms(embeds, t["enorm.weight"], eps), rms(previous_hidden, t["hnorm.weight"], eps)],
                               -1), t["eh_proj.weight"])
        h = h + self.attn(rms(h, t["input_layernorm.weight"], eps))
        m = rms(h, t["pre_mlp_layernorm.weight"], eps)
        h = h + F.linear(F.silu(F.linear(m, t["mlp.gate_proj.weight"])) * F.linear(m, t["mlp.up_proj.weight"]),
                         t["mlp.down_proj.weight"])
        return rms(h, t["final_layernorm.weight"], eps)


@torch.no_grad()
def reference(target, layer, ids, chain):
    """Draft logits of every position of ``ids`` (position i: the target's final-normed hidden state of i and the
    embedding of token i + 1, nothing zeroed), then of each token of ``chain`` after the first at the next
    positions, each fed the previous row's output (after ``final_layernorm``), as vLLM's proposer chains the layer."""
    mtp = VllmMTPLayer(layer, target.config)
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    hidden = target(ids[None], output_hidden_states=True).hidden_states[-1][0]
    tokens = torch.cat([ids[1:], torch.tensor(chain[:1])])
    out = mtp(F.embedding(tokens, embed), hidden)
    logits = [F.linear(out, head)]
    for token in chain[1:]:
        tokens = torch.cat([tokens, torch.tensor([token])])
        hidden = torch.cat([hidden, out[-1:]])
        out = mtp(F.embedding(tokens, embed), hidden)
        logits.append(F.linear(out[-1:], head))
    return torch.cat(logits)


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """(target, its MTP layers, the checkpoint folder, the traced target)."""
    target = random_model(AutoConfig.for_model("mimo_v2_flash", **SHAPE))
    assert target.config.layer_types[1:] == ["sliding_attention"] * (L - 1)  # the window is the target's too
    layers = [mtp_layer(seed) for seed in (1, 2, 3)]  # three, as MiMo-V2-Flash ships; the first drafts
    folder = write_checkpoint(tmp_path_factory.mktemp("mimo") / "ckpt", target, layers)
    return target, layers, folder, ppsplit.trace_model(target, cache=CACHE)


def test_draft_logits_equal_the_vllm_reference(mimo):
    """Prefill rows of one sequence longer than the window, then two chain steps: the logits equal vLLM's layer 0,
    and the block holds a sliding-window attention with sinks and a dense MLP (no experts)."""
    target, layers, folder, traced = mimo
    split = ppsplit.split_model(traced, 2, aux=[L])
    drafter = ppsplit.load_mtp(folder, split=split)
    names = {n for n, _ in drafter.block.named_parameters()}
    assert any(n.endswith("self_attn.sinks") for n in names) and not any("experts" in n for n in names), names
    assert (drafter.zero_first, drafter.norm is not None) == (False, True)
    ids = torch.randint(3, V, (11,), generator=torch.Generator().manual_seed(7))
    T = ids.shape[0]
    step = RaggedStep.build([Segment(0, 0, T)], {0: [0]}, split.layout)
    _, aux = split.step(ids, step)
    chain = (9, 21, 30)
    logits, hidden = drafter(aux[:, None], torch.cat([ids[1:], torch.tensor(chain[:1])])[None], step)
    got = [logits[0]]
    for j, token in enumerate(chain[1:]):
        one = RaggedStep.build([Segment(0, T + j, 1)], {0: [0]}, split.layout)
        logits, hidden = drafter(hidden[:, -1:], torch.tensor([[token]]), one)
        got.append(logits[0])
    torch.testing.assert_close(torch.cat(got), reference(target, layers[0], ids, chain), rtol=1e-4, atol=1e-4)
    # the reference is sharp enough to see another layer, or the window of full attention
    assert not torch.allclose(torch.cat(got), reference(target, layers[1], ids, chain), atol=1e-2)


@pytest.mark.parametrize("pp, k", [(1, 2), (2, 3)])
def test_engine_output_equals_greedy(mimo, pp, k):
    """Requests of different lengths (beyond the window) batched, K drafts chained from layer 0: each output equals
    Hugging Face's greedy generate of the target alone."""
    target, _, folder, traced = mimo
    split = ppsplit.split_model(traced, pp, aux=[L])
    drafter = ppsplit.load_mtp(folder, split=split)
    prompts = [torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 13)]
    outs = Engine(split, drafter=drafter, num_draft_tokens=k).generate(
        prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            greedy = target.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert out.token_ids == greedy[0, len(prompt):].tolist()


def test_compiled_folder_drafts_as_load_mtp(mimo, tmp_path):
    """``ppsplit compile --mtp`` stores the MiMo-V2-Flash layer; the folder drafts and accepts exactly what
    ``load_mtp`` does over an in-process split, in one process and across two ranks, and its output is Hugging
    Face's greedy one."""
    from ppsplit.cli import main

    target, _, folder, traced = mimo
    out = str(tmp_path / "pp2")
    assert main(["compile", folder, "--pp", "2", "--mtp", "-o", out, "--max-batch", "8", "--max-len", "64"]) == 0
    prompts = [p.tolist() for p in torch.randint(3, V, (3, 6), generator=torch.Generator().manual_seed(3))]
    outs = check_folder_drafts_as_load_mtp(target, folder, traced, ppsplit.load(out), prompts, 10)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    # across two gloo ranks, the layer on the last: the same tokens, drafts and acceptance per step
    from tests.processes import launch, serve

    res = launch(2, serve, out, [(p, params, i) for i, p in enumerate(prompts)], 3, timeout=60, deadline=240)
    assert all(res[r][0] == "ok" for r in range(2)), {r: res[r][-1][-800:] for r in range(2)}
    ranks = res[0][1][0]
    assert [(ranks[str(i)][0], ranks[str(i)][2], ranks[str(i)][3]) for i in range(3)] == \
        [(o.token_ids, o.accepted, o.drafts) for o in outs]


def _one_line(call, message):
    with pytest.raises(ConfigError) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_checkpoints_are_refused_in_one_line(mimo, tmp_path, capsys):
    """A missing or unknown MTP tensor, one outside the layers, a declared count of 0; and MiMo-7B (model_type mimo,
    ``model.mtp_layers.*``, code only in its folder) by ``load_mtp`` and ``compile --mtp``, nothing written."""
    from ppsplit.cli import main

    target, layers, folder, traced = mimo
    split = ppsplit.split_model(traced, 2, aux=[L])
    load = lambda where: lambda: ppsplit.load_mtp(where, split=split)
    _one_line(load(write_checkpoint(tmp_path / "a", target, layers[:1], drop=("pre_mlp_layernorm.weight",))),
              f"lacks {PREFIX}0.pre_mlp_layernorm.weight")
    mystery = {f"{PREFIX}0.mlp.mystery": torch.ones(3)}
    _one_line(load(write_checkpoint(tmp_path / "b", target, layers[:1], extra=mystery)),
              f"does not account for: {PREFIX}0.mlp.mystery")
    stray = {"model.mtp.norm.weight": torch.ones(H)}
    _one_line(load(write_checkpoint(tmp_path / "c", target, layers[:1], extra=stray)),
              "MTP tensors outside its layers (model.mtp.norm.weight)")
    _one_line(load(write_checkpoint(tmp_path / "d", target, layers[:1], count=0)), "has no MTP layers")
    # MiMo-7B: a Qwen2-like decoder with MTP layers under model.mtp_layers, MiMoForCausalLM from its own folder
    seven = tmp_path / "mimo7b"
    os.makedirs(seven)
    (seven / "config.json").write_text(json.dumps({
        "model_type": "mimo", "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1,
        "auto_map": {"AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}, "num_hidden_layers": L}))
    save_file({"model.mtp_layers.0.input_proj.weight": torch.ones(H, 2 * H)}, str(seven / "model.safetensors"))
    message = "ppsplit never runs code from a folder"
    _one_line(load(str(seven)), message)
    capsys.readouterr()
    assert main(["compile", str(seven), "--pp", "2", "--mtp", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "out")
