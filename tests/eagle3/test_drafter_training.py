"""The SmolLM2 example (``bench/smollm2_eagle3.py``) at test size: a small random target (the demo model, its
tokenizer and chat template) compiled with taps, ``ppsplit collect`` answering prompts, a drafter trained a few steps
with SpecForge's modules and loss on what collect wrote, saved by SpecForge, saved again in the speculators format by
ppsplit and loaded back, then speculative decoding equal to plain greedy. It checks the pipeline, not the acceptance
figure (the real one is in bench/RESULTS.md)."""
import json
import os

import pytest
import torch

import ppsplit
from bench import smollm2_eagle3 as example
from ppsplit.cli import main
from ppsplit.compile.demo import demo_model, write_demo_tokenizer

pytest.importorskip("specforge", reason="SpecForge trains the drafter (installed by .ci/run without dependencies)")


def test_collect_train_save_load_and_decode_like_greedy(tmp_path):
    hf = str(tmp_path / "hf")
    demo_model().save_pretrained(hf)
    write_demo_tokenizer(hf)
    folder = str(tmp_path / "pp2")
    assert main(["compile", hf, "--pp", "2", "--aux", "eagle3", "--max-batch", "4", "--max-len", "64",
                 "-o", folder]) == 0
    train, held_out = example.make_prompts(6, 2)
    prompts = tmp_path / "train.jsonl"
    example.write_jsonl(str(prompts), train)
    assert main(["collect", folder, "--prompts", str(prompts), "--generate", "10", "-o", str(tmp_path / "data")]) == 0
    split = ppsplit.load(folder)
    torch.manual_seed(0)
    spec, figures = example.train_and_save(hf, split, str(tmp_path / "data"), str(tmp_path), draft_vocab=512,
                                           epochs=1, batch=2, lr=1e-3, ttt=3, seconds=None, log_every=1)
    assert figures["step"] == 3 and len(figures["acc"]) == 3 and figures["loss"] > 0
    config = json.load(open(os.path.join(spec, "config.json")))
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == list(split.plan.taps)  # speculators numbering: as tapped
    drafter = ppsplit.load_drafter(spec, split=split)
    trained = ppsplit.load_drafter(str(tmp_path / "drafter-specforge"), split=split)
    assert torch.equal(drafter.fc.weight, trained.fc.weight) and drafter.taps == trained.taps
    result = example.evaluate(split, drafter, example.chat_ids(folder, held_out), new=8, k=3)
    assert result["equal_to_greedy"] and result["tokens"] > 0 and result["verify_passes"] >= 1
    assert 1.0 <= result["mean_acceptance_length"] <= 4.0


def test_more_templates_keep_the_first_prompts_and_the_held_out_ones():
    """``--templates 16`` appends prompts from eight more templates: the first eight's prompts (what earlier runs
    trained on) and the held-out prompts stay exactly the same, and no held-out topic enters training."""
    base, held_out = example.make_prompts(10_000, 16)
    more, held_out_more = example.make_prompts(10_000, 16, templates=16)
    assert held_out_more == held_out and more[:len(base)] == base and len(more) == 2 * len(base)
    templates = example.TEMPLATES + example.MORE_TEMPLATES
    held_topics = {t for t in example.TOPICS if any(q == f.format(t) for q in held_out for f in example.TEMPLATES)}
    assert len(held_topics) == 16
    assert not {f.format(t) for t in held_topics for f in templates} & set(more)
    with pytest.raises(SystemExit, match="--templates must be 8..16"):
        example.make_prompts(10, 2, templates=17)
