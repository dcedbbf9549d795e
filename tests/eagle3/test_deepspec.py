"""DeepSpec's own DSpark folders (deepseek-ai/DeepSpec, ``deepspec/modeling/dspark``, commit afdfa7c): a reference
model written here from DeepSpec's published code (``qwen3/config.py: build_draft_config``, ``qwen3/modeling.py:
Qwen3DSparkModel``, ``markov_head.py``, ``common.py: AcceptRatePredictor / extract_context_feature``,
``eval/dspark/draft_ops.py: build_dspark_proposal``), saved by transformers' ``save_pretrained`` as DeepSpec's
trainer saves it, on a tiny Qwen3 target: ppsplit's logits, confidences and drafts equal the reference's, engine
output equals Hugging Face greedy at pp 1 and 2, check-drafter names the numbering, malformed folders are refused in
one line. DeepSpec is not on PyPI (and pins its own torch / transformers), so the reference stands in for it."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm,
                                                      Qwen3RotaryEmbedding, rotate_half)

import ppsplit
from ppsplit import ConfigError
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.eagle3.test_dflash import edit_config, small
from tests.support import bigram_markov
from tests.serve.test_decode import cached

IDS = [-1, 1, 3]  # DeepSpec's target_layer_ids: layer outputs (hidden_states[id + 1]), -1 the embedding output
TAPS = [0, 2, 4]  # the same taps in ppsplit's numbering
BLOCK = 4
MASK = 5

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the reference: DeepSpec's Qwen3DSparkModel at inference, written from its code -----------------------------------
class _Attention(nn.Module):
    """``Qwen3DSparkAttention``: keys/values of [context features; block rows], q/k norms, no mask."""

    def __init__(self, c):
        super().__init__()
        hd, bias = c.head_dim, c.attention_bias
        self.heads, self.kv, self.hd = c.num_attention_heads, c.num_key_value_heads, hd
        self.q_proj = nn.Linear(c.hidden_size, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv * hd, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, c.hidden_size, bias=bias)
        self.q_norm, self.k_norm = Qwen3RMSNorm(hd, eps=c.rms_norm_eps), Qwen3RMSNorm(hd, eps=c.rms_norm_eps)

    def forward(self, x, ctx, cos, sin):
        n, t = x.shape[1], ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(1, n, self.heads, self.hd)).transpose(1, 2)
        k = self.k_norm(torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(1, t + n, self.kv, self.hd))
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(1, t + n, self.kv, self.hd).transpose(1, 2)
        k = k.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # queries take the last n positions (the block's)
        q = q * cos[..., -n:, :] + rotate_half(q) * sin[..., -n:, :]
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=self.hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(1, n, -1))


class _Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = _Attention(c), Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x, ctx, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Markov(nn.Module):
    """``VanillaMarkov`` / ``GatedMarkovHead`` / ``RNNHead``: one step's bias from the previous token."""

    def __init__(self, kind, vocab, rank, hidden):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        if kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(self, prev, h, state):
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e), state
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return self.markov_w2(torch.tanh(out)), gate * state + (1.0 - gate) * torch.tanh(cand)


