"""DSpark drafters (speculators' ``dspark``: DFlash's backbone, a Markov head, a confidence head) on the last stage:
folders written by speculators' own ``save_pretrained``, logits / confidences / drafts equal to speculators' own
modules, greedy output equal to Hugging Face's at pp 1, 2, 3 with confidence-trimmed verify windows of different
lengths in one step, the target's distribution kept when sampling, and every refusal in one line."""
import json
from pathlib import Path

import pytest
import torch

import ppsplit
from ppsplit import ConfigError
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.eagle3.test_dflash import edit_config, small
from tests.serve.test_decode import cached
from tests.support import bigram_markov

pytest.importorskip("speculators")

TAPS = [1, 3, 4]  # speculators writes vLLM's numbering (hidden_states[j]): ppsplit's
BLOCK = 4
MASK = 5

pytestmark = pytest.mark.usefixtures("one_thread")


def dspark_drafter(folder, model, draft_vocab=None, seed=0, scale=0.1, prepare=None, **options):
    """speculators' ``DSparkDraftModel`` with random weights (``options``: its config fields; ``prepare(lib)``: set
    some), saved by its own ``save_pretrained``; ``(library model, the draft vocabulary's target ids)``."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    vocab = model.config.vocab_size
    draft_vocab = draft_vocab or vocab
    layer = Qwen3Config(hidden_size=model.config.hidden_size, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=vocab,
                        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                        layer_types=["full_attention"] * 2)
    layer._attn_implementation = "sdpa"
    options = {"markov_rank": 8, **options}
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=BLOCK,
        aux_hidden_state_layer_ids=TAPS, mask_token_id=MASK, **options, speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    lib = DSparkDraftModel(cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in lib.named_parameters():
            p.copy_(torch.randn_like(p) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
        lib.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        if draft_vocab == vocab:  # a full vocabulary: the verifier's head (speculators does not save it)
            lib.lm_head.weight.copy_(model.lm_head.weight)
    if prepare is not None:
        prepare(lib)
    targets = torch.arange(vocab)
    if draft_vocab != vocab:
        targets = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:draft_vocab]).values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
        lib.load_vocab_mappings(t2d, targets - torch.arange(draft_vocab))
    lib.save_pretrained(str(folder))
    return lib, targets


def library_block(lib, model, ids, bonus, prev):
    """speculators' own modules on one block at ``len(ids)``: the context's taps, the block ``[bonus, mask x 3]``
    attending as its anchor mask does (context, block both ways), then its Markov head (teacher-forced by ``prev``,
    the token before each slot's prediction, as its ``forward`` does) and confidence head. ``(logits, confidence)``."""
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
        aux = torch.cat([hs[j] for j in TAPS], -1)
        block = torch.tensor([bonus] + [MASK] * (BLOCK - 1))
        x = lib.embed_tokens(block)[None]
        ctx = lib.hidden_norm(lib.fc(aux))
        rotary = lib.rotary_emb(x, torch.arange(len(ids) + BLOCK)[None])
        for layer in lib.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=rotary)
        hidden = lib.norm(x)
        prev = torch.as_tensor(prev)[None]
        logits = lib.lm_head(hidden)
        if lib.markov_head is not None:
            emb = lib.markov_head.prev_embeddings(prev)
            logits = logits + lib.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)
        features = torch.cat([hidden, emb], -1) if lib.config.confidence_head_with_markov else hidden
        return logits[0], lib.confidence_head(features)[0]


def ppsplit_taps(model, ids):
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    return torch.stack([hs[j][0] for j in TAPS])


# -- the drafter's forward equals the library's own ----------------------------------------------------------------
@pytest.mark.parametrize("kind, draft_vocab, anchor", [("vanilla", None, True), ("gated", 96, True),
                                                       ("rnn", None, True), ("vanilla", None, False), (None, 96, True)])
