"""MTP layers in speculators' ``mtp`` layout (``MTPSpeculatorConfig`` / ``MTPDraftModel``, written by its
``MTPConverter`` from a checkpoint's ``mtp.*`` tensors): ``ppsplit save-drafter`` writes it from a folder compiled
with ``--mtp``, and ``ppsplit.load_drafter`` runs it as the MTP chain in the engine.

The oracles are speculators' own: its converter's output for the same tiny Qwen3-Next checkpoint (tensors and
config), its ``MTPDraftModel.from_pretrained`` (verifier weights attached by the library) and its forward; and
Hugging Face's greedy ``generate`` of the target.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import ppsplit
from ppsplit import ConfigError
from ppsplit.core.ragged import RaggedStep, Segment
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.eagle3.test_mtp import L, QWEN, V, built

pytest.importorskip("speculators")
from speculators.convert.mtp.converter import MTPConverter  # noqa: E402
from speculators.models.mtp import MTPDraftModel  # noqa: E402

# What the converter writes that ppsplit does not: a pointer to its config class's source code, its own version, and
# a NaN ``verifier_lm_head.weight`` (replaced by the verifier's on load)
_CONVERTER_ONLY = {"auto_map", "speculators_version"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The tiny Qwen3-Next target with its MTP layer, compiled with ``--mtp``; its layer saved by ``ppsplit
    save-drafter`` and by speculators' ``MTPConverter``."""
    from ppsplit.cli import main

    target, block, own, folder, traced = built(QWEN, tmp_path_factory)
    where = tmp_path_factory.mktemp("speculators")
    compiled, saved, converted = (str(where / n) for n in ("pp2", "saved", "converted"))
    assert main(["compile", folder, "--pp", "2", "--mtp", "-o", compiled, "--max-batch", "8", "--max-len", "64"]) == 0
    assert main(["save-drafter", compiled, "--verifier", folder, "-o", saved]) == 0
    MTPConverter().convert(folder, converted, base_model=folder, num_speculative_steps=3, validate=False)
    return target, folder, traced, compiled, saved, converted


def test_save_drafter_writes_what_speculators_converter_writes(qwen):
    """The same tensors, bit for bit, under the same names, and the same config (less the converter's pointer to its
    config class's source, its version, and its NaN placeholder for the verifier's head)."""
    _, _, _, _, saved, converted = qwen
    _same_as_converter(saved, converted)


def _same_as_converter(saved, converted):
    assert sorted(os.listdir(saved)) == ["config.json", "model.safetensors"]
    mine, theirs = load_file(os.path.join(saved, "model.safetensors")), load_file(os.path.join(converted,
                                                                                               "model.safetensors"))
    assert torch.isnan(theirs.pop("verifier_lm_head.weight")).all()
    assert sorted(mine) == sorted(theirs)
    assert any("experts.gate_up_proj" in n for n in mine) and "mtp_layers.0.input_proj.weight" in mine
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    cfg = json.loads(open(os.path.join(saved, "config.json")).read())
    expected = json.loads(open(os.path.join(converted, "config.json")).read())
    assert cfg == {k: v for k, v in expected.items() if k not in _CONVERTER_ONLY}


