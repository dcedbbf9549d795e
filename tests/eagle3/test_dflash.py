"""DFlash (block diffusion) drafters on the last stage: folders written by the libraries' own save functions (z-lab's
``dflash`` package, speculators' ``dflash``), logits equal to the libraries' own forward on the same weights and
inputs, greedy output and per-step acceptance equal to ``dflash_generate`` and Hugging Face greedy at pp 1, 2, 3, a
drafter trained here, and every refusal in one line."""
import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ppsplit
from ppsplit import CacheConfig, ConfigError
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.serve.test_decode import cached
from tests.support import tiny_model

dflash = pytest.importorskip("dflash.model")

ZLAB_IDS = [0, 2, 3]  # dflash_config.target_layer_ids: layer outputs
TAPS = [1, 3, 4]  # the same tensors in ppsplit numbering (hidden_states[j]): +1
BLOCK = 4
MASK = 5
_SMALL: dict = {}

pytestmark = pytest.mark.usefixtures("one_thread")


def zlab_drafter(folder, vocab, seed=0, scale=0.05, **dflash_config):
    """A z-lab ``DFlashDraftModel`` with random weights, saved by its own ``save_pretrained``."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, block_size=BLOCK,
                      num_target_layers=5, dflash_config={"target_layer_ids": ZLAB_IDS, "mask_token_id": MASK,
                                                          **dflash_config})
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(seed)
    lib = dflash.DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for p in lib.parameters():
            p.add_(torch.randn_like(p) * scale)
    lib.save_pretrained(str(folder))
    return lib


def small():
    """A 32-token Qwen3 target without an end-of-sequence token (acceptance happens by chance), traced with a cache."""
    if not _SMALL:
        model = tiny_model("qwen3", vocab_size=32, eos_token_id=None)
        _SMALL["v"] = model, ppsplit.trace_model(model, cache=CacheConfig(batch_size=8, max_len=64))
    return _SMALL["v"]


def taps_of(model, ids):
    """The target's taps ``[3, T, H]`` in ppsplit numbering (``hidden_states[j]``) and z-lab's context features
    (``extract_context_feature``: ``hidden_states[id + 1]``)."""
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return torch.stack([hs[j][0] for j in TAPS]), dflash.extract_context_feature(hs, ZLAB_IDS)


# -- the drafter's forward equals the libraries' own ------------------------------------------------------------------
def test_zlab_folder_drafts_like_the_library(tmp_path):
    model, graph = cached("qwen3")
    lib = zlab_drafter(tmp_path / "z", model.config.vocab_size)
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    assert drafter.taps == tuple(TAPS) and drafter.block_size == BLOCK and drafter.lm_head is None
    # the target's lm_head on the last stage is shared, not copied
    last = split.stages[-1]
    assert any(t.data_ptr() == drafter.head.data_ptr() for t in (*last.parameters(), *last.buffers()))
    torch.manual_seed(1)
    for length in (1, 9):
        ids = torch.randint(3, 128, (1, length))
        aux, feats = taps_of(model, ids)
        block = torch.tensor([7, MASK, MASK, MASK])
        with torch.no_grad():  # the library's own forward, then the target's head (dflash_generate's compute_logits)
            hidden = lib(position_ids=torch.arange(length + BLOCK)[None], target_hidden=feats,
                         noise_embedding=model.get_input_embeddings()(block)[None])
            ref = lib.compute_logits(hidden, model.lm_head)[0]
            got = drafter(aux, block, torch.arange(length), torch.arange(length, length + BLOCK))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def speculators_drafter(folder, model, draft_vocab):
    """speculators' ``DFlashDraftModel`` (reduced draft vocabulary: its own lm_head and d2t), saved by its own
    ``save_pretrained``."""
    pytest.importorskip("speculators")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    vocab = model.config.vocab_size
    layer = Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=256,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                        layer_types=["full_attention"] * 2)
    layer._attn_implementation = "sdpa"
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=BLOCK, aux_hidden_state_layer_ids=TAPS,
        mask_token_id=MASK, speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    lib = DFlashDraftModel(cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lib.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
        lib.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(0)
    targets = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    lib.load_vocab_mappings(t2d, targets - torch.arange(draft_vocab))
    lib.save_pretrained(str(folder))
    return lib, targets


def test_speculators_folder_drafts_like_the_library(tmp_path):
    model, graph = cached("qwen3")
    lib, targets = speculators_drafter(tmp_path / "s", model, 96)
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "s"), split=split)
    assert drafter.taps == tuple(TAPS)  # speculators writes vLLM's numbering: as written
    assert drafter.lm_head is not None and torch.equal(drafter.target_ids, targets)
    torch.manual_seed(2)
    ids = torch.randint(3, 128, (1, 9))
    aux, _ = taps_of(model, ids)
    block = torch.tensor([7, MASK, MASK, MASK])
    with torch.no_grad():  # speculators' own modules, attending as its anchor mask does (context, block both ways)
        x = lib.embed_tokens(block)[None]
        ctx = lib.hidden_norm(lib.fc(torch.cat(list(aux), -1)))[None]
        rotary = lib.rotary_emb(x, torch.arange(9 + BLOCK)[None])
        for layer in lib.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=rotary)
        ref = lib.lm_head(lib.norm(x))[0]
        got = drafter(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("source", ["zlab", "speculators"])
def test_save_writes_speculators_dflash_layout(source, tmp_path):
    """``drafter.save`` writes speculators' dflash layout (what vLLM loads): speculators' own ``from_pretrained``
    reads it back with every tensor, its modules give the same logits, and ppsplit reloads the same drafter."""
    from speculators.models.dflash import DFlashDraftModel

    model, graph = cached("qwen3")
    if source == "zlab":
        zlab_drafter(tmp_path / "src", 128)
    else:
        speculators_drafter(tmp_path / "src", model, 96)
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "src"), split=split)
    drafter.save(str(tmp_path / "out"))  # no verifier: speculators would fetch it to rebuild the head
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == TAPS
    lib = DFlashDraftModel.from_pretrained(str(tmp_path / "out")).eval()
    again = ppsplit.load_drafter(str(tmp_path / "out"), split=split)
    torch.manual_seed(5)
    aux, _ = taps_of(model, torch.randint(3, 128, (1, 9)))
    block = torch.tensor([7, MASK, MASK, MASK])
    with torch.no_grad():
        x = model.get_input_embeddings()(block)[None]
        ctx = lib.hidden_norm(lib.fc(torch.cat(list(aux), -1)))[None]
        rotary = lib.rotary_emb(x, torch.arange(9 + BLOCK)[None])
        for layer in lib.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=rotary)
        head = lib.lm_head if drafter.lm_head is not None else model.lm_head  # full vocabulary: the verifier's head
        ref = head(lib.norm(x))[0]
        got = drafter(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK))
        assert torch.equal(again(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK)), got)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


# -- through the engine: lossless, and the library's acceptance step by step ----------------------------------------
@pytest.mark.parametrize("pp, engine_options", [(1, {}), (2, {}), (3, {}),
                                                 (2, {"max_num_batched_tokens": 8, "async_scheduling": True})])
def test_engine_equals_greedy_and_dflash_generate(pp, engine_options, tmp_path, monkeypatch):
    """Four requests batched: each output equals Hugging Face greedy and ``dflash_generate``'s, and the tokens each
    verify pass produced (accepted + 1) equal ``dflash_generate``'s acceptance lengths, step by step; also with
    prompts prefilled in chunks of a small token budget beside other requests' verify windows, scheduled ahead."""
    monkeypatch.setattr(dflash, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA
    model, graph = small()
    lib = zlab_drafter(tmp_path / "z", 32, seed=1, scale=0.5)
    split = ppsplit.split_model(graph, pp, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    torch.manual_seed(3)
    prompts = torch.randint(3, 32, (4, 7))
    outs = Engine(split, drafter=drafter, num_draft_tokens=BLOCK - 1, **engine_options).generate(
        list(prompts), SamplingParams(max_tokens=30))
    accepted = 0
    for prompt, out in zip(prompts, outs):
        ref = dflash.dflash_generate(lib, model, prompt[None], 30, None, return_stats=True)
        with torch.no_grad():
            greedy = model.generate(prompt[None], max_new_tokens=30, do_sample=False)[0, 7:].tolist()
        assert out.token_ids == greedy == ref.output_ids[0, 7:].tolist()
        assert [a + 1 for a in out.accepted] == ref.acceptance_lengths
        accepted += sum(out.accepted)
    assert accepted > 0  # some blocks were (partly) accepted, so the accept path ran, full blocks included
    assert max(max(o.accepted) for o in outs) == BLOCK - 1


def test_speculators_drafter_through_the_engine_is_lossless(tmp_path):
    model, graph = cached("qwen3")
    speculators_drafter(tmp_path / "s", model, 96)
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "s"), split=split)
    torch.manual_seed(4)
    prompts = torch.randint(3, 128, (2, 6))
    outs = Engine(split, drafter=drafter, num_draft_tokens=2).generate(list(prompts), SamplingParams(max_tokens=10))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            greedy = model.generate(prompt[None], max_new_tokens=10, do_sample=False)[0, 6:].tolist()
        assert out.token_ids == greedy[:len(out.token_ids)] and (len(out.token_ids) == 10 or out.token_ids[-1] == 2)
        assert len(out.accepted) >= 1 and all(0 <= a <= 2 for a in out.accepted)