def test_speculators_dspark_drafts_like_the_library(tmp_path, kind, draft_vocab, anchor):
    """Teacher-forced logits and confidences of every block row equal speculators' modules (each Markov head type, a
    reduced vocabulary, both anchor layouts, no Markov head); the drafts ppsplit proposes one at a time (each biased
    by the draft before it) are the argmax of the library's logits when fed those same drafts."""
    model, graph = cached("qwen3")
    heads = {"markov_head_type": kind} if kind else {"markov_rank": 0, "confidence_head_with_markov": False}
    lib, targets = dspark_drafter(tmp_path / "d", model, draft_vocab, sample_from_anchor=anchor, **heads)
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    assert drafter.family == "dspark" and drafter.taps == tuple(TAPS)
    assert drafter.first_draft_row == (0 if anchor else 1) and drafter.max_drafts == BLOCK - 1 + anchor
    assert torch.equal(drafter.target_ids, targets)
    torch.manual_seed(2)
    ids = torch.randint(6, 128, (9,))
    aux = ppsplit_taps(model, ids)
    block = torch.tensor([7] + [MASK] * (BLOCK - 1))
    prev = torch.tensor([7, 40, 41, 42]) if anchor else torch.tensor([7, 7, 40, 41])
    ref_logits, ref_conf = library_block(lib, model, ids, 7, prev)
    with torch.no_grad():
        logits, conf = drafter(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK), prev)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(conf, ref_conf, rtol=1e-4, atol=1e-4)
        # sequential drafting, as the engine does it, against the library teacher-forced by ppsplit's own drafts
        skip = drafter.first_draft_row
        rows = drafter.block_rows(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK))[None, skip:]
        drafts, seq_logits, seq_conf = drafter.heads(rows, torch.tensor([7]),
                                                     lambda x, i: drafter.target_ids[x.argmax(-1)])
    fed = torch.cat([torch.tensor([7] * (1 + skip)), drafts[0, :-1]])
    lib_logits, lib_conf = library_block(lib, model, ids, 7, fed)
    torch.testing.assert_close(seq_logits[0], lib_logits[skip:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seq_conf[0], lib_conf[skip:], rtol=1e-4, atol=1e-4)
    assert torch.equal(drafts[0], targets[lib_logits[skip:].argmax(-1)])


@pytest.mark.parametrize("kind, draft_vocab", [("gated", 96), ("rnn", None)])
def test_save_writes_speculators_dspark_layout(tmp_path, kind, draft_vocab):
    """``drafter.save`` writes speculators' dspark layout: its own ``from_pretrained`` reads it back (every tensor,
    the heads' config), its modules give the same logits and confidences, and ppsplit reloads the same drafter."""
    from speculators.models.dspark import DSparkDraftModel

    model, graph = cached("qwen3")
    dspark_drafter(tmp_path / "src", model, draft_vocab, markov_head_type=kind)
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "src"), split=split)
    drafter.save(str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["markov_head_type"] == kind and cfg["sample_from_anchor"]
    lib = DSparkDraftModel.from_pretrained(str(tmp_path / "out")).eval()
    if draft_vocab is None:  # speculators rebuilds a full-vocabulary head from the verifier: give it the target's
        lib.lm_head.weight.data.copy_(model.lm_head.weight)
    lib.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    again = ppsplit.load_drafter(str(tmp_path / "out"), split=split)
    torch.manual_seed(5)
    ids = torch.randint(6, 128, (9,))
    aux, block, prev = ppsplit_taps(model, ids), torch.tensor([7] + [MASK] * (BLOCK - 1)), torch.tensor([7, 8, 9, 10])
    ref_logits, ref_conf = library_block(lib, model, ids, 7, prev)
    with torch.no_grad():
        logits, conf = drafter(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK), prev)
        logits2, conf2 = again(aux, block, torch.arange(9), torch.arange(9, 9 + BLOCK), prev)
    assert torch.equal(logits, logits2) and torch.equal(conf, conf2)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf, ref_conf, rtol=1e-4, atol=1e-4)