class _Confidence(nn.Module):  # AcceptRatePredictor
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class Qwen3DSparkModel(Qwen3PreTrainedModel):
    """DeepSpec's draft model (its class name, so ``save_pretrained`` writes its architecture), inference only."""

    def __init__(self, config):
        super().__init__(config)
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.markov_head = _Markov(c.markov_head_type.lower(), c.vocab_size, c.markov_rank, c.hidden_size) \
            if c.markov_rank else None
        self.with_markov = bool(c.enable_confidence_head and c.confidence_head_with_markov)
        self.confidence_head = _Confidence(c.hidden_size + (c.markov_rank if self.with_markov else 0)) \
            if c.enable_confidence_head else None
        self.post_init()

    def context(self, target, ids):
        """``extract_context_feature``: ``hidden_states[id + 1]`` of the target's forward, concatenated."""
        with torch.no_grad():
            hs = target(ids[None], output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1] for i in self.config.target_layer_ids], -1)

    def block(self, target, ids, bonus):
        """``_forward_backbone`` of the block ``[bonus, mask x (B - 1)]`` at ``len(ids)`` after the context ``ids``:
        the block's rows after ``norm`` ``[B, H]``."""
        ctx = self.hidden_norm(self.fc(self.context(target, ids)))
        x = self.embed_tokens(torch.tensor([[bonus] + [self.config.mask_token_id] * (self.config.block_size - 1)]))
        cos, sin = self.rotary_emb(x, torch.arange(len(ids) + x.shape[1])[None])
        for layer in self.layers:
            x = layer(x, ctx, cos, sin)
        return self.norm(x)[0]

    def heads(self, hidden, prev, greedy):
        """The Markov head left to right (``sample_block_tokens`` at temperature 0 when ``greedy``, else
        ``apply_block_logits`` teacher-forced by ``prev``), then ``predict_confidence_step``. ``(drafts, logits,
        confidence logits)``."""
        base, token, state = self.lm_head(hidden), prev[0], torch.zeros(self.config.markov_rank)
        logits, drafts = [], []
        for i in range(hidden.shape[0]):
            step = base[i]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(token, hidden[i], state)
                step = step + bias
            logits.append(step)
            drafts.append(step.argmax())
            token = drafts[-1] if greedy else prev[min(i + 1, len(prev) - 1)]
        drafts, logits = torch.stack(drafts), torch.stack(logits)
        prevs = torch.cat([prev[:1], drafts[:-1]]) if greedy else prev
        conf = None
        if self.confidence_head is not None:
            feats = torch.cat([hidden, self.markov_head.markov_w1(prevs)], -1) if self.with_markov else hidden
            conf = self.confidence_head.proj(feats)[:, 0].float()
        return drafts, logits, conf

    @torch.no_grad()
    def propose(self, target, ids, bonus):
        """``build_dspark_proposal`` (temperature 0, no threshold): the block's drafts, logits, confidences."""
        return self.heads(self.block(target, ids, bonus), torch.tensor([bonus]), greedy=True)


def deepspec_folder(folder, target, kind="vanilla", rank=8, confidence=True, with_markov=True, seed=0, scale=0.1,
                    prepare=None, layers=2, ids=IDS):
    """A DeepSpec DSpark folder for ``target``: the draft config as ``build_draft_config`` writes it, random weights,
    the target's embedding and head copied (``initialize_embeddings_and_head``), ``save_pretrained``."""
    c = copy.deepcopy(target.config)
    c.architectures = ["Qwen3DSparkModel"]
    c.num_target_layers = c.num_hidden_layers
    c.num_hidden_layers = layers
    c.block_size, c.tie_word_embeddings, c.layer_types = BLOCK, False, ["full_attention"] * layers
    c.mask_token_id, c.target_layer_ids, c.num_anchors = MASK, ids, 512
    c.enable_confidence_head, c.markov_rank = confidence, rank
    if confidence:
        c.confidence_head_with_markov = with_markov
    if rank:
        c.markov_head_type = kind
    ref = Qwen3DSparkModel(c).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
        ref.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        ref.lm_head.weight.copy_(target.lm_head.weight)
    if prepare is not None:
        prepare(ref)
    ref.save_pretrained(str(folder))
    return ref


# -- the drafter's forward equals the reference's --------------------------------------------------------------------
@pytest.mark.parametrize("kind, rank, confidence, with_markov", [
    ("vanilla", 8, True, True), ("gated", 8, True, True), ("rnn", 8, True, False), ("Vanilla", 8, False, False),
    (None, 0, True, False)])
