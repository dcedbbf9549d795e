"""DFlash2 drafters (convolutions around each draft layer's sublayers, a candidate selector after the head): z-lab's
``DFlash2DraftModel`` and speculators' ``dflash2``, saved by their own ``save_pretrained``; drafts equal the libraries'
own forward and ``propose`` / ``CandidateSelector``; through the engine at pp 1, 2, 3 the output and the acceptance of
every verify pass equal ``dflash_generate``'s and Hugging Face's greedy; sampling keeps the target's distribution."""
import json
import time

import pytest
import torch
import torch.nn.functional as F

import ppsplit
from ppsplit import ConfigError
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.eagle3.test_dflash import edit_config, small, train_blocks
from tests.serve.test_decode import cached

dflash = pytest.importorskip("dflash.model")
if not hasattr(dflash, "DFlash2DraftModel"):
    pytest.skip("the installed dflash package has no DFlash2DraftModel", allow_module_level=True)

ZLAB_IDS = [0, 2, 3]  # layer outputs
TAPS = [1, 3, 4]
BLOCK = 4
MASK = 5
CONV = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}

pytestmark = pytest.mark.usefixtures("one_thread")


def randomise(lib, scale, seed):
    """Seeded random weights (z-lab leaves the convolutions' base kernels uninitialised): norms and base kernels
    around their identity, the rest around 0."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in lib.named_parameters():
            p.copy_(torch.randn_like(p) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
            if name.endswith("base_kernel"):
                p[:, 0] += 1.0


def zlab_dflash2(folder, vocab, seed=0, scale=0.05):
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, block_size=BLOCK,
                      num_target_layers=5, dflash_config={"target_layer_ids": ZLAB_IDS, "mask_token_id": MASK, **CONV})
    cfg.architectures = ["DFlash2DraftModel"]
    lib = dflash.DFlash2DraftModel(cfg).eval()
    randomise(lib, scale, seed)
    lib.save_pretrained(str(folder))
    return lib


def feats_of(model, ids):
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return torch.stack([hs[j][0] for j in TAPS]), dflash.extract_context_feature(hs, ZLAB_IDS)


@pytest.mark.parametrize("length", [1, 9])
def test_zlab_dflash2_drafts_like_the_library(tmp_path, length):
    """The block's logits equal the library's forward + ``compute_logits``; the drafts ppsplit's selector picks one
    at a time equal ``DFlash2DraftModel.propose``'s (greedy)."""
    model, graph = cached("qwen3")
    lib = zlab_dflash2(tmp_path / "z", model.config.vocab_size)
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    assert drafter.family == "dflash2" and drafter.taps == tuple(TAPS)
    torch.manual_seed(1)
    ids = torch.randint(6, 128, (1, length))
    aux, feats = feats_of(model, ids)
    block = torch.tensor([7, MASK, MASK, MASK])
    with torch.no_grad():
        hidden = lib(position_ids=torch.arange(length + BLOCK)[None], target_hidden=feats,
                     noise_embedding=model.get_input_embeddings()(block)[None])
        ref = lib.compute_logits(hidden, model.lm_head)[0]
        ref_drafts, _, _ = lib.propose(hidden[:, 1:], block[:1], model.lm_head, 0.0)
        got = drafter(aux, block, torch.arange(length), torch.arange(length, length + BLOCK))
        rows = drafter.block_rows(aux, block, torch.arange(length), torch.arange(length, length + BLOCK))
        drafts, _, _ = drafter.heads(rows[None, 1:], block[:1], lambda x, i: x.max(-1).indices)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(drafts, ref_drafts)


