"""``ppsplit collect``: drafter training data through the compiled pipeline, read back by SpecForge's own offline data
loader, equal to Hugging Face's ``output_hidden_states`` at the tap ids; resumable, nothing half written, bad input
refused in one line."""
import json
import math
import os

import pytest
import torch

import ppsplit
from ppsplit.cli import main
from ppsplit.compile.demo import demo_model
from ppsplit.eagle3 import collect
from tests.support import tiny_model

TAPS = (2, 4, 5)  # ppsplit (vLLM) numbering: tap j = hidden_states[j]; SpecForge writes j - 1
ROWS = [{"prompt": "hello there", "response": "the water is good"},
        {"text": "Once upon a time the model"},
        {"input_ids": [1, 5, 9, 33, 7], "loss_mask": [0, 0, 1, 1, 1]},
        {"prompt": "what is a pipeline"}]  # answered by the target (--generate)


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    """The demo (tokenizer, chat template) in 2 stages with a paged cache, taps owned by both stages."""
    out = tmp_path_factory.mktemp("collect") / "demo-pp2"
    assert main(["compile", "demo", "--pp", "2", "--aux", ",".join(map(str, TAPS)), "--max-batch", "2",
                 "--max-len", "96", "-o", str(out)]) == 0
    return str(out)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def specforge_samples(out):
    """The files as SpecForge's offline EAGLE-3 training reads them: its dataset (``OfflineEagle3Dataset``), its
    collator, and the ``normalize_offline_sample`` its feature loader applies."""
    pytest.importorskip("specforge")
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    dataset = build_offline_eagle3_dataset(out, max_len=4096)
    refs = OfflineManifestReader(out, validate_files=True).read()  # checks every key is a tensor
    assert len(refs) == len(dataset)
    samples = {}
    for i, ref in enumerate(refs):
        path = ref.feature_store_uri[len("file://"):]
        index = int(os.path.basename(path)[len("data_"):-len(".ckpt")])
        batch = DataCollatorWithPadding()([dataset[i]])
        normalized = normalize_offline_sample(load_feature_file(path), max_len=4096)
        for key in ("input_ids", "loss_mask", "hidden_state", "target"):
            assert torch.equal(batch[key], normalized[key]), key
        samples[index] = batch
    return samples


def test_collect_is_read_by_specforge_and_equals_hf_hidden_states(demo_folder, tmp_path):
    out = str(tmp_path / "data")
    prompts = write_rows(tmp_path / "p.jsonl", ROWS)
    assert main(["collect", demo_folder, "--prompts", prompts, "-o", out, "--generate", "6"]) == 0
    record = json.load(open(os.path.join(out, "collect.json")))
    assert record["taps"] == list(TAPS) and record["specforge_layer_ids"] == [j - 1 for j in TAPS]
    assert sorted(os.listdir(os.path.join(out, "rows_0-5000"))) == [f"data_{i}.ckpt" for i in range(4)]
    samples = specforge_samples(out)
    hf = demo_model()
    from ppsplit.artifact.tokenizer import FolderTokenizer

    tok = FolderTokenizer(demo_folder)
    prompt, reply = tok.encode_reply([{"role": "user", "content": "hello there"}], "the water is good")
    asked = tok.encode_chat([{"role": "user", "content": "what is a pipeline"}])
    answer = hf.generate(torch.tensor([asked]), max_new_tokens=6, do_sample=False)[0].tolist()
    expected = {0: (prompt + reply, [0] * len(prompt) + [1] * len(reply)),
                1: (tok.encode("Once upon a time the model"), None),
                2: ([1, 5, 9, 33, 7], [0, 0, 1, 1, 1]),
                3: (answer, [0] * len(asked) + [1] * (len(answer) - len(asked)))}
    for i, (ids, mask) in expected.items():
        batch = samples[i]
        mask = [1] * len(ids) if mask is None else mask
        assert batch["input_ids"][0].tolist() == ids
        assert batch["loss_mask"][0].tolist() == mask[:-1] + [0]  # SpecForge zeroes the last position itself
        with torch.no_grad():
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        taps = torch.cat([states[j] for j in TAPS], -1)
        torch.testing.assert_close(batch["hidden_state"], taps, atol=1e-5, rtol=0)  # SpecForge's name for the taps
        torch.testing.assert_close(batch["target"], states[-1], atol=1e-5, rtol=0)  # after the final norm
        assert batch["hidden_state"].shape == (1, len(ids), 3 * hf.config.hidden_size)