def train_blocks(lib, model, block_loss, steps: int = 300):
    """Train z-lab's drafter ``lib`` (DFlash or DFlash2) on ``model``'s greedy continuations of 64 random 4-token
    prompts: Adam at 3e-3, ``steps`` batches of 16 sequences, one block at a random anchor each (the bonus token,
    then masks), the context the taps of the positions before it. ``block_loss(logits, hidden, s, anchor)`` is the
    family's loss of the block's drafting rows (``hidden``, and the target's head over them) for sequences ``s``."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        seqs = model.generate(torch.randint(3, 32, (64, 4), generator=g), max_new_tokens=36, do_sample=False)
        feats = dflash.extract_context_feature(model(seqs, output_hidden_states=True).hidden_states, ZLAB_IDS)
    embed, head = model.get_input_embeddings(), model.lm_head
    opt = torch.optim.Adam(lib.parameters(), lr=3e-3)
    lib.train()
    for _ in range(steps):
        pick = torch.randint(0, 64, (16,), generator=g)
        anchor = int(torch.randint(4, seqs.shape[1] - BLOCK + 1, (1,), generator=g))
        s = seqs[pick]
        block = torch.cat([s[:, anchor:anchor + 1], torch.full((16, BLOCK - 1), MASK)], 1)
        hidden = lib(position_ids=torch.arange(anchor + BLOCK)[None], target_hidden=feats[pick, :anchor],
                     noise_embedding=embed(block).detach())[:, 1:]
        loss = block_loss(head(hidden), hidden, s, anchor)
        opt.zero_grad()
        loss.backward()
        opt.step()
    lib.eval()


# -- a drafter trained here accepts ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_dflash(tmp_path_factory):
    """A DFlash drafter trained with the library's own model (300 Adam steps on the 32-token target's greedy
    continuations, blocks at random anchors), saved by its ``save_pretrained``: ``(target, folder, tmp dir)``."""
    tmp_path = tmp_path_factory.mktemp("dflash")
    model, _ = small()
    lib = zlab_drafter(tmp_path / "z", 32, seed=2, scale=0.02)
    train_blocks(lib, model, lambda logits, hidden, s, anchor: F.cross_entropy(
        logits.flatten(0, 1), s[:, anchor + 1:anchor + BLOCK].flatten()))
    lib.save_pretrained(str(tmp_path / "trained"))
    return model, str(tmp_path / "trained"), tmp_path


def batch_of_eight(model, folder, taps, k):
    """Eight 4-token prompts at once through the engine at pp 2 with the drafter in ``folder`` (``k`` drafts), the
    outputs checked to be the target's greedy tokens: ``(outputs, split, drafter, prompts)``."""
    _, graph = small()
    split = ppsplit.split_model(graph, 2, aux=taps)
    drafter = ppsplit.load_drafter(folder, split=split)
    prompts = torch.randint(3, 32, (8, 4), generator=torch.Generator().manual_seed(5))
    outs = Engine(split, drafter=drafter, num_draft_tokens=k).generate(list(prompts), SamplingParams(max_tokens=24))
    with torch.no_grad():
        greedy = model.generate(prompts, max_new_tokens=24, do_sample=False)[:, 4:].tolist()
    assert [o.token_ids for o in outs] == greedy
    return outs, split, drafter, prompts