def speculators_dflash2(folder, model):
    pytest.importorskip("speculators")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    vocab = model.config.vocab_size
    layer = Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=256,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                        layer_types=["full_attention"] * 2)
    layer._attn_implementation = "sdpa"
    cfg = DFlash2SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=vocab, block_size=BLOCK, aux_hidden_state_layer_ids=TAPS,
        mask_token_id=MASK, **CONV, speculators_config=SpeculatorsConfig(
            algorithm="dflash2", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    lib = DFlash2DraftModel(cfg).eval()
    randomise(lib, 0.1, 0)
    with torch.no_grad():
        lib.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        lib.lm_head.weight.copy_(model.lm_head.weight)
    lib.save_pretrained(str(folder))
    return lib


def test_speculators_dflash2_drafts_like_the_library(tmp_path):
    """speculators' own layers (convolutions inside) and ``CandidateSelector.select`` give ppsplit's logits, and the
    selector's best candidate, fed the drafts before it, is ppsplit's draft at every position."""
    model, graph = cached("qwen3")
    lib = speculators_dflash2(tmp_path / "s", model)
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "s"), split=split)
    assert drafter.family == "dflash2"
    torch.manual_seed(2)
    ids = torch.randint(6, 128, (1, 9))
    aux, _ = feats_of(model, ids)
    block = torch.tensor([7, MASK, MASK, MASK])
    with torch.no_grad():
        x = lib.embed_tokens(block)[None]
        ctx = lib.hidden_norm(lib.fc(torch.cat(list(aux), -1)))[None]
        rotary = lib.rotary_emb(x, torch.arange(9 + BLOCK)[None])
        for layer in lib.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=rotary)
        hidden = lib.norm(x)
        ref = lib.lm_head(hidden)[0]
        got = drafter(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK))
        rows = drafter.block_rows(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK))
        drafts, _, _ = drafter.heads(rows[None, 1:], block[:1], lambda x, i: x.max(-1).indices)
        prev = torch.cat([block[:1], drafts[0, :-1]])[None]
        candidates, scores = lib.candidate_selector.select(ref[None, 1:], hidden[:, 1:], prev)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(drafts, candidates.gather(-1, scores.max(-1).indices[..., None])[..., 0])


@pytest.mark.parametrize("pp, engine_options", [(1, {}), (2, {}), (3, {}),
                                                 (2, {"max_num_batched_tokens": 8, "async_scheduling": True})])