@torch.no_grad()
def test_speculators_own_model_drafts_as_ppsplit(qwen):
    """speculators' ``MTPDraftModel.from_pretrained`` of the saved folder (the verifier's embedding and head attached
    by the library), fed the target's final hidden states: its first-step logits at every position equal ppsplit's
    MTP draft over the same prefill, from the checkpoint (``load_mtp``) and from the saved folder
    (``load_drafter``)."""
    target, folder, traced, _, saved, _ = qwen
    theirs = MTPDraftModel.from_pretrained(saved).eval()
    split = ppsplit.split_model(traced, 2, aux=[L])
    ids = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(4))
    hidden = target(ids[None], output_hidden_states=True).hidden_states[-1]
    logits, _, _ = theirs(input_ids=ids[None], hidden_states=hidden)
    valid = logits[0].shape[1]  # speculators scores positions [0, T - steps - 1)
    assert valid == len(ids) - 3 - 1
    step = RaggedStep.build([Segment(0, 0, len(ids))], {0: [0]}, split.layout)
    _, aux = split.step(ids, step)
    nxt = torch.cat([ids[1:], ids[:1]])[None]
    for drafter in (ppsplit.load_mtp(folder, split=split), ppsplit.load_drafter(saved, split=split)):
        mine, _ = drafter(aux[:, None], nxt, step)
        torch.testing.assert_close(mine[0, :valid], logits[0][0], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_a_qwen3_5_moe_layer_saves_as_the_converter_does(tmp_path_factory, tmp_path):
    """Qwen3.5-MoE (its text model): ``save-drafter`` of a ``--mtp`` folder equals ``MTPConverter``'s output, and
    speculators' model of it drafts as ppsplit does at every position."""
    from ppsplit.cli import main

    target, _, _, folder, traced = built("qwen3_5_moe_text", tmp_path_factory)
    compiled, saved, converted = (str(tmp_path / n) for n in ("pp1", "saved", "converted"))
    assert main(["compile", folder, "--pp", "1", "--mtp", "-o", compiled, "--max-batch", "8", "--max-len", "64"]) == 0
    assert main(["save-drafter", compiled, "--verifier", folder, "-o", saved]) == 0
    MTPConverter().convert(folder, converted, base_model=folder, num_speculative_steps=3, validate=False)
    _same_as_converter(saved, converted)
    theirs = MTPDraftModel.from_pretrained(saved).eval()
    ids = torch.randint(3, V, (9,), generator=torch.Generator().manual_seed(8))
    hidden = target(ids[None], output_hidden_states=True).hidden_states[-1]
    logits, _, _ = theirs(input_ids=ids[None], hidden_states=hidden)
    split = ppsplit.split_model(traced, 1, aux=[L])
    step = RaggedStep.build([Segment(0, 0, len(ids))], {0: [0]}, split.layout)
    _, aux = split.step(ids, step)
    mine, _ = ppsplit.load_drafter(saved, split=split)(aux[:, None], torch.cat([ids[1:], ids[:1]])[None], step)
    torch.testing.assert_close(mine[0, :logits[0].shape[1]], logits[0][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pp", [1, 2])
def test_speculators_folder_runs_lossless(qwen, pp):
    """speculators' converter output loaded by ``ppsplit.load_drafter``: three requests of different lengths, K = 3
    chained drafts; each output equals Hugging Face's greedy generate, and drafts and acceptance equal those of the
    same layer read from the checkpoint (``load_mtp``)."""
    target, folder, traced, _, _, converted = qwen
    split = ppsplit.split_model(traced, pp, aux=[L])
    drafter = ppsplit.load_drafter(converted, split=split)
    assert drafter.family == "mtp" and drafter.taps == (L,)
    prompts = [torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 13)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = Engine(split, drafter=drafter, num_draft_tokens=3).generate(prompts, params)
    ref = Engine(split, drafter=ppsplit.load_mtp(folder, split=split), num_draft_tokens=3).generate(prompts, params)
    for prompt, got, expected in zip(prompts, outs, ref):
        with torch.no_grad():
            greedy = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=None)[0, len(prompt):].tolist()
        assert got.token_ids == greedy
        assert (got.drafts, got.accepted) == (expected.drafts, expected.accepted)


def _edited(src, dst, change=None, tensors=None):
    os.makedirs(dst)
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    for key, value in (change or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    weights = load_file(os.path.join(src, "model.safetensors"))
    for name, value in (tensors or {}).items():
        if value is None:
            del weights[name]
        else:
            weights[name] = value
    save_file(weights, str(dst / "model.safetensors"))
    return str(dst)


def test_bad_speculators_folders_are_refused_in_one_line(qwen, tmp_path):
    """Every config key is read, known inert, or refused naming it; a missing or unknown tensor, a layer of another
    target, a model type speculators has no MTP class for: one line each, before tracing."""
    _, _, traced, _, saved, _ = qwen
    split = ppsplit.split_model(traced, 2, aux=[L])
    layer = json.loads(open(os.path.join(saved, "config.json")).read())["transformer_layer_config"]
    spec = json.loads(open(os.path.join(saved, "config.json")).read())["speculators_config"]
    cases = [({"change": {"mystery": 1}}, "has 'mystery', which ppsplit does not know"),
             ({"change": {"num_nextn_predict_layers": 2}}, "num_nextn_predict_layers is 2"),
             ({"change": {"speculators_config": {**spec, "algorithm": "eagle3"}}}, "algorithm is 'eagle3'"),
             ({"change": {"speculators_config": {**spec, "extra": 1}}}, "speculators_config has 'extra'"),
             ({"change": {"transformer_layer_config": {**layer, "model_type": "deepseek_v3"}}},
              "model_type is 'deepseek_v3'; speculators' mtp layout holds layers of qwen3, qwen3_next"),
             ({"change": {"transformer_layer_config": {**layer, "num_hidden_layers": L + 1,
                                                       "layer_types": ["linear_attention"] * L + ["full_attention"]}}},
              f"a target of {L + 1} layers"),
             ({"change": {"transformer_layer_config": {**layer, "num_hidden_layers": L + 1}}},
              "transformers cannot read transformer_layer_config (ValueError: `num_hidden_layers` (4) must be equal"),
             ({"tensors": {"mtp_layers.0.input_proj.weight": None}}, "has no mtp_layers.0.input_proj.weight"),
             ({"tensors": {"d2t": torch.zeros(V, dtype=torch.long)}}, "does not hold: d2t"),
             ({"tensors": {"mtp_layers.0.mlp.mystery.weight": torch.ones(3)}},
              "does not account for: mtp_layers.0.mlp.mystery.weight"),
             ({"tensors": {"mtp_layers.0.self_attn.q_proj.weight": None}}, "self_attn.q_proj.weight")]
    for i, (edit, message) in enumerate(cases):
        bad = _edited(saved, tmp_path / f"bad{i}", **edit)
        with pytest.raises(ConfigError) as e:
            ppsplit.load_drafter(bad, split=split)
        assert message in str(e.value) and "\n" not in str(e.value), (message, str(e.value))
    for kwargs, message in (({"aux_convention": "vllm"}, "leave aux_convention"),
                            ({"compile": True}, "an MTP layer runs as traced")):
        with pytest.raises(ConfigError, match=message):
            ppsplit.load_drafter(saved, split=split, **kwargs)
    with pytest.raises(ConfigError, match=f"split with aux including {L}"):
        ppsplit.load_drafter(saved, split=ppsplit.split_model(traced, 2, aux=[1]))
    from ppsplit.eagle3.formats import read_drafter

    with pytest.raises(ConfigError, match=r"is a speculators MTP layer; load it with ppsplit.load_drafter"):
        read_drafter(saved)  # what compile --drafter and ranks read


def test_save_drafter_refuses_in_one_line(qwen, tmp_path_factory, tmp_path, capsys):
    """A DeepSeek-V3 MTP layer has no speculators form (one line naming the model types it has); an MTP layer
    without ``--verifier``, or in SpecForge's format, is refused; nothing is written."""
    from ppsplit.cli import main

    _, folder, _, compiled, _, _ = qwen
    _, _, _, deepseek, _ = built("deepseek_v3", tmp_path_factory)
    ds, other = str(tmp_path / "ds"), tmp_path / "other"
    os.makedirs(other)  # a Qwen3-Next verifier of another width
    cfg = json.loads(open(os.path.join(folder, "config.json")).read())
    (other / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    os.symlink(os.path.join(folder, "model.safetensors"), other / "model.safetensors")
    assert main(["compile", deepseek, "--pp", "1", "--mtp", "-o", ds, "--max-batch", "2", "--max-len", "32"]) == 0
    for command, message in (
            (["save-drafter", ds, "--verifier", deepseek], "speculators' mtp layout holds MTP layers of qwen3, "
                                                          "qwen3_next, qwen3_5_text, qwen3_5_moe_text only, and this "
                                                          "target is 'deepseek_v3'"),
            (["save-drafter", compiled], "save it with --format speculators --verifier TARGET"),
            (["save-drafter", compiled, "--format", "specforge", "--verifier", folder], "--format speculators"),
            (["save-drafter", compiled, "--verifier", str(other)], "is not the target")):
        capsys.readouterr()
        assert main([*command, "-o", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not os.path.exists(tmp_path / "out")


def test_check_drafter_scores_a_speculators_folder(qwen, capsys):
    """``ppsplit check-drafter`` on a speculators mtp folder: one line, tap L, the first-draft agreement on the
    target's own continuations (the random layer agrees rarely; the count is what ``mtp_agreement`` gives)."""
    from ppsplit.cli import main

    _, folder, _, _, _, converted = qwen
    capsys.readouterr()
    assert main(["check-drafter", folder, converted, "--prompts", "2", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert f"mtp: tap {L} (the last layer's output, any numbering)  first-draft agreement" in out, out
    assert "/16)" in out  # 2 sequences x 8 scored positions (i + 1 >= 4, i + 2 <= 11)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A dense Qwen3 target and an MTP layer built with speculators' own classes (``MTPDraftModel`` over the
    target's config, random weights: a layer no checkpoint ships, as speculators trains one), saved by its
    ``save_pretrained``."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    from tests.eagle3.test_mtp import _random

    where = tmp_path_factory.mktemp("qwen3")
    config = AutoConfig.for_model("qwen3", vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=L,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, tie_word_embeddings=False)
    target = _random(config, 0)
    target.save_pretrained(where / "target")
    spec = SpeculatorsConfig(algorithm="mtp", default_proposal_method="greedy",
                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                             verifier=VerifierConfig(name_or_path=str(where / "target"),
                                                     architectures=["Qwen3ForCausalLM"]))
    torch.manual_seed(3)
    model = MTPDraftModel(MTPSpeculatorConfig(transformer_layer_config=config, speculators_config=spec))
    with torch.no_grad():
        for p in model.mtp_layers.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    model.load_verifier_weights()
    model.save_pretrained(where / "mtp")
    return target, str(where / "mtp"), ppsplit.trace_model(target, cache=ppsplit.CacheConfig(8, 64, block_size=16))


@torch.no_grad()
def test_a_dense_qwen3_layer_from_speculators_drafts_as_its_model(qwen3):
    """speculators' Qwen3 MTP layer (plain ``weight * x`` norms, Qwen3's decoder layer), reloaded by its
    ``from_pretrained``: its first-step logits equal ppsplit's draft at every position; the engine's output at pp 2,
    K = 2, equals Hugging Face's greedy generate."""
    target, folder, traced = qwen3
    theirs = MTPDraftModel.from_pretrained(folder).eval()
    split = ppsplit.split_model(traced, 2, aux=[L])
    drafter = ppsplit.load_drafter(folder, split=split)
    ids = torch.randint(3, V, (10,), generator=torch.Generator().manual_seed(6))
    hidden = target(ids[None], output_hidden_states=True).hidden_states[-1]
    logits, _, _ = theirs(input_ids=ids[None], hidden_states=hidden)
    step = RaggedStep.build([Segment(0, 0, len(ids))], {0: [0]}, split.layout)
    _, aux = split.step(ids, step)
    mine, _ = drafter(aux[:, None], torch.cat([ids[1:], ids[:1]])[None], step)
    valid = logits[0].shape[1]
    torch.testing.assert_close(mine[0, :valid], logits[0][0], rtol=1e-4, atol=1e-4)
    prompts = [torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11)]
    outs = Engine(split, drafter=drafter, num_draft_tokens=2).generate(prompts, SamplingParams(max_tokens=10,
                                                                                              ignore_eos=True))
    for prompt, got in zip(prompts, outs):
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert got.token_ids == greedy[0, len(prompt):].tolist()


def test_generate_takes_a_speculators_folder_as_drafter(qwen, tmp_path, capsys):
    """``ppsplit generate DIR --drafter OUT -k 3`` over a folder compiled with tap L (no MTP layer inside): the tokens
    of Hugging Face's greedy generate."""
    from ppsplit.cli import main

    target, folder, _, _, _, converted = qwen
    out = str(tmp_path / "pp2")
    assert main(["compile", folder, "--pp", "2", "--aux", str(L), "-o", out, "--max-batch", "2", "--max-len", "48"]) == 0
    prompt = [5, 9, 3, 17, 4]
    capsys.readouterr()
    assert main(["generate", out, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "10", "--ignore-eos",
                 "--drafter", converted, "-k", "3"]) == 0
    printed = capsys.readouterr().out
    with torch.no_grad():
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert printed.splitlines()[0] == ",".join(map(str, greedy[0, len(prompt):].tolist()))
    assert "mean acceptance length" in printed, printed


# -- a speculators mtp folder stored in a compiled folder (``ppsplit compile --drafter``) ------------------------------
def _speculators_pair(which, request):
    """(target, its checkpoint folder, traced target, speculators mtp folder): the converter's Qwen3-Next layer, or
    speculators' own dense Qwen3 one."""
    if which == "qwen3_next":
        target, folder, traced, _, _, converted = request.getfixturevalue("qwen")
        return target, folder, traced, converted
    target, mtp, traced = request.getfixturevalue("qwen3")
    return target, os.path.join(os.path.dirname(mtp), "target"), traced, mtp


_COMPILED: dict = {}


def _compiled_with_drafter(which, request, tmp_path_factory):
    """``ppsplit compile TARGET --pp 2 --drafter SPECULATORS_MTP``, once per target."""
    from ppsplit.cli import main

    if which not in _COMPILED:
        target, folder, traced, drafter = _speculators_pair(which, request)
        out = str(tmp_path_factory.mktemp(f"{which}-drafter") / "pp2")
        assert main(["compile", folder, "--pp", "2", "--drafter", drafter, "-o", out, "--max-batch", "8",
                     "--max-len", "64"]) == 0
        _COMPILED[which] = target, traced, drafter, out
    return _COMPILED[which]


@pytest.mark.parametrize("which", ["qwen3_next", "qwen3"])
def test_a_folder_compiled_with_a_speculators_mtp_drafter_speculates_with_it(which, request, tmp_path_factory,
                                                                             capsys):
    """The layer is stored in DIR/mtp as ``--mtp`` stores one (tap L added); ``ppsplit.load`` attaches it, and the
    engine over the folder gives Hugging Face's greedy output with each request's drafts and acceptance equal to
    ``load_drafter``'s in one process; ``ppsplit generate DIR -k 3`` prints the same tokens."""
    from ppsplit.cli import main

    target, traced, drafter, out = _compiled_with_drafter(which, request, tmp_path_factory)
    assert sorted(os.listdir(os.path.join(out, "mtp"))) == ["block.json", "block.safetensors", "config.json",
                                                            "drafter.safetensors"]
    assert not os.path.exists(os.path.join(out, "drafter"))
    assert main(["inspect", out]) == 0
    loaded = ppsplit.load(out)
    assert loaded.drafter.family == "mtp" and loaded.plan.taps == (L,)
    prompts = [torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 13)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = Engine(loaded, drafter=loaded.drafter, num_draft_tokens=3).generate(prompts, params)
    split = ppsplit.split_model(traced, 2, aux=[L])
    ref = Engine(split, drafter=ppsplit.load_drafter(drafter, split=split), num_draft_tokens=3).generate(prompts,
                                                                                                         params)
    for prompt, got, expected in zip(prompts, outs, ref):
        with torch.no_grad():
            greedy = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=None)[0, len(prompt):].tolist()
        assert got.token_ids == greedy == expected.token_ids
        assert (got.drafts, got.accepted) == (expected.drafts, expected.accepted)
    capsys.readouterr()
    assert main(["generate", out, "--prompt-ids", ",".join(map(str, prompts[1])), "--max-new-tokens", "12",
                 "--ignore-eos", "-k", "3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ",".join(map(str, outs[1].token_ids))
    assert f"mean acceptance length {outs[1].mean_acceptance_length:.2f}" in printed[1], printed


def test_the_converters_folder_is_stored_as_compile_mtp_stores_the_checkpoints_layer(qwen, request, tmp_path_factory):
    """The converter's folder holds the checkpoint's own Qwen3-Next MTP layer: compiled with ``--drafter`` it is
    stored exactly as ``--mtp`` stores that layer (the same settings, block program and tensors, bit for bit)."""
    from safetensors.torch import load_file as read

    _, _, _, by_mtp, _, _ = qwen
    _, _, _, out = _compiled_with_drafter("qwen3_next", request, tmp_path_factory)
    for name in ("config.json", "block.json"):
        assert json.loads(open(os.path.join(out, "mtp", name)).read()) == \
            json.loads(open(os.path.join(by_mtp, "mtp", name)).read()), name
    for name in ("block.safetensors", "drafter.safetensors"):
        mine, theirs = read(os.path.join(out, "mtp", name)), read(os.path.join(by_mtp, "mtp", name))
        assert sorted(mine) == sorted(theirs)
        assert all(torch.equal(mine[n], theirs[n]) for n in mine), name


def test_a_speculators_mtp_folder_across_ranks_equals_the_in_process_engine(qwen3, request, tmp_path_factory, capfd):
    """Two gloo ranks over the folder compiled with the dense Qwen3 speculators layer (``PipelineEngine``, what
    ``ppsplit run`` and ``serve --ranks`` run): requests arriving over several steps give Hugging Face's greedy
    output, and each request's drafts and acceptance equal the in-process engine's over the same folder; ``ppsplit
    run DIR -k 3`` prints the same tokens and acceptance."""
    from ppsplit.cli import main
    from tests.eagle3.test_mtp import _rank_prompts, check_mtp_across_ranks

    target, _, drafter, out = _compiled_with_drafter("qwen3", request, tmp_path_factory)
    _, ref = check_mtp_across_ranks(target, out, 2)
    prompts = _rank_prompts()
    capfd.readouterr()
    code = main(["run", out, "--prompt-ids", ",".join(map(str, prompts[0])), "--max-new-tokens", "14", "--ignore-eos",
                 "-k", "3", "--timeout", "60"])
    printed, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    lines = printed.splitlines()
    assert lines[0] == ",".join(map(str, ref[0].token_ids)), printed
    assert f"K=3, mean acceptance length {ref[0].mean_acceptance_length:.2f}" in lines[1], printed


def test_compile_refuses_a_bad_speculators_mtp_drafter_in_one_line(qwen3, tmp_path, capsys):
    """An unknown config key, a layer of another target, ``--drafter-convention``, ``--no-cache`` or ``--mtp`` beside
    it: one line each, before tracing, nothing written."""
    from ppsplit.cli import main

    _, mtp, _ = qwen3
    folder = os.path.join(os.path.dirname(mtp), "target")
    layer = json.loads(open(os.path.join(mtp, "config.json")).read())["transformer_layer_config"]
    mystery = _edited(mtp, tmp_path / "mystery", {"mystery": 1})
    wider = _edited(mtp, tmp_path / "wider", {"transformer_layer_config": {**layer, "vocab_size": V + 1}})
    for extra, message in (
            (["--drafter", mystery], "has 'mystery', which ppsplit does not know"),
            (["--drafter", wider], f"vocabulary ({V + 1}) is not the target's ({V})"),
            (["--drafter", mtp, "--drafter-convention", "vllm"], "leave out --drafter-convention"),
            (["--drafter", mtp, "--no-cache"], "leave out --no-cache (or --drafter)"),
            (["--drafter", mtp, "--mtp"], "pass either --drafter or --mtp")):
        capsys.readouterr()
        assert main(["compile", folder, "--pp", "2", *extra, "-o", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not os.path.exists(tmp_path / "out")


def test_save_drafter_gives_back_the_speculators_layer_a_folder_stores(qwen3, request, tmp_path_factory, tmp_path):
    """Round trip: ``save-drafter --verifier`` of the folder compiled with speculators' dense Qwen3 layer writes that
    layer's tensors back bit for bit (speculators' folder also holds the verifier's embedding and head, which the
    layout leaves to the verifier)."""
    from ppsplit.cli import main

    _, folder, _, drafter = _speculators_pair("qwen3", request)
    _, _, _, out = _compiled_with_drafter("qwen3", request, tmp_path_factory)
    assert main(["save-drafter", out, "--verifier", folder, "-o", str(tmp_path / "back")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    original = {n: t for n, t in load_file(os.path.join(drafter, "model.safetensors")).items()
                if n.startswith("mtp_layers.")}
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[n], original[n]) for n in back)