def test_deepspec_folder_drafts_like_the_reference(tmp_path, kind, rank, confidence, with_markov):
    model, graph = cached("qwen3")
    ref = deepspec_folder(tmp_path / "d", model, kind, rank, confidence, with_markov)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["target_layer_ids"] == IDS
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    assert drafter.family == "dspark" and drafter.taps == tuple(TAPS) and drafter.first_draft_row == 0
    assert drafter.max_drafts == BLOCK and drafter.lm_head is None
    assert (drafter.confidence_head is not None) == confidence and (drafter.markov_head is not None) == bool(rank)
    # the checked copies are dropped: the target's own tables are used, not second ones
    last = split.stages[-1]
    assert any(t.data_ptr() == drafter.head.data_ptr() for t in (*last.parameters(), *last.buffers()))
    for seed, n, bonus in ((1, 9, 7), (2, 1, 30)):
        ids = torch.randint(6, 128, (n,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
            aux = torch.stack([hs[t][0] for t in TAPS])
            block = torch.tensor([bonus] + [MASK] * (BLOCK - 1))
            # teacher-forced (DeepSpec's training forward: prev = the anchor, then the block's targets)
            prev = torch.tensor([bonus, 40, 41, 42])
            logits, conf = drafter(aux, block, torch.arange(n), torch.arange(n, n + BLOCK), prev)
            _, ref_logits, ref_conf = ref.heads(ref.block(model, ids, bonus), prev, greedy=False)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
            if confidence:
                torch.testing.assert_close(conf, ref_conf, rtol=1e-4, atol=1e-4)
            else:
                assert conf is None and ref_conf is None
            # drafting one at a time, as the engine does, against DeepSpec's build_dspark_proposal
            rows = drafter.block_rows(aux, block, torch.arange(n), torch.arange(n, n + BLOCK))[None]
            drafts, seq_logits, seq_conf = drafter.heads(rows, torch.tensor([bonus]),
                                                         lambda x, i: drafter.target_ids[x.argmax(-1)])
        ref_drafts, ref_seq_logits, ref_seq_conf = ref.propose(model, ids, bonus)
        assert drafts[0].tolist() == ref_drafts.tolist()
        torch.testing.assert_close(seq_logits[0], ref_seq_logits, rtol=1e-4, atol=1e-4)
        if confidence:
            torch.testing.assert_close(seq_conf[0], ref_seq_conf, rtol=1e-4, atol=1e-4)


def test_the_last_layer_id_reads_the_raw_output_deepspec_trains_on(tmp_path):
    """DeepSpec's evaluator refuses the last layer's id (transformers' ``hidden_states[L]`` is after the final norm),
    while its target cache (``scripts/data/prepare_target_cache.py``) stores that layer's raw output through a forward
    hook. ppsplit's tap L is that raw output, so id L - 1 is read as tap L: the drafter sees what it was trained on."""
    model, graph = cached("qwen3")
    last = model.config.num_hidden_layers - 1
    ref = deepspec_folder(tmp_path / "d", model, ids=[1, last])
    split = ppsplit.split_model(graph, 2, aux=[2, last + 1])
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    assert drafter.taps == (2, last + 1)
    ids, prev = torch.randint(6, 128, (9,), generator=torch.Generator().manual_seed(6)), torch.tensor([7, 8, 9, 10])
    raw = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda module, args, out, i=i: raw.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in (1, last)]
    with torch.no_grad():
        model(ids[None])
        for hook in hooks:
            hook.remove()
        ref.context = lambda target, ids: torch.cat([raw[1], raw[last]], -1)  # the target cache's features
        _, ref_logits, ref_conf = ref.heads(ref.block(model, ids, 7), prev, greedy=False)
        _, aux = split(ids[None], torch.arange(9))
        logits, conf = drafter(aux[:, 0], torch.tensor([7] + [MASK] * (BLOCK - 1)), torch.arange(9),
                               torch.arange(9, 9 + BLOCK), prev)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf, ref_conf, rtol=1e-4, atol=1e-4)


# -- through the engine ----------------------------------------------------------------------------------------------
def knows_the_target(model, strength):
    """test_dspark's bigram Markov head scaled to ``strength`` (its bias is 20 there): weak enough that the
    backbone's context features still decide drafts (the tiny target's head gives logits of a few tenths; at 4 the
    head alone decides every draft, and the context could be read from the wrong taps unnoticed), strong enough
    that some are accepted."""
    bigram = bigram_markov(model)

    def prepare(ref):
        bigram(ref)
        with torch.no_grad():
            ref.markov_head.markov_w2.weight.mul_(strength / 20.0)
    return prepare


def confident_prefix(conf, threshold):
    """DeepSpec's ``_confident_prefix_length``: the drafts before the first whose own confidence is below."""
    low = (torch.sigmoid(conf) < threshold).nonzero()
    return len(conf) if threshold <= 0 or len(low) == 0 else int(low[0, 0])


@pytest.mark.parametrize("pp, threshold", [(1, 0.0), (2, 0.0), (2, 0.4)])
def test_engine_drafts_like_the_reference_and_equals_greedy(tmp_path, pp, threshold):
    """Four requests batched, K = block size (every row drafts): each output equals Hugging Face greedy, and every
    verify window carries exactly the drafts DeepSpec's proposal makes for its context, cut where its evaluator
    cuts them (the first confidence below the threshold; vLLM's survival rule would cut some elsewhere); some are
    accepted."""
    model, graph = small()
    ref = deepspec_folder(tmp_path / "d", model, rank=model.config.vocab_size, seed=1, scale=0.5,
                          prepare=knows_the_target(model, 0.5))
    split = ppsplit.split_model(graph, pp, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    drafter.confidence_threshold = threshold
    assert drafter.confidence_rule == "each"
    prompts = torch.randint(6, 32, (4, 7), generator=torch.Generator().manual_seed(3))
    outs = Engine(split, drafter=drafter, num_draft_tokens=BLOCK).generate(list(prompts),
                                                                           SamplingParams(max_tokens=24))
    full_windows, counts, rules_differ = 0, set(), False
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            greedy = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, 7:].tolist()
        assert out.token_ids == greedy
        full, at, records = torch.tensor(prompt.tolist() + out.token_ids), 7, list(zip(out.accepted, out.drafts))
        while records:
            drafts, _, conf = ref.propose(model, full[:at], int(full[at]))
            kept = confident_prefix(conf, threshold)
            counts.add(kept)
            rules_differ |= kept != int((torch.sigmoid(conf).cumprod(0) >= threshold).sum())
            if kept == 0:  # a plain decode step, which verifies nothing
                at += 1
                continue
            accepted, verified = records.pop(0)
            assert verified == drafts.tolist()[:kept], (at, verified, drafts, kept)
            full_windows += len(verified) == BLOCK
            at += accepted + 1
    assert sum(sum(o.accepted) for o in outs) > 0
    if threshold:
        assert len(counts) > 2 and rules_differ, counts
    else:
        assert full_windows > 0