def test_engine_equals_greedy_and_dflash_generate(pp, engine_options, tmp_path, monkeypatch):
    """Four requests batched: each output equals Hugging Face greedy and ``dflash_generate``'s with the DFlash2
    drafter, and the tokens of every verify pass equal its acceptance lengths, step by step."""
    monkeypatch.setattr(dflash, "_cuda_time", time.perf_counter)
    model, graph = small()
    lib = zlab_dflash2(tmp_path / "z", 32, seed=1, scale=0.5)
    split = ppsplit.split_model(graph, pp, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    torch.manual_seed(3)
    prompts = torch.randint(3, 32, (4, 7))
    outs = Engine(split, drafter=drafter, num_draft_tokens=BLOCK - 1, **engine_options).generate(
        list(prompts), SamplingParams(max_tokens=30))
    for prompt, out in zip(prompts, outs):
        ref = dflash.dflash_generate(lib, model, prompt[None], 30, None, return_stats=True)
        with torch.no_grad():
            greedy = model.generate(prompt[None], max_new_tokens=30, do_sample=False)[0, 7:].tolist()
        assert out.token_ids == greedy == ref.output_ids[0, 7:].tolist()
        assert [a + 1 for a in out.accepted] == ref.acceptance_lengths
    assert sum(sum(o.accepted) for o in outs) > 0


def test_stand_in_graphs_equal_the_eager_engine(tmp_path):
    """The captured drafter's parts (``ppsplit.serve.draft_graphs``, through the eager stand-in for capture), the
    convolutions running on the static buffers' blocks: the same tokens and acceptance as eager."""
    from ppsplit.serve.draft_graphs import BlockGraphs
    from tests.serve.test_draft_graphs import eager_capture

    _, graph = small()
    zlab_dflash2(tmp_path / "z", 32, seed=1, scale=0.5)
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    prompts = [torch.randint(3, 32, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 5, 9)]
    runs = []
    for graphs in (False, True):
        drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
        engine = Engine(split, drafter=drafter, num_draft_tokens=BLOCK - 1)
        proposer = engine.runner.sampler.proposer
        if graphs:
            proposer.graphs = BlockGraphs(drafter, BLOCK, split.plan, split.layout, range(1, 65),
                                          capture_fn=eager_capture)
        runs.append((engine.generate(prompts, SamplingParams(max_tokens=24)), proposer.graphs))
    (eager, _), (graphed, blocks) = runs
    assert [(o.token_ids, o.accepted) for o in graphed] == [(o.token_ids, o.accepted) for o in eager]
    assert sum(sum(o.accepted) for o in eager) > 0 and blocks.greedy[4][0].replays > 0  # the selector in the graph


@pytest.fixture(scope="module")
def trained_dflash2(tmp_path_factory):
    """z-lab's ``DFlash2DraftModel`` trained here, as ``test_dflash.trained_dflash`` trains DFlash (300 Adam steps on
    the 32-token target's greedy continuations, blocks at random anchors): cross-entropy on the head's logits and on
    the selector's scores over its candidates (predecessors teacher-forced); saved by its ``save_pretrained``."""
    tmp_path = tmp_path_factory.mktemp("dflash2")
    model, _ = small()
    lib = zlab_dflash2(tmp_path / "z", 32, seed=2, scale=0.02)
    selector = lib.candidate_selector

    def block_loss(logits, hidden, s, anchor):
        gold = s[:, anchor + 1:anchor + BLOCK]
        unary, candidates = logits.topk(selector.top_k, dim=-1)
        pair = selector.predecessor_codebook(s[:, anchor:anchor + BLOCK - 1]) * selector.hidden_projection(hidden)
        scores = unary + torch.einsum("bpr,bpkr->bpk", pair, selector.successor_codebook(candidates))
        hit = candidates == gold[..., None]
        loss = F.cross_entropy(logits.flatten(0, 1), gold.flatten())
        if hit.any():
            loss = loss - (scores.log_softmax(-1) * hit).sum(-1)[hit.any(-1)].mean()
        return loss

    train_blocks(lib, model, block_loss)
    lib.save_pretrained(str(tmp_path / "trained"))
    return model, str(tmp_path / "trained")


def test_trained_dflash2_accepts_more_than_one_token_per_pass(trained_dflash2):
    """Every request of a batch of 8 averages more than one token per verify pass through the trained drafter's
    convolutions and selector, and the outputs stay the target's greedy ones."""
    from tests.eagle3.test_dflash import batch_of_eight

    model, folder = trained_dflash2
    outs, _, _, _ = batch_of_eight(model, folder, TAPS, BLOCK - 1)
    lengths = [o.mean_acceptance_length for o in outs]
    print(f"trained DFlash2 drafter, block {BLOCK}, batch of 8: tokens per verify pass "
          f"{[round(x, 2) for x in lengths]}, mean {sum(lengths) / len(lengths):.2f}")
    assert min(lengths) > 1.0 and sum(lengths) / len(lengths) >= 1.5, lengths


# -- inside a compiled folder, and across ranks ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled_dflash2(tmp_path_factory):
    """``ppsplit compile TARGET --pp N --drafter DFLASH2`` (a z-lab DFlash2 folder) at pp 1 and 2."""
    from tests.eagle3.test_dflash import compile_with_drafter

    tmp_path = tmp_path_factory.mktemp("compiled-dflash2")
    model, _ = small()
    zlab_dflash2(tmp_path / "z", 32, seed=1, scale=0.5)
    return model, str(tmp_path / "z"), compile_with_drafter(model, str(tmp_path / "z"), tmp_path)


def test_compiled_folder_speculates_like_the_in_process_drafter(compiled_dflash2, capsys):
    """The folder stores every DFlash2 tensor (convolutions, candidate selector) and their sizes: its drafter gives
    Hugging Face's greedy output and the same drafts and acceptance per verify pass as the drafter loaded from
    z-lab's folder over an in-process split; ``ppsplit generate DIR -k 3`` prints the same."""
    from pathlib import Path

    from safetensors import safe_open

    from tests.eagle3.test_dflash import check_compiled_folder

    model, folder, folders = compiled_dflash2
    with safe_open(str(Path(folders[2]) / "drafter" / "drafter.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    stored = json.loads((Path(folders[2]) / "drafter" / "config.json").read_text())
    assert stored["ppsplit_family"] == "dflash2" and all(stored[k] == v for k, v in CONV.items())
    outs, _ = check_compiled_folder(model, folder, folders[2], BLOCK - 1, capsys)
    assert sum(sum(o.accepted) for o in outs) > 0


@pytest.mark.parametrize("pp", [1, 2])
def test_dflash2_across_ranks_equals_the_in_process_engine(pp, compiled_dflash2):
    """``check_across_ranks`` with the DFlash2 drafter on the last rank (a K + 1 block, as DFlash); a confidence
    threshold for it (not DSpark) ends every rank with the same one-line error."""
    from tests.eagle3.test_dflash import check_across_ranks
    from tests.processes import launch, serve

    _, _, folders = compiled_dflash2
    check_across_ranks(pp, folders[pp], BLOCK - 1)
    res = launch(pp, serve, folders[pp], [], BLOCK - 1, {"confidence_threshold": 0.5}, timeout=30, deadline=90)
    for r in range(pp):
        assert res[r][:2] == ("error", "ConfigError"), res[r]
        assert "--confidence-threshold trims a DSpark drafter's verify windows (the drafter here: dflash2)" in res[r][2]


def test_dflash2_sampling_matches_target_distribution(tmp_path):
    """2000 copies of one prompt on a Llama target, drafts drawn from the selector's candidates: the joint
    distribution of the first two tokens equals the target's."""
    from tests.eagle3.test_eagle3 import check_joint_sampling, traced

    model, graph = traced("small")
    split = ppsplit.split_model(graph, 2, aux=TAPS, fuse=False)
    zlab_dflash2(tmp_path / "z", 32, seed=3, scale=0.5)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    check_joint_sampling(model, split, drafter, 2)


@pytest.mark.parametrize("change, message", [
    (lambda c: c["dflash_config"].update(conv_group_size=24), "conv_group_size 24 does not divide hidden_size 64"),
    (lambda c: c["dflash_config"].update(selector_top_k=0), "selector_top_k must be an integer >= 1"),
    (lambda c: c["dflash_config"].update(selector_top_k=500), "selector_top_k 500 exceeds the vocabulary"),
    (lambda c: c["dflash_config"].pop("selector_rank"), "selector_rank must be an integer >= 1, but got None"),
    (lambda c: c["dflash_config"].update(frobnicate=1), "dflash_config.frobnicate"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]), "dflash_config.conv_"),
])
def test_bad_dflash2_configs_are_refused_in_one_line(tmp_path, change, message):
    model, graph = cached("qwen3")
    zlab_dflash2(tmp_path / "z", 128)
    edit_config(tmp_path / "z", change)
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    with pytest.raises(ConfigError, match=message) as e:
        ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    assert "\n" not in str(e.value)


def test_save_writes_speculators_dflash2_layout(tmp_path):
    """``drafter.save`` of a z-lab DFlash2 folder writes speculators' dflash2 layout: its own ``from_pretrained``
    reads every tensor back, its layers and selector give ppsplit's logits and drafts, ppsplit reloads the same."""
    from speculators.models.dflash2 import DFlash2DraftModel

    model, graph = cached("qwen3")
    zlab_dflash2(tmp_path / "z", model.config.vocab_size)
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    drafter.save(str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2" and all(cfg[k] == v for k, v in CONV.items())
    assert cfg["aux_hidden_state_layer_ids"] == TAPS  # vLLM's numbering
    lib = DFlash2DraftModel.from_pretrained(str(tmp_path / "out")).eval()
    again = ppsplit.load_drafter(str(tmp_path / "out"), split=split)
    torch.manual_seed(4)
    aux, _ = feats_of(model, torch.randint(6, 128, (1, 9)))
    block = torch.tensor([7, MASK, MASK, MASK])
    with torch.no_grad():
        x = model.get_input_embeddings()(block)[None]
        ctx = lib.hidden_norm(lib.fc(torch.cat(list(aux), -1)))[None]
        rotary = lib.rotary_emb(x, torch.arange(9 + BLOCK)[None])
        for layer in lib.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=rotary)
        hidden = lib.norm(x)
        ref = model.lm_head(hidden)[0]  # a full vocabulary: speculators reloads the verifier's head
        got = drafter(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK))
        assert torch.equal(again(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK)), got)
        rows = drafter.block_rows(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK))
        drafts, _, _ = drafter.heads(rows[None, 1:], block[:1], lambda x, i: x.max(-1).indices)
        prev = torch.cat([block[:1], drafts[0, :-1]])[None]
        candidates, scores = lib.candidate_selector.select(ref[None, 1:], hidden[:, 1:], prev)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(drafts, candidates.gather(-1, scores.max(-1).indices[..., None])[..., 0])