def test_trained_drafter_accepts_more_than_one_token_per_pass(trained_dflash):
    """Every request of a batch of 8 averages more than one token per verify pass (the batch at least 2), each gets
    its own acceptance, and the outputs stay the target's greedy ones."""
    model, folder, _ = trained_dflash
    outs, split, drafter, prompts = batch_of_eight(model, folder, TAPS, BLOCK - 1)
    lengths = [o.mean_acceptance_length for o in outs]
    print(f"trained DFlash drafter, block {BLOCK}, batch of 8: tokens per verify pass {[round(x, 2) for x in lengths]}"
          f", mean {sum(lengths) / len(lengths):.2f}")
    assert min(lengths) > 1.0 and sum(lengths) / len(lengths) >= 2.0, lengths
    # each request's acceptance in the batch is the one it gets alone (no batch-minimum rule)
    alone = Engine(split, drafter=drafter, num_draft_tokens=BLOCK - 1).generate([prompts[0]],
                                                                                SamplingParams(max_tokens=24))
    assert alone[0].accepted == outs[0].accepted


def test_block_agreement_and_check_drafter(trained_dflash, capsys):
    """``block_agreement`` (what ``ppsplit check-drafter`` scores a DFlash drafter by) counts exactly the blocks whose
    first draft the library's own forward gets right on the same sequences; the CLI scores both numberings."""
    from ppsplit.cli import main
    from ppsplit.eagle3.dflash import block_agreement

    model, folder, tmp_path = trained_dflash
    _, graph = small()
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(folder, split=split)
    lib = dflash.DFlashDraftModel.from_pretrained(folder).eval()
    with torch.no_grad():
        seqs = model.generate(torch.randint(3, 32, (2, 4), generator=torch.Generator().manual_seed(6)),
                              max_new_tokens=12, do_sample=False)
        feats = dflash.extract_context_feature(model(seqs, output_hidden_states=True).hidden_states, ZLAB_IDS)
        hits = 0
        for b in range(2):
            for a in range(4, seqs.shape[1] - 1):
                block = torch.cat([seqs[b, a:a + 1], torch.full((BLOCK - 1,), MASK)])
                hidden = lib(position_ids=torch.arange(a + BLOCK)[None], target_hidden=feats[b:b + 1, :a],
                             noise_embedding=model.get_input_embeddings()(block)[None])
                hits += int(lib.compute_logits(hidden, model.lm_head)[0, 1].argmax() == seqs[b, a + 1])
    assert block_agreement(split, drafter, seqs, start=4) == (hits, 2 * (seqs.shape[1] - 5))
    assert hits > 0

    model.save_pretrained(str(tmp_path / "target"))
    capsys.readouterr()
    assert main(["check-drafter", str(tmp_path / "target"), folder, "--prompts", "3"]) == 0
    printed = capsys.readouterr().out
    assert "sglang: taps 1,3,4  first-draft agreement" in printed and "vllm: taps 0,2,3  first-draft agreement" \
        in printed, printed