def test_sampling_with_deepspec_trimming_keeps_the_target_distribution(tmp_path):
    """2000 copies of one prompt at T = 0.8, drafts drawn through the Markov head, windows cut by DeepSpec's rule: the
    joint distribution of the first two tokens is the target's (chi-square, with power)."""
    from tests.eagle3.test_eagle3 import check_joint_sampling

    model, _ = small()
    graph = ppsplit.trace_model(model, cache=ppsplit.CacheConfig(batch_size=2000, max_len=48))
    split = ppsplit.split_model(graph, 2, aux=TAPS, fuse=False)
    deepspec_folder(tmp_path / "d", model, seed=3, scale=0.5)
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    drafter.confidence_threshold = 0.2
    check_joint_sampling(model, split, drafter, 3)


def test_save_converts_to_speculators_dspark(tmp_path):
    """``drafter.save`` writes a DeepSpec drafter in speculators' dspark layout: speculators' own modules, read by its
    ``from_pretrained``, give the reference's logits and confidences (taps now in vLLM's numbering)."""
    pytest.importorskip("speculators")
    from speculators.models.dspark import DSparkDraftModel
    from tests.eagle3.test_dspark import library_block

    model, graph = cached("qwen3")
    ref = deepspec_folder(tmp_path / "d", model, "gated")
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    ppsplit.load_drafter(str(tmp_path / "d"), split=split).save(str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["aux_hidden_state_layer_ids"] == TAPS and cfg["sample_from_anchor"] is True
    lib = DSparkDraftModel.from_pretrained(str(tmp_path / "out")).eval()
    lib.lm_head.weight.data.copy_(model.lm_head.weight)  # a full vocabulary: speculators takes the verifier's head
    lib.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    ids, prev = torch.randint(6, 128, (9,), generator=torch.Generator().manual_seed(4)), torch.tensor([7, 8, 9, 10])
    with torch.no_grad():
        _, ref_logits, ref_conf = ref.heads(ref.block(model, ids, 7), prev, greedy=False)
    with pytest.MonkeyPatch.context() as mp:  # library_block reads test_dspark's tap ids
        mp.setattr("tests.eagle3.test_dspark.TAPS", TAPS)
        logits, conf = library_block(lib, model, ids, 7, prev)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf, ref_conf, rtol=1e-4, atol=1e-4)


def test_check_drafter_names_deepspec_numbering(tmp_path, capsys):
    """check-drafter reads DeepSpec's ids as layer outputs (sglang: +1; -1, the embedding output, has no vLLM id)."""
    from ppsplit.cli import main

    model, _ = small()
    deepspec_folder(tmp_path / "d", model, rank=model.config.vocab_size, seed=1, scale=0.5,
                    prepare=bigram_markov(model))
    model.save_pretrained(str(tmp_path / "target"))
    capsys.readouterr()
    assert main(["check-drafter", str(tmp_path / "target"), str(tmp_path / "d"), "--prompts", "3"]) == 0
    out = capsys.readouterr().out
    assert "sglang: taps 0,2,4  first-draft agreement" in out and "vllm: not applicable" in out
    assert "fits: sglang" in out, out


# -- refusals: one line, before anything loads ----------------------------------------------------------------------
def _drop_tensor(name):
    def change(folder):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        del tensors[name]
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return change


def _scale_tensor(name):
    def change(folder):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        tensors[name] = tensors[name] * 1.5
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return change


def _config(change):
    return lambda folder: edit_config(folder, change)