def test_collect_no_cache_three_stages_with_logits(tmp_path):
    """A folder without a cache (any length), three stages, token-id rows; ``--logits`` adds the target's logits."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    folder = str(tmp_path / "pp3")
    assert main(["compile", str(tmp_path / "ckpt"), "--pp", "3", "--aux", "0,2,4", "--no-cache", "-o", folder]) == 0
    rows = [{"input_ids": [3 + i, 9, 17, 40 + i, 2 * i + 5]} for i in range(3)]
    job = collect.prepare(folder, write_rows(tmp_path / "p.jsonl", rows), str(tmp_path / "d"), logits=True,
                          shard_size=2)
    report = collect.run(job, ppsplit.load(folder))
    assert report.written == 3 and sorted(os.listdir(tmp_path / "d")) == ["collect.json", "rows_0-2", "rows_2-4"]
    for i, row in enumerate(rows):
        data = torch.load(collect.sample_path(str(tmp_path / "d"), i, 2), weights_only=True)
        with torch.no_grad():
            hf = model(torch.tensor([row["input_ids"]]), output_hidden_states=True)
        torch.testing.assert_close(data["aux_hidden_state"], torch.cat([hf.hidden_states[j] for j in (0, 2, 4)], -1),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(data["hidden_state"], hf.hidden_states[-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(data["logits"], hf.logits, atol=1e-5, rtol=0)
        assert data["loss_mask"].tolist() == [1] * 5 and data["input_ids"].dtype == torch.long


def test_resume_skips_what_is_written_and_a_failure_leaves_no_half_file(demo_folder, tmp_path, monkeypatch):
    rows = [{"input_ids": [1, 4 + i, 9, 33]} for i in range(4)]
    prompts, out = write_rows(tmp_path / "p.jsonl", rows), str(tmp_path / "d")
    split = ppsplit.load(demo_folder)
    save = torch.save

    def failing(obj, path):
        if "data_2" in str(path):
            save(obj, path)  # the bytes reach the disk under the temporary name, then the run dies
            raise OSError("disk full")
        save(obj, path)

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError):
        collect.run(collect.prepare(demo_folder, prompts, out), split)
    shard = os.path.join(out, "rows_0-5000")
    assert sorted(os.listdir(shard)) == ["data_0.ckpt", "data_1.ckpt"]  # no data_2, no temporary file
    monkeypatch.setattr(torch, "save", save)
    first = os.stat(os.path.join(shard, "data_0.ckpt")).st_mtime_ns
    open(os.path.join(shard, "data_3.ckpt.tmp-999999"), "wb").close()  # what a killed run (SIGKILL) leaves
    job = collect.prepare(demo_folder, prompts, out)
    assert sorted(os.listdir(shard)) == ["data_0.ckpt", "data_1.ckpt"]
    assert [r.index for r in job.rows] == [2, 3] and job.skipped == 2
    report = collect.run(job, split)
    assert (report.written, report.skipped) == (2, 2)
    assert os.stat(os.path.join(shard, "data_0.ckpt")).st_mtime_ns == first
    assert len(specforge_samples(out)) == 4


@pytest.mark.parametrize("case", ["not-json", "bad-row", "no-response", "too-long", "other-prompts", "no-taps",
                                  "not-ours"])
def test_bad_input_is_one_line_exit_2_before_any_work(case, demo_folder, tmp_path, capsys):
    folder, out = demo_folder, tmp_path / "d"
    lines = {"not-json": "{prompt: 1}\n", "bad-row": '{"prompt": "a", "reply": "b"}\n',
             "no-response": '{"prompt": "hi"}\n', "too-long": json.dumps({"input_ids": list(range(100))}) + "\n"}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(lines.get(case, '{"text": "hello"}\n'))
    if case == "other-prompts":
        assert main(["collect", folder, "--prompts", str(prompts), "-o", str(out)]) == 0
        prompts.write_text('{"text": "hello again"}\n')
    if case == "no-taps":
        folder = str(tmp_path / "plain")
        assert main(["compile", "demo", "--pp", "1", "-o", folder]) == 0
    if case == "not-ours":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    code = main(["collect", folder, "--prompts", str(prompts), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("ppsplit: error: "), err
    expected = {"not-json": "p.jsonl:1 is not JSON", "bad-row": "a row is {prompt[, response]}",
                "no-response": "pass --generate N", "too-long": "compile with a larger --max-len",
                "other-prompts": "collected with another prompts_sha256", "no-taps": "the folder has no taps",
                "not-ours": "is not a collect output"}[case]
    assert expected in err, err
    if case not in ("other-prompts", "not-ours"):
        assert not out.exists()


def test_one_rank_per_stage_writes_what_one_process_writes(demo_folder, tmp_path, capfd):
    """``--ranks 2``: each process loads one stage (gloo on the CPU), the engine answers the prompts across the ranks,
    the rows go down the pipe and the last rank writes them: the same files as one process."""
    prompts = write_rows(tmp_path / "p.jsonl", ROWS)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert main(["collect", demo_folder, "--prompts", prompts, "-o", one, "--generate", "6"]) == 0
    capfd.readouterr()
    assert main(["collect", demo_folder, "--prompts", prompts, "-o", two, "--generate", "6", "--ranks", "2"]) == 0
    assert "(2 stages, gloo)" in capfd.readouterr().out  # written by the last of two ranks
    assert open(os.path.join(one, "collect.json")).read() == open(os.path.join(two, "collect.json")).read()
    for i in range(len(ROWS)):
        a, b = (torch.load(collect.sample_path(d, i, 5000), weights_only=True) for d in (one, two))
        assert a.keys() == b.keys() and a["input_ids"].tolist() == b["input_ids"].tolist()
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("hidden_state", "aux_hidden_state"):
            # fp32 to the GEMMs' rounding: the launcher gives each rank cpu_count // pp threads (one here), the single
            # process has them all, and their matmuls may sum in another order (a few ulp; CI once saw 1.2e-6 at 1.15)
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5)


def test_dflash_layout_is_read_by_specforge_dflash_training(demo_folder, tmp_path):
    """``--layout dflash``: SpecForge's DFlash-family offline reader, normaliser and collator read every file; the
    ``hidden_states`` are HF's ``hidden_states`` at the taps (any number: here three), equal to the EAGLE-3 layout's
    taps; SpecForge's own DFlash trainer (``OnlineDFlashModel`` over its ``DFlashDraftModel`` reading those taps)
    takes a batch of them and its loss falls over a few steps."""
    pytest.importorskip("specforge")
    from specforge.algorithms.common.dflash_family_data import build_collator, build_offline_reader, \
        normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file

    prompts = write_rows(tmp_path / "p.jsonl", ROWS[:3])
    out, eagle = str(tmp_path / "dflash"), str(tmp_path / "eagle3")
    assert main(["collect", demo_folder, "--prompts", prompts, "-o", out, "--layout", "dflash"]) == 0
    assert main(["collect", demo_folder, "--prompts", prompts, "-o", eagle]) == 0
    assert json.load(open(os.path.join(out, "collect.json")))["layout"] == "dflash"
    refs = build_offline_reader("dflash", out, run_id="t", ttt_length=1, max_len=4096).read()
    assert len(refs) == 3
    hf = demo_model()
    normalized = []
    for ref in refs:
        path = ref.feature_store_uri[len("file://"):]
        raw = load_feature_file(path)
        assert set(raw) == {"input_ids", "loss_mask", "hidden_states"}
        sample = normalize_offline_sample(raw, max_len=4096)
        normalized.append(sample)
        with torch.no_grad():
            states = hf(sample["input_ids"], output_hidden_states=True).hidden_states
        torch.testing.assert_close(sample["hidden_states"], torch.cat([states[j] for j in TAPS], -1), atol=1e-5,
                                   rtol=0)
        index = int(os.path.basename(path)[len("data_"):-len(".ckpt")])
        other = torch.load(collect.sample_path(eagle, index, 5000), weights_only=True)
        assert torch.equal(other["aux_hidden_state"], raw["hidden_states"])
    batch = build_collator()(normalized)
    assert batch["hidden_states"].shape[:2] == batch["input_ids"].shape

    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    h = hf.config.hidden_size
    cfg = Qwen3Config(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=h // 4, vocab_size=hf.config.vocab_size,
                      max_position_embeddings=256, block_size=4, num_target_layers=hf.config.num_hidden_layers,
                      dflash_config={"target_layer_ids": [j - 1 for j in TAPS], "mask_token_id": 0})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    trainer = OnlineDFlashModel(DFlashDraftModel(cfg), hf.lm_head, hf.get_input_embeddings(), mask_token_id=0,
                                block_size=4, attention_backend="sdpa", num_anchors=8)
    opt = torch.optim.Adam(trainer.draft_model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss, _, _ = trainer(input_ids=batch["input_ids"], hidden_states=batch["hidden_states"],
                             loss_mask=batch["loss_mask"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses


def test_speculators_layout_is_read_by_speculators_training_data(tmp_path):
    """``--layout speculators``: speculators' own ``ArrowDataset`` (its file transfer) and ``CollateFn`` read the rows:
    ``hidden_states`` are HF's ``hidden_states`` at the taps, ``verifier_last_hidden_states`` the last layer's output
    before the final norm (tap L), loss masks as given; a folder without tap L is refused in one line."""
    pytest.importorskip("hs_connectors")
    from speculators.train.data import ArrowDataset, CollateFn

    hf = demo_model()
    layers = hf.config.num_hidden_layers
    folder = str(tmp_path / "demo-pp2")
    assert main(["compile", "demo", "--pp", "2", "--aux", f"1,3,{layers}", "--max-batch", "2", "--max-len", "96",
                 "-o", folder]) == 0
    rows = ROWS[:3]
    prompts, out = write_rows(tmp_path / "p.jsonl", rows), str(tmp_path / "data")
    assert main(["collect", folder, "--prompts", prompts, "-o", out, "--layout", "speculators"]) == 0
    dataset = ArrowDataset(max_len=4096, datapath=out, on_missing="raise", hidden_states_dtype=torch.float32)
    assert len(dataset) == 3
    samples = [dataset[i] for i in range(3)]
    for sample, row in zip(samples, rows):
        ids = sample["input_ids"]
        if "input_ids" in row:
            assert ids.tolist() == row["input_ids"] and sample["loss_mask"].tolist() == row["loss_mask"]
        with torch.no_grad():
            states = hf(ids[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(sample["hidden_states"], torch.cat([states[1][0], states[3][0]], -1), atol=1e-5,
                                   rtol=0)
        final = hf.model.norm.weight  # tap L is the stream before the final norm: HF's last entry is after it
        pre = states[-1][0] / final  # undo the norm's scale, then compare directions (RMSNorm keeps them)
        got = sample["verifier_last_hidden_states"]
        torch.testing.assert_close(got / got.norm(dim=-1, keepdim=True), pre / pre.norm(dim=-1, keepdim=True),
                                   atol=1e-4, rtol=0)
    batch = CollateFn(max_len=256, hidden_size=hf.config.hidden_size, num_target_layers=2,
                      dtype=torch.float32)(samples)
    assert batch["hidden_states"].shape == (1, 256, 2 * hf.config.hidden_size)
    assert batch["document_ids"][0, :sum(len(s["input_ids"]) for s in samples)].unique().tolist() == [0, 1, 2]

    plain = str(tmp_path / "no-last")
    assert main(["compile", "demo", "--pp", "1", "--aux", "1,3", "--max-batch", "2", "--max-len", "96", "-o",
                 plain]) == 0
    with pytest.raises(ppsplit.ConfigError, match=f"compile it with --aux 1,3,{layers}"):
        collect.prepare(plain, prompts, str(tmp_path / "x"), layout="speculators")