# -- through the engine: lossless, windows trimmed per request -------------------------------------------------------
def plans_of(engine):
    """Record every step's plan: ``[(slot, count, num_drafts, fed) of each decoding window]`` per step (the last token
    and its drafts; a request whose drafts were all trimmed feeds its last token alone)."""
    seen, schedule = [], engine.scheduler.schedule

    def record(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        if plan is not None:
            seen.append([(w.slot, w.count, w.num_drafts, w.fed) for r, w in plan.entries
                         if w.fed or w.position >= len(r.prompt)])
        return plan
    engine.scheduler.schedule = record
    return seen


@pytest.mark.parametrize("pp, engine_options", [(1, {}), (2, {}), (3, {}),
                                                 (2, {"max_num_batched_tokens": 8, "async_scheduling": True})])
def test_engine_trims_windows_and_equals_greedy(pp, engine_options, tmp_path):
    """Four requests batched, the confidence threshold on: each output equals Hugging Face greedy; each verify
    window carries exactly the drafts speculators' modules propose for its context, cut where their confidences'
    survival drops below the threshold; and one step verifies windows of different lengths. With async scheduling
    (windows the device fills in) the windows keep K + 1 rows and the device verifies only the kept drafts."""
    model, graph = small()
    lib, _ = dspark_drafter(tmp_path / "d", model, seed=1, scale=0.5, markov_rank=32, prepare=bigram_markov(model))
    split = ppsplit.split_model(graph, pp, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    drafter.confidence_threshold = 0.3
    engine = Engine(split, drafter=drafter, num_draft_tokens=BLOCK, **engine_options)
    plans = plans_of(engine)
    torch.manual_seed(3)
    prompts = torch.randint(6, 32, (4, 7))
    outs = engine.generate(list(prompts), SamplingParams(max_tokens=24))
    lengths = set()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            greedy = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, 7:].tolist()
        assert out.token_ids == greedy
        full = torch.tensor(prompt.tolist() + out.token_ids)
        at, records = 7, list(zip(out.accepted, out.drafts))  # the first window's bonus token: the prefill's token
        while records:
            drafts, conf = [], []
            bonus = int(full[at])
            for i in range(BLOCK):  # the library, one draft at a time (its teacher forcing by its own argmaxes)
                logits, c = library_block(lib, model, full[:at], bonus, [bonus] + drafts + [0] * (BLOCK - 1 - i))
                drafts.append(int(logits[i].argmax()))
                conf.append(float(c[i]))
            kept = int((torch.sigmoid(torch.tensor(conf)).cumprod(0) >= 0.3).sum())
            lengths.add(kept)
            if kept == 0 and records[0][1]:  # the host knew: a plain decode step, which verifies nothing
                at += 1
                continue
            accepted, verified = records.pop(0)  # (a window the device fed verifies [] when nothing is kept)
            assert verified == drafts[:kept], (at, verified, drafts, kept)
            at += accepted + 1
    assert len(lengths) > 1 and sum(sum(o.accepted) for o in outs) > 0
    windows = [w for step in plans for w in step]
    assert all(count == 1 + drafts for _, count, drafts, fed in windows if not fed)  # 1 + kept rows
    assert all(count == BLOCK + 1 for _, count, _, fed in windows if fed)  # K + 1 rows, the kept ones verified
    if engine_options.get("async_scheduling"):
        assert any(fed for *_, fed in windows)
    else:  # the host knows each count: windows of different lengths in one step
        assert any(len({count for _, count, _, _ in step}) > 1 for step in plans), plans


def test_fewer_drafts_than_the_block(trained_dspark):
    """K = 2 of a block of 4 (a 2-row block: the anchor and one mask), threshold on, async scheduling: still the
    target's greedy output, and drafts are accepted."""
    model, folder = trained_dspark
    _, graph = small()
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    drafter = ppsplit.load_drafter(folder, split=split)
    drafter.confidence_threshold = 0.3
    prompts = torch.randint(6, 32, (4, 4), generator=torch.Generator().manual_seed(7))
    outs = Engine(split, drafter=drafter, num_draft_tokens=2, async_scheduling=True).generate(
        list(prompts), SamplingParams(max_tokens=20))
    with torch.no_grad():
        greedy = model.generate(prompts, max_new_tokens=20, do_sample=False)[:, 4:].tolist()
    assert [o.token_ids for o in outs] == greedy
    assert sum(sum(o.accepted) for o in outs) > 0 and all(len(d) <= 2 for o in outs for d in o.drafts)


# -- a drafter trained here accepts, and trimming keeps what it accepts --------------------------------------------
@pytest.fixture(scope="module")
def trained_dspark(tmp_path_factory):
    """A DSpark drafter trained with speculators' own modules (400 Adam steps on the 32-token target's greedy
    continuations, blocks at random anchors: cross-entropy of every slot, and its confidence against whether the
    slot's argmax is the target's token), saved by its ``save_pretrained``: ``(target, folder)``."""
    tmp_path = tmp_path_factory.mktemp("dspark")
    model, _ = small()
    lib, _ = dspark_drafter(tmp_path / "init", model, seed=2, scale=0.02, markov_rank=16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        seqs = model.generate(torch.randint(6, 32, (256, 4), generator=g), max_new_tokens=36, do_sample=False)
        hs = model(seqs, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[j] for j in TAPS], -1)
    params = [p for n, p in lib.named_parameters() if not n.startswith(("embed_tokens", "lm_head", "verifier"))]
    opt = torch.optim.Adam(params, lr=3e-3)
    lib.train()
    T = seqs.shape[1]
    for _ in range(400):
        pick = torch.randint(0, len(seqs), (32,), generator=g)
        a = int(torch.randint(4, T - BLOCK, (1,), generator=g))
        s = seqs[pick]
        block = torch.cat([s[:, a:a + 1], torch.full((32, BLOCK - 1), MASK)], 1)
        x = lib.embed_tokens(block)
        ctx = lib.hidden_norm(lib.fc(feats[pick, :a]))
        rotary = lib.rotary_emb(x, torch.arange(a + BLOCK)[None])
        for layer in lib.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=rotary)
        hidden = lib.norm(x)
        prev = s[:, a:a + BLOCK]  # sample_from_anchor: slot k predicts a + k + 1 after the token at a + k
        emb = lib.markov_head.prev_embeddings(prev)
        logits = lib.lm_head(hidden) + lib.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden,
                                                                  prev_emb=emb)
        target = s[:, a + 1:a + 1 + BLOCK]
        confidence = lib.confidence_head(torch.cat([hidden, emb], -1))
        hit = (logits.argmax(-1) == target).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()) \
            + torch.nn.functional.binary_cross_entropy_with_logits(confidence, hit)
        opt.zero_grad()
        loss.backward()
        opt.step()
    lib.eval()
    lib.save_pretrained(str(tmp_path / "trained"))
    return model, str(tmp_path / "trained")


