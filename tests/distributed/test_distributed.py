"""Multi-process pipeline (ppsplit.distributed, ppsplit run) on gloo: 2 and 4 CPU processes, one per stage.

Oracles: Hugging Face greedy ``generate`` and ``output_hidden_states`` of the unsplit model, and the
single-process ``SplitModel.generate`` of the same folder.
"""
import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit.artifact.folder import fingerprint
from ppsplit import distributed as ppd
from tests.processes import generate, generate_and_fail, launch, pipelining
from tests.support import VOCAB, tiny_model

TAPS = (0, 2, 4)  # all below L=5: each equals HF hidden_states[j]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(folder)
    _save_tokenizer(folder)
    return folder


def _save_tokenizer(folder):
    """A word-level tokenizer over the tiny vocabulary: word ``w<i>`` is id ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w3", eos_token="w2", pad_token="w0").save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    out = {}
    for name, pp in (("pp2", 2), ("pp4", 4)):
        out[name] = ppsplit.compile_model(str(checkpoint), str(root / name), pp=pp, aux=list(TAPS),
                                          cache=ppsplit.CacheConfig(8, 48))
    # The same stages under a plan that says bfloat16: what a folder compiled with another --dtype declares.
    other = shutil.copytree(out["pp2"], root / "pp2-bf16")
    plan = json.loads((other / "plan.json").read_text())
    text = json.dumps(dict(plan, dtype="bfloat16"))
    (other / "plan.json").write_text(text)
    for k in range(2):  # a compile writes its plan's fingerprint into each stage program
        program = json.loads((other / f"stage_{k}.json").read_text())
        (other / f"stage_{k}.json").write_text(json.dumps(dict(program, plan_sha256=fingerprint(text))))
    out["pp2-bf16"] = str(other)
    return out


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def _ok(results, world):
    for r in range(world):
        assert results[r][0] == "ok", f"rank {r}: {results[r]}"
    assert results["alive"] == []


def test_compile_copies_tokenizer_and_generation_config(folders):
    names = set(os.listdir(folders["pp2"]))
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names


def test_group_instances_write_their_own_rows_of_the_shared_cache(folders):
    stage = ppsplit.load_stage(folders["pp2"], 1)
    caches = {n: b for n, b in stage.named_buffers() if n.startswith("kv_cache.")}
    a, b = ppd.group_stages(stage, groups=2, rows=3)
    for name, buf in caches.items():
        view = dict(b.named_buffers())[name]
        assert view.data_ptr() == buf[3:6].data_ptr() and view.shape[0] == 3
    x = torch.randn(3, 4, 64)
    with torch.no_grad():
        b(x, torch.arange(4), torch.zeros(3, 3, 4, 64))
    for name, buf in caches.items():
        assert buf[3:6, :, :4].abs().sum() > 0  # written in place through the view
        assert buf[:3].abs().sum() == 0 and buf[6:].abs().sum() == 0  # other groups' rows untouched
    with pytest.raises(ppsplit.ConfigError, match="--max-batch 8"):
        ppd.group_stages(stage, groups=3, rows=3)


@pytest.mark.parametrize("pp,rows,lengths", [(2, 4, (6,)), (2, 2, (5, 7)), (4, 1, (3, 6, 4, 5))],
                         ids=["pp2-one-group", "pp2-M2", "pp4-M4"])
def test_generate_equals_hf_and_single_process(pp, rows, lengths, folders, hf):
    """M groups of different prompt lengths in flight; ids equal HF greedy and SplitModel.generate; the taps
    seen on the last rank equal HF's hidden states at every position of prefill and decode."""
    torch.manual_seed(pp + len(lengths))
    prompts = [torch.randint(3, VOCAB, (rows, t)) for t in lengths]
    new = 10
    res = launch(pp, generate, folders[f"pp{pp}"], prompts, new, True, timeout=30)
    print(f"launch of {pp} ranks: {res['elapsed']:.1f}s")
    _ok(res, pp)
    outs, stats = res[0][1]
    taps = res[pp - 1][1][0]
    single = ppsplit.load(folders[f"pp{pp}"])
    for g, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(prompt, max_new_tokens=new, do_sample=False)
            hidden = hf(expected[:, :-1], output_hidden_states=True).hidden_states
        assert torch.equal(outs[g], expected)
        assert torch.equal(outs[g], single.generate(prompt, new))
        seen = taps[g][:, :, : expected.shape[1] - 1]
        assert seen.shape == (len(TAPS), rows, expected.shape[1] - 1, 64)
        for slot, tap in enumerate(TAPS):
            torch.testing.assert_close(seen[slot], hidden[tap], atol=1e-5, rtol=1e-5)
    assert stats.items == len(lengths) * new  # prefill + new - 1 decode steps per group
    # Boundary bytes: hidden + aux prefix per item is the payload; positions add 8 bytes per token.
    sent = res[0][1][1]
    assert sent.bytes_sent - sent.payload_bytes == 8 * (sum(lengths) + len(lengths) * (new - 1))


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_nccl_two_gpus_equal_single_process(cuda_graphs, folders):
    """NCCL, rank r on cuda:r, 2 groups in flight (decode steps replayed from CUDA graphs or eager), generate run
    twice: the ids equal the single-process split on one GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    torch.manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (2, t)) for t in (5, 7)]
    new = 12
    res = launch(2, generate, folders["pp2"], prompts, new, False, cuda_graphs, timeout=60, deadline=150,
                 backend="nccl")
    print(f"launch of 2 NCCL ranks: {res['elapsed']:.1f}s")
    _ok(res, 2)
    (first, again), stats = res[0][1]
    single = ppsplit.load(folders["pp2"], ["cuda:0", "cuda:0"])
    for g, prompt in enumerate(prompts):
        expected = single.generate(prompt.cuda(), new).cpu()
        assert torch.equal(first[g], expected), g
        assert torch.equal(again[g], expected), g
    assert stats.items == len(prompts) * new


def test_mismatched_ranks_fail_on_every_rank(folders):
    """Folders from different compiles, a wrong world size, a job that does not fit: the same ConfigError on
    every rank, no hang."""
    prompts = [torch.randint(3, VOCAB, (2, 5))]
    res = launch(2, generate, [folders["pp2"], folders["pp2-bf16"]], prompts, 4, timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError"), res[r]
        assert "rank 1 disagrees with rank 0 on dtype 'bfloat16' (rank 0: 'float32'), fingerprint" in res[r][2], res[r]
    res = launch(2, generate, folders["pp4"], prompts, 4, timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError") and "4 stages but 2 ranks" in res[r][2], res[r]
    res = launch(2, generate, folders["pp2"], [torch.randint(3, VOCAB, (2, 40))], 20, timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError") and "--max-len" in res[r][2], res[r]
    assert res["alive"] == [] and res["elapsed"] < 40


def test_killed_rank_ends_every_process(folders):
    """Rank 1 of 4 is SIGKILLed mid-decode: every other rank ends by itself with a PipelineError, and the
    first failure reported names rank 1."""
    prompts = [torch.randint(3, VOCAB, (2, 4)) for _ in range(4)]
    res = launch(4, generate_and_fail, folders["pp4"], prompts, 30, 1, 6, "kill", timeout=15, deadline=60)
    assert res[1] == ("exit", -9)
    for r in (0, 2, 3):
        assert res[r][:2] == ("error", "PipelineError"), res[r]
    # Rank 2 sees rank 1 go; rank 0 (which hosts the store) reads the first failure reported; rank 3 sees
    # rank 2 go, and the first report too when rank 0's store is still up.
    assert "could not receive from rank 1: rank 1 died" in res[2][2]
    assert "rank 1 died" in res[0][2], res[0][2]
    assert "rank 2 died" in res[3][2] or "rank 1 died" in res[3][2], res[3][2]
    assert res["alive"] == [] and res["elapsed"] < 60


def test_stalled_rank_times_out(folders):
    """The last rank stops answering for longer than the timeout: rank 0 gives up after the timeout, naming it;
    the stalled rank fails on its next transfer once it resumes. Nothing hangs."""
    prompts = [torch.randint(3, VOCAB, (2, 4)) for _ in range(2)]
    res = launch(2, generate_and_fail, folders["pp2"], prompts, 30, 1, 4, "stall:6", timeout=2, deadline=40)
    assert res[0][:2] == ("error", "PipelineError") and "rank 1 stalled past the timeout" in res[0][2], res[0]
    assert res[1][:2] == ("error", "PipelineError") and "rank 0" in res[1][2], res[1]
    assert res["alive"] == [] and res["elapsed"] < 25


def test_pipelining_schedule_gpipe_gives_the_same_logits(folders):
    """A stage runs as the submodule of torch.distributed.pipelining.PipelineStage under ScheduleGPipe
    (2 microbatches); the merged logits and aux equal the single-process split."""
    ids = torch.randint(3, VOCAB, (4, 6))
    res = launch(2, pipelining, folders["pp2"], ids, 2, timeout=30)
    _ok(res, 2)
    logits, aux = res[1][1]
    with torch.no_grad():
        ref_logits, ref_aux = ppsplit.load(folders["pp2"])(ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, ref_aux, atol=1e-5, rtol=1e-5)


def test_cli_run_prints_text_like_hf(folders, hf, checkpoint, capfd):
    """``ppsplit run`` launches one process per stage itself (torch's elastic launcher) and prints the decoded
    text and tokens/s."""
    from transformers import AutoTokenizer

    from ppsplit.cli import main

    tok = AutoTokenizer.from_pretrained(checkpoint)
    prompt = "w5 w17 w9 w44"
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    code = main(["run", folders["pp2"], "--prompt", prompt, "--max-new-tokens", "6", "--microbatches", "2",
                 "--timeout", "30"])
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    text = tok.decode(expected.tolist(), skip_special_tokens=True)
    assert lines[:2] == [f"[group 0] {text}", f"[group 1] {text}"], out
    assert "tokens/s (2 stages, gloo, 2 groups of 1)" in lines[2]


def test_cli_run_errors_are_one_line(folders, capsys):
    from ppsplit.cli import main

    assert main(["run", folders["pp2"], "--prompt-ids", "1,x", "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ppsplit: error: --prompt-ids must be comma-separated token ids like 1,2,3, but got '1,x'"]
    assert main(["run", folders["pp2"], "--prompt-ids", "1,2", "--microbatches", "2", "--batch", "3"]) == 2
    assert "--batch 3 must be a multiple of --microbatches 2" in capsys.readouterr().err