@pytest.mark.parametrize("change, message", [
    (_config(lambda c: c.update(frobnicate=1)), "drafter config key frobnicate"),
    (_config(lambda c: c.pop("mask_token_id")), "lacks mask_token_id"),
    (_config(lambda c: c.pop("confidence_head_with_markov")), "lacks confidence_head_with_markov"),
    (_config(lambda c: c.update(markov_head_type="lstm")), "markov_head_type 'lstm'"),
    (_config(lambda c: c.update(architectures=["Gemma4DSparkModel"])), "Gemma4 draft layers"),
    (_config(lambda c: c.update(target_layer_ids=[-1, 1, 5])), "tap id 5 is out of range"),
    (_config(lambda c: c.update(target_layer_ids=[1, -1, 3])), "distinct and ascending"),
    (_config(lambda c: c.update(num_target_layers=7)), "trained on a 7-layer target"),
    (_config(lambda c: c.update(enable_confidence_head=False)), "tensors its config does not account for"),
    (_drop_tensor("markov_head.markov_w2.weight"), "lacks: markov_head.markov_w2.weight"),
    (_drop_tensor("lm_head.weight"), "lacks lm_head.weight"),
    (_scale_tensor("lm_head.weight"), "lm_head.weight .* is not this target's lm_head"),
    (_scale_tensor("embed_tokens.weight"), "embed_tokens.weight .* is not this target's input embedding"),
])
def test_malformed_deepspec_folders_are_refused_in_one_line(tmp_path, change, message):
    model, graph = cached("qwen3")
    deepspec_folder(tmp_path / "d", model)
    change(tmp_path / "d")
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    with pytest.raises(ConfigError, match=message) as e:
        ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    assert "\n" not in str(e.value)


def test_confidence_rule_refusal(tmp_path):
    model, graph = cached("qwen3")
    deepspec_folder(tmp_path / "d", model)
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=ppsplit.split_model(graph, 1, aux=TAPS))
    with pytest.raises(ConfigError, match="confidence_rule must be 'survival'"):
        drafter.confidence_rule = "min"


def test_compiled_folder_keeps_deepspec_trimming(tmp_path, capsys):
    """``ppsplit compile --drafter DEEPSPEC``: the folder stores the drafter without DeepSpec's copies of the target's
    tables (checked equal on the way in) and keeps its trimming rule (``each``); at pp 2 with threshold 0.4 its
    drafts, acceptance and greedy output equal the drafter loaded from DeepSpec's folder, in one process and as
    ``ppsplit generate DIR -k K --confidence-threshold 0.4`` prints them."""
    from tests.eagle3.test_dflash import check_compiled_folder, compile_with_drafter

    model, _ = small()
    deepspec_folder(tmp_path / "d", model, rank=model.config.vocab_size, seed=1, scale=0.5,
                    prepare=knows_the_target(model, 0.5))
    folders = compile_with_drafter(model, str(tmp_path / "d"), tmp_path)
    loaded = ppsplit.load(folders[2])
    assert loaded.drafter.family == "dspark" and loaded.drafter.confidence_rule == "each"
    outs, _ = check_compiled_folder(model, str(tmp_path / "d"), folders[2], BLOCK, capsys, threshold=0.4)
    assert sum(sum(o.accepted) for o in outs) > 0

def test_a_bf16_split_takes_the_float32_copies(tmp_path):
    """DeepSpec saves its frozen copies of the target's tables in float32; over a bf16 split they are compared at
    bf16 (the coarser precision) and accepted; a copy that differs at bf16 is still refused."""
    model, _ = small()
    deepspec_folder(tmp_path / "d", model)
    split = ppsplit.split_model(copy.deepcopy(model).to(torch.bfloat16), 1, aux=TAPS)  # the cached target stays fp32
    assert ppsplit.load_drafter(str(tmp_path / "d"), split=split).family == "dspark"
    _scale_tensor("embed_tokens.weight")(tmp_path / "d")
    with pytest.raises(ConfigError, match="is not this target's input embedding"):
        ppsplit.load_drafter(str(tmp_path / "d"), split=split)


def test_compile_checks_the_copies_against_the_target(tmp_path, capsys):
    """``compile --drafter`` reads the target's embedding from its checkpoint to check DeepSpec's copy against (not
    the copy itself): a copy that is not the target's is refused in one line and nothing is written."""
    from ppsplit.cli import main

    model, _ = small()
    deepspec_folder(tmp_path / "d", model)
    _scale_tensor("embed_tokens.weight")(tmp_path / "d")
    model.save_pretrained(str(tmp_path / "target"))
    capsys.readouterr()
    assert main(["compile", str(tmp_path / "target"), "--pp", "2", "--drafter", str(tmp_path / "d"), "-o",
                 str(tmp_path / "out"), "--max-batch", "4", "--max-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not this target's input embedding" in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()