# -- inside a compiled folder, and across ranks ----------------------------------------------------------------------
def compile_with_drafter(model, drafter, tmp_path):
    """``ppsplit compile TARGET --pp N --drafter DRAFTER`` at pp 1 and 2: ``{pp: folder}``."""
    from ppsplit.cli import main

    model.save_pretrained(str(tmp_path / "target"))
    folders = {}
    for pp in (1, 2):
        folders[pp] = str(tmp_path / f"pp{pp}")
        assert main(["compile", str(tmp_path / "target"), "--pp", str(pp), "--drafter", drafter, "-o", folders[pp],
                     "--max-batch", "4", "--max-len", "64"]) == 0
    return folders


@pytest.fixture(scope="module")
def compiled_dflash(trained_dflash):
    """``ppsplit compile TARGET --pp N --drafter DFLASH`` of the trained z-lab drafter at pp 1 and 2."""
    model, folder, tmp_path = trained_dflash
    return model, folder, compile_with_drafter(model, folder, tmp_path)


def _folder_prompts():
    return [p.tolist() for p in torch.randint(3, 32, (4, 5), generator=torch.Generator().manual_seed(8))]


def folder_engine(folder, k, threshold=None):
    """``ppsplit.load(folder)`` and an ``Engine`` over it speculating with the folder's drafter."""
    loaded = ppsplit.load(folder)
    if threshold is not None:
        loaded.drafter.confidence_threshold = threshold
    return loaded, Engine(loaded, drafter=loaded.drafter, num_draft_tokens=k)