def test_trained_dspark_accepts_and_trimming_drops_what_it_would_reject(trained_dspark):
    """Every request of a batch of 8 averages more than one token per verify pass, each gets its own acceptance, and
    the outputs stay the target's greedy ones; with the confidence threshold the same outputs come from far fewer
    verified drafts, a larger share of them accepted."""
    model, folder = trained_dspark
    _, graph = small()
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    prompts = torch.randint(6, 32, (8, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        greedy = model.generate(prompts, max_new_tokens=24, do_sample=False)[:, 4:].tolist()
    seen = {}
    for threshold in (0.0, 0.5):
        drafter = ppsplit.load_drafter(folder, split=split)
        drafter.confidence_threshold = threshold
        engine = Engine(split, drafter=drafter, num_draft_tokens=BLOCK)
        outs = engine.generate(list(prompts), SamplingParams(max_tokens=24))
        assert [o.token_ids for o in outs] == greedy
        lengths = [o.mean_acceptance_length for o in outs]
        verified = sum(len(d) for o in outs for d in o.drafts)
        accepted = sum(sum(o.accepted) for o in outs)
        seen[threshold] = outs, lengths, verified, accepted
        print(f"trained DSpark drafter, block {BLOCK}, threshold {threshold}, batch of 8: tokens per verify pass "
              f"{[round(x, 2) for x in lengths]}, mean {sum(lengths) / len(lengths):.2f}; drafts verified {verified}, "
              f"accepted {accepted} ({accepted / max(1, verified):.2f}), steps {engine.steps}")
    outs, lengths, verified, accepted = seen[0.0]
    assert min(lengths) > 1.0 and sum(lengths) / len(lengths) >= 2.0, lengths
    alone = Engine(split, drafter=ppsplit.load_drafter(folder, split=split), num_draft_tokens=BLOCK).generate(
        [prompts[0]], SamplingParams(max_tokens=24))
    assert alone[0].accepted == outs[0].accepted  # each request's own acceptance, not the batch's
    _, _, trimmed_verified, trimmed_accepted = seen[0.5]
    assert trimmed_verified < verified / 2 and trimmed_accepted / trimmed_verified > 1.5 * accepted / verified


def test_block_agreement_and_check_drafter(trained_dspark, tmp_path, capsys):
    """``block_agreement`` (check-drafter's score) counts exactly the blocks whose first draft (the anchor row through
    the Markov head, after the bonus token) speculators' modules get right; the CLI scores the numbering."""
    from ppsplit.cli import main
    from ppsplit.eagle3.dflash import block_agreement

    model, folder = trained_dspark
    _, graph = small()
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(folder, split=split)
    from speculators.models.dspark import DSparkDraftModel
    lib = DSparkDraftModel.from_pretrained(folder).eval()
    lib.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    lib.lm_head.weight.data.copy_(model.lm_head.weight)
    with torch.no_grad():
        seqs = model.generate(torch.randint(6, 32, (2, 4), generator=torch.Generator().manual_seed(6)),
                              max_new_tokens=10, do_sample=False)
    prev = lambda b, a: (seqs[b, a:a + BLOCK].tolist() + [0] * BLOCK)[:BLOCK]  # noqa: E731  (slot 0 reads prev[0])
    hits = sum(int(library_block(lib, model, seqs[b, :a], int(seqs[b, a]), prev(b, a))[0][0].argmax() == seqs[b, a + 1])
               for b in range(2) for a in range(4, seqs.shape[1] - 1))
    assert block_agreement(split, drafter, seqs, start=4) == (hits, 2 * (seqs.shape[1] - 5)) and hits > 0
    model.save_pretrained(str(tmp_path / "target"))
    capsys.readouterr()
    assert main(["check-drafter", str(tmp_path / "target"), folder, "--prompts", "3"]) == 0
    assert "vllm: taps 1,3,4  first-draft agreement" in capsys.readouterr().out


def test_generate_command_with_a_dspark_drafter(trained_dspark, tmp_path, capsys):
    """``ppsplit generate FOLDER --drafter DSPARK -k 4 --confidence-threshold 0.5`` on a folder compiled with the
    drafter's taps prints the target's greedy continuation; the flag without a DSpark drafter is one line."""
    from ppsplit.cli import main

    model, folder = trained_dspark
    model.save_pretrained(str(tmp_path / "target"))
    out = str(tmp_path / "compiled")
    assert main(["compile", str(tmp_path / "target"), "--pp", "2", "--aux", "1,3,4", "-o", out, "--max-batch", "1",
                 "--max-len", "64"]) == 0
    with torch.no_grad():
        greedy = model.generate(torch.tensor([[7, 20, 4, 13]]), max_new_tokens=20, do_sample=False)[0, 4:].tolist()
    capsys.readouterr()
    assert main(["generate", out, "--device", "cpu", "--prompt-ids", "7,20,4,13", "--max-new-tokens", "20", "-k", "4",
                 "--drafter", folder, "--confidence-threshold", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == ",".join(map(str, greedy)) and "mean acceptance length" in printed
    assert main(["generate", out, "--device", "cpu", "--prompt-ids", "7,20", "--confidence-threshold", "0.5"]) == 2
    assert "--confidence-threshold trims a DSpark drafter" in capsys.readouterr().err


def test_stand_in_graphs_equal_the_eager_engine(trained_dspark):
    """The captured drafter's parts (``ppsplit.serve.draft_graphs``, through the eager stand-in for capture) with the
    anchor layout's K-row blocks and the threshold on: the same tokens, acceptance and verified drafts as eager, the
    Markov and confidence heads replayed inside the greedy block graph."""
    from ppsplit.serve.draft_graphs import BlockGraphs
    from tests.serve.test_draft_graphs import eager_capture

    _, folder = trained_dspark
    _, graph = small()
    split = ppsplit.split_model(graph, 2, aux=TAPS)
    prompts = [torch.randint(6, 32, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 5, 9)]
    runs = []
    for graphs in (False, True):
        drafter = ppsplit.load_drafter(folder, split=split)
        drafter.confidence_threshold = 0.5
        engine = Engine(split, drafter=drafter, num_draft_tokens=BLOCK)
        proposer = engine.runner.sampler.proposer
        if graphs:
            proposer.graphs = BlockGraphs(drafter, BLOCK, split.plan, split.layout, range(1, 65),
                                          capture_fn=eager_capture)
        runs.append((engine.generate(prompts, SamplingParams(max_tokens=20)), proposer.graphs))
    (eager, _), (graphed, blocks) = runs
    assert [(o.token_ids, o.accepted, o.drafts) for o in graphed] == [(o.token_ids, o.accepted, o.drafts) for o in eager]
    assert sum(sum(o.accepted) for o in eager) > 0 and blocks.greedy[4][0].replays > 0


# -- inside a compiled folder, and across ranks ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled_dspark(trained_dspark, tmp_path_factory):
    """``ppsplit compile TARGET --pp N --drafter DSPARK`` of the trained drafter at pp 1 and 2."""
    from tests.eagle3.test_dflash import compile_with_drafter

    model, folder = trained_dspark
    return model, folder, compile_with_drafter(model, folder, tmp_path_factory.mktemp("compiled-dspark"))


def test_compiled_folder_speculates_like_the_in_process_drafter(compiled_dspark, capsys):
    """The folder stores every DSpark tensor (Markov and confidence heads included) and its heads' config: with the
    threshold on, its drafter gives Hugging Face's greedy output and the same trimmed windows (drafts, acceptance)
    as the drafter loaded from speculators' folder over an in-process split; ``ppsplit generate DIR -k 4
    --confidence-threshold 0.5`` prints the same."""
    from safetensors import safe_open

    from tests.eagle3.test_dflash import check_compiled_folder

    model, folder, folders = compiled_dspark
    with safe_open(str(Path(folders[2]) / "drafter" / "drafter.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "head.weight", "embed_tokens.weight"} <= names
    stored = json.loads((Path(folders[2]) / "drafter" / "config.json").read_text())
    assert stored["ppsplit_family"] == "dspark" and stored["markov_rank"] == 16 and stored["sample_from_anchor"]
    loaded = ppsplit.load(folders[2]).drafter
    assert loaded.family == "dspark" and loaded.markov_head is not None and loaded.confidence_head is not None
    outs, _ = check_compiled_folder(model, folder, folders[2], BLOCK, capsys, threshold=0.5)
    assert any(len(d) < BLOCK for o in outs for d in o.drafts) and sum(sum(o.accepted) for o in outs) > 0


@pytest.mark.parametrize("pp", [1, 2])
def test_dspark_across_ranks_equals_the_in_process_engine(pp, compiled_dspark):
    """``check_across_ranks`` with the DSpark drafter and its threshold on the last rank: the kept drafts' count
    comes back to rank 0 in the step's results, so the windows it schedules are trimmed as in one process."""
    from tests.eagle3.test_dflash import check_across_ranks

    _, _, folders = compiled_dspark
    ref = check_across_ranks(pp, folders[pp], BLOCK, threshold=0.5)
    assert any(len(d) < BLOCK for o in ref for d in o.drafts)


def test_run_command_trims_on_the_last_rank(compiled_dspark, capfd):
    """``ppsplit run DIR -k 4 --confidence-threshold 0.5`` (one process per stage): the tokens and the mean
    acceptance length of the in-process engine with that threshold (without it, the acceptance differs); the flag
    without -k, or out of range, is refused in one line before any process starts."""
    from ppsplit.cli import main
    from tests.eagle3.test_dflash import _folder_prompts, folder_engine

    _, _, folders = compiled_dspark
    prompts, params = _folder_prompts()[:2], SamplingParams(max_tokens=20)
    runs = {t: folder_engine(folders[2], BLOCK, t)[1].generate(prompts, params) for t in (0.0, 0.5)}
    mean = {t: 1 + sum(a for o in outs for a in o.accepted) / sum(len(o.accepted) for o in outs)
            for t, outs in runs.items()}
    assert f"{mean[0.0]:.2f}" != f"{mean[0.5]:.2f}"
    code = main(["run", folders[2], *[x for p in prompts for x in ("--prompt-ids", ",".join(map(str, p)))],
                 "--max-new-tokens", "20", "-k", str(BLOCK), "--confidence-threshold", "0.5", "--timeout", "30"])
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    assert lines[:2] == [f"[{i}] " + ",".join(map(str, o.token_ids)) for i, o in enumerate(runs[0.5])], out
    assert f"K={BLOCK}, mean acceptance length {mean[0.5]:.2f})" in lines[2], out
    assert main(["run", folders[2], "--prompt-ids", "7,8", "--confidence-threshold", "0.5", "--timeout", "30"]) == 2
    assert "--confidence-threshold trims a DSpark drafter's verify windows, and without -k no drafter runs" in \
        capfd.readouterr().err
    assert main(["run", folders[2], "--prompt-ids", "7,8", "-k", "4", "--confidence-threshold", "1.5"]) == 2
    assert "--confidence-threshold must be from 0 to 1" in capfd.readouterr().err


@pytest.fixture(scope="module")
def served_dspark(tmp_path_factory):
    """The demo target (it has a tokenizer) compiled at pp 2 with a DSpark drafter whose Markov head knows the
    target's bigrams."""
    from ppsplit.compile.demo import demo_model

    tmp_path = tmp_path_factory.mktemp("served-dspark")
    model = demo_model()
    dspark_drafter(tmp_path / "d", model, seed=1, scale=0.5, markov_rank=model.config.vocab_size,
                   prepare=bigram_markov(model))
    return ppsplit.compile_model("demo", str(tmp_path / "demo-dspark"), pp=2, drafter=str(tmp_path / "d"),
                                 cache=ppsplit.CacheConfig(batch_size=4, max_len=128))


def test_serve_speculates_with_the_folder_dspark(served_dspark):
    """``ppsplit serve DIR -k 4 --confidence-threshold 0.5``, in one process and with ``--ranks 2``: completions
    equal the in-process engine's over the same folder with that threshold, and the server's draft counters equal
    its verified and accepted drafts (the trimmed windows', fewer than K per window)."""
    from ppsplit.artifact.tokenizer import FolderTokenizer
    from tests.eagle3.test_dflash import folder_engine
    from tests.serve.test_server import MODEL, Live

    tok = FolderTokenizer(served_dspark)
    prompts = ["Hello world", "Once upon a time there was a", "1 2 3 4 5"]
    _, engine = folder_engine(served_dspark, BLOCK, 0.5)
    ref = [engine.generate([tok.encode(p)], SamplingParams(max_tokens=12))[0] for p in prompts]
    verified, accepted = sum(len(d) for o in ref for d in o.drafts), sum(sum(o.accepted) for o in ref)
    assert 0 < accepted and verified < BLOCK * sum(len(o.drafts) for o in ref)
    for ranks in ((), ("--ranks", "2")):
        server = Live(served_dspark, "-k", str(BLOCK), "--confidence-threshold", "0.5", *ranks)
        try:
            for prompt, expected in zip(prompts, ref):  # one at a time: the counters are then exactly the reference's
                done = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
                assert done.choices[0].text == tok.decode(expected.token_ids, skip_special_tokens=True)
            metrics = server.metrics()
            assert (metrics["ppsplit_spec_decode_draft_tokens_total"],
                    metrics["ppsplit_spec_decode_accepted_tokens_total"]) == (verified, accepted), ranks
        finally:
            server.stop()


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(markov_head_type="lstm"), "markov_head_type 'lstm'"),
    (lambda c: c.pop("confidence_head"), "lacks confidence_head"),
    (lambda c: c.update(markov_rank="16"), "markov_rank"),
    (lambda c: c.update(conv_kernel_size=2), "conv_kernel_size"),
    (lambda c: c.update(ppsplit_family="dspark2"), "ppsplit_family is 'dspark2'"),
])
def test_stored_dspark_config_refused_before_tensors(compiled_dspark, tmp_path, change, message):
    """A stored DSpark config edited by hand: ``ppsplit inspect`` and ``ppsplit.load`` refuse it in one line."""
    import shutil

    from ppsplit.cli import main

    _, _, folders = compiled_dspark
    shutil.copytree(folders[1], tmp_path / "copy")
    edit_config(tmp_path / "copy" / "drafter", change)
    with pytest.raises(ppsplit.PpsplitError, match=message) as e:
        ppsplit.load(str(tmp_path / "copy"))
    assert "\n" not in str(e.value)
    assert main(["inspect", str(tmp_path / "copy")]) == 2


# -- sampling stays lossless ----------------------------------------------------------------------------------------
def test_dspark_sampling_matches_target_distribution(tmp_path):
    """2000 copies of one prompt on a Llama target, drafts drawn one at a time through the Markov head, windows
    trimmed by confidence: the joint distribution of the first two tokens equals the target's p(t0) p(t1 | t0)."""
    from tests.eagle3.test_eagle3 import check_joint_sampling, traced

    model, graph = traced("small")
    split = ppsplit.split_model(graph, 2, aux=TAPS, fuse=False)
    dspark_drafter(tmp_path / "d", model, seed=3, scale=0.5)
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    drafter.confidence_threshold = 0.2
    check_joint_sampling(model, split, drafter, 3)


# -- refusals: one line, before anything loads ----------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(frobnicate=1), "drafter config key frobnicate"),
    (lambda c: c.update(markov_head_type="lstm"), "markov_head_type 'lstm'"),
    (lambda c: c.update(markov_rank=-1), "markov_rank must be an integer >= 0"),
    (lambda c: c.update(markov_rank=0), "confidence_head_with_markov is true but markov_rank is 0"),
    (lambda c: c["speculators_config"].update(algorithm="dflash"), "a speculators dspark drafter"),
    (lambda c: c.update(enable_confidence_head=False), "tensors its config does not account for"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[1, 3, 9]), "tap id 9 is out of range"),
])
def test_bad_dspark_configs_are_refused_in_one_line(tmp_path, change, message):
    model, graph = cached("qwen3")
    dspark_drafter(tmp_path / "d", model)
    edit_config(tmp_path / "d", change)
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    with pytest.raises(ConfigError, match=message) as e:
        ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    assert "\n" not in str(e.value)


def test_dspark_runtime_refusals(tmp_path):
    model, graph = cached("qwen3")
    dspark_drafter(tmp_path / "d", model, enable_confidence_head=False, confidence_head_with_markov=False)
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "d"), split=split)
    assert drafter.confidence_head is None
    for value, message in ((0.5, "has none"), (1.5, "from 0 to 1"), ("x", "from 0 to 1")):
        with pytest.raises(ConfigError, match=message):
            drafter.confidence_threshold = value
    with pytest.raises(ConfigError, match="num_draft_tokens=5 exceeds what one block of the dspark drafter"):
        Engine(split, drafter=drafter, num_draft_tokens=BLOCK + 1)