def check_compiled_folder(model, drafter, folder, k, capsys, threshold=None):
    """The drafter a compiled folder stores (read from DIR/drafter only) against the same drafter loaded from its
    own folder over an in-process split of the same target: greedy output equals Hugging Face's, every request's
    drafts and acceptance per verify pass are equal; ``ppsplit generate DIR -k K [--confidence-threshold T]``
    prints the same. Returns ``(the folder's outputs, the in-process split)``."""
    from ppsplit.cli import main

    loaded, engine = folder_engine(folder, k, threshold)
    prompts, params = _folder_prompts(), SamplingParams(max_tokens=20)
    outs = engine.generate(prompts, params)
    _, graph = small()
    split = ppsplit.split_model(graph, loaded.plan.pp, aux=list(loaded.plan.taps))
    reference = ppsplit.load_drafter(drafter, split=split)
    if threshold is not None:
        reference.confidence_threshold = threshold
    ref = Engine(split, drafter=reference, num_draft_tokens=k).generate(prompts, params)
    for prompt, out, expected in zip(prompts, outs, ref):
        with torch.no_grad():
            greedy = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, 5:].tolist()
        assert out.token_ids == greedy == expected.token_ids
        assert out.accepted == expected.accepted and out.drafts == expected.drafts
    capsys.readouterr()
    flags = ["--confidence-threshold", str(threshold)] if threshold is not None else []
    assert main(["generate", folder, "--prompt-ids", ",".join(map(str, prompts[0])), "--max-new-tokens", "20",
                 "-k", str(k), *flags]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == ",".join(map(str, outs[0].token_ids))
    assert f"mean acceptance length {outs[0].mean_acceptance_length:.2f}" in printed, printed
    return outs, split


def test_compiled_folder_speculates_like_the_in_process_drafter(compiled_dflash, capsys):
    """The folder's drafter reads the taps its z-lab ids name (+1), stored with the target's embedding and head in
    the last stage's drafter file, and drafts as the in-process drafter (``check_compiled_folder``); save-drafter
    writes it out in speculators' layout, which drafts the same again."""
    from ppsplit.cli import main

    model, folder, folders = compiled_dflash
    loaded = ppsplit.load(folders[2])
    assert loaded.plan.taps == tuple(TAPS) and loaded.drafter.family == "dflash"
    assert loaded.drafter.taps == tuple(TAPS) and loaded.drafter.block_size == BLOCK
    outs, split = check_compiled_folder(model, folder, folders[2], BLOCK - 1, capsys)
    mean = sum(o.mean_acceptance_length for o in outs) / len(outs)
    assert mean > 1.5, mean
    # save-drafter: the folder's drafter out in speculators' dflash layout, which drafts the same again
    out = str(Path(folders[2]).parent / "exported")
    assert main(["save-drafter", folders[2], "-o", out]) == 0
    assert main(["save-drafter", folders[2], "--format", "specforge", "-o", out + "-x"]) == 2
    assert json.loads((Path(out) / "config.json").read_text())["speculators_model_type"] == "dflash"
    again = Engine(split, drafter=ppsplit.load_drafter(out, split=split), num_draft_tokens=BLOCK - 1).generate(
        _folder_prompts(), SamplingParams(max_tokens=20))
    assert [(o.token_ids, o.drafts) for o in again] == [(o.token_ids, o.drafts) for o in outs]


def check_across_ranks(pp, folder, k, threshold=None):
    """One gloo process per stage, the folder's drafter on the last rank (rank 0's scheduler reserves the
    lookahead the last rank's header tells it: K + 1 for a DFlash block), a DSpark drafter's ``threshold`` set
    there: tokens, drafts and acceptances equal the in-process engine over the same folder. Returns its outputs."""
    from tests.processes import TryAdd, launch, serve

    prompts, params = _folder_prompts(), SamplingParams(max_tokens=20)
    _, engine = folder_engine(folder, k, threshold)
    lookahead = k + engine.runner.sampler.proposer.drafter.first_draft_row
    # fits the cache's 64 positions with lookahead - 1 draft positions ahead, not with lookahead
    big = TryAdd([5] * 5, SamplingParams(max_tokens=64 - 5 - (lookahead - 1)))
    options = {"confidence_threshold": threshold} if threshold is not None else None
    res = launch(pp, serve, folder, [(p, params, i // 2) for i, p in enumerate(prompts)], k, options, big,
                 timeout=30, deadline=150)
    assert all(res[r][0] == "ok" for r in range(pp)), {r: res[r][-1][-800:] for r in range(pp)}
    outputs, in_use, _, big = res[0][1]
    assert f"+ {lookahead} draft positions needs 65 positions" in big.error, big.error
    ref = engine.generate(prompts, params)
    assert in_use == 0 and sorted(outputs) == ["0", "1", "2", "3"]
    for i, expected in enumerate(ref):
        tokens, _, accepted, drafts = outputs[str(i)]
        assert (tokens, accepted, drafts) == (expected.token_ids, expected.accepted, expected.drafts)
    assert sum(sum(o.accepted) for o in ref) > 0
    return ref


@pytest.mark.parametrize("pp", [1, 2])
def test_dflash_across_ranks_equals_the_in_process_engine(pp, compiled_dflash):
    """``check_across_ranks`` with the DFlash drafter; without the header's lookahead rank 0 would admit the
    request that only fits K positions ahead."""
    _, _, folders = compiled_dflash
    check_across_ranks(pp, folders[pp], BLOCK - 1)


def test_compiled_dflash_refusals(compiled_dflash, tmp_path):
    """A stored DFlash config edited by hand is refused in one line, naming the key."""
    import shutil

    _, _, folders = compiled_dflash
    for change, message in [(lambda c: c.update(frobnicate=1), "frobnicate"),
                            (lambda c: c.pop("block_size"), "lacks block_size"),
                            (lambda c: c.update(block_size="4"), "block_size")]:
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(folders[1], copy)
        edit_config(copy / "drafter", change)
        with pytest.raises(ppsplit.PpsplitError, match=message) as e:
            ppsplit.load(str(copy))
        assert "\n" not in str(e.value)


# -- refusals: one line, before anything loads ----------------------------------------------------------------------
def edit_config(folder, change):
    """Apply ``change`` to the ``config.json`` of ``folder`` (a drafter folder) in place."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(frobnicate=1), "drafter config key frobnicate"),
    (lambda c: c["dflash_config"].update(swa_window_size=8), "dflash_config.swa_window_size"),
    (lambda c: c["dflash_config"].update(causal=True), "dflash_config.causal"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8), "layer_types"),
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2 drafter config conv_kernel_size must be"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 2, 5]), "DFlash drafter tap id 5 is out of range"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[3, 0, 2]), "distinct and ascending"),
    (lambda c: c.update(num_target_layers=7), "trained on a 7-layer target"),
    (lambda c: c.update(block_size=1), "block_size must be an integer >= 2"),
    (lambda c: c["dflash_config"].update(mask_token_id=500), "mask_token_id"),
])
def test_bad_dflash_configs_are_refused_in_one_line(tmp_path, change, message):
    model, graph = cached("qwen3")
    zlab_drafter(tmp_path / "z", 128)
    edit_config(tmp_path / "z", change)
    split = ppsplit.split_model(graph, 1, aux=[1, 2, 3, 4])
    with pytest.raises(ConfigError, match=message) as e:
        ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    assert "\n" not in str(e.value)


def test_engine_refusals(tmp_path):
    model, graph = cached("qwen3")
    zlab_drafter(tmp_path / "z", 128)
    with pytest.raises(ConfigError, match=r"reads taps \[1, 3, 4\] but the split carries \[1, 2, 4\]"):
        ppsplit.load_drafter(str(tmp_path / "z"), split=ppsplit.split_model(graph, 1, aux=[1, 2, 4]))
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    with pytest.raises(ConfigError, match="num_draft_tokens=4 exceeds what one block"):
        Engine(split, drafter=drafter, num_draft_tokens=4)


# -- sampling stays lossless -----------------------------------------------------------------------------------------
def test_dflash_sampling_matches_target_distribution(tmp_path):
    """2000 copies of one prompt, two new tokens, drafts drawn from the block's distributions: the joint distribution
    of (first, second) token equals the target's p(t0) p(t1 | t0) (the acceptance rule of the first verify pass)."""
    from tests.eagle3.test_eagle3 import check_joint_sampling, traced

    model, graph = traced("small")  # a 32-token llama target: DFlash layers are Qwen3's whatever the target
    split = ppsplit.split_model(graph, 2, aux=TAPS, fuse=False)
    zlab_drafter(tmp_path / "z", 32, seed=3, scale=0.5)
    drafter = ppsplit.load_drafter(str(tmp_path / "z"), split=split)
    stats = check_joint_sampling(model, split, drafter, 2)
    assert stats.verify_passes == 1
