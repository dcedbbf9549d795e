"""Multi-process pipeline (ppsplit.distributed, ppsplit run) on gloo: 2 and 4 CPU processes, one per stage.

Oracles: Hugging Face greedy ``generate`` of each prompt alone, and the in-process ``Engine`` over the same
folder.
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
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.processes import generate, generate_and_fail, generate_choices, launch, pipelining, serve
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
                                          cache=ppsplit.CacheConfig(8, 64))
    out["pp2-plain"] = ppsplit.compile_model(str(checkpoint), str(root / "pp2-plain"), pp=2, aux=list(TAPS))
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


def _requests(seed: int, n: int = 12):
    """``n`` greedy requests, prompt lengths 2..48, arriving over the first steps, with different max_tokens; every
    third stops at a token id of its own."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(2, 48, n).round().long().tolist()
    out = []
    for i, t in enumerate(lengths):
        prompt = torch.randint(3, VOCAB, (t,), generator=g).tolist()
        stop = (int(torch.randint(3, VOCAB, (1,), generator=g)),) if i % 3 == 2 else ()
        out.append((prompt, SamplingParams(max_tokens=4 + i % 5, stop_token_ids=stop), i // 2))
    return out


def _expected(hf, prompt, params):
    """HF greedy of ``prompt`` alone, cut at the first stop id (kept), as the engine ends a request."""
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False)[0, len(prompt):]
    ids = ids.tolist()
    for i, t in enumerate(ids):
        if t in params.stop_token_ids or t == hf.generation_config.eos_token_id:
            return ids[:i + 1]
    return ids


@pytest.mark.parametrize("pp", [2, 4])
def test_requests_arriving_at_different_steps_equal_hf_alone(pp, folders, hf):
    """12 requests (prompts of 2..48 tokens, two arriving per step, different max_tokens and stop ids) through pp
    gloo ranks with pp micro-steps in flight and 8 sequence slots (so some wait for a slot): each request's tokens
    equal HF greedy of its prompt alone, and the block pool is whole again at the end."""
    requests = _requests(pp)
    res = launch(pp, serve, folders[f"pp{pp}"], requests, timeout=30, deadline=240)
    print(f"launch of {pp} ranks: {res['elapsed']:.1f}s")
    _ok(res, pp)
    outputs, in_use, _, _ = res[0][1]
    assert in_use == 0 and sorted(outputs, key=int) == [str(i) for i in range(len(requests))]
    for i, (prompt, params, _) in enumerate(requests):
        assert outputs[str(i)][0] == _expected(hf, prompt, params), i
    stats = res[pp - 1][1]
    assert stats.steps >= 4  # micro-steps, each holding some requests


def test_generate_twice_on_every_rank_equals_single_process(folders):
    """``PipelineEngine.generate`` is collective and can be called again; both runs equal the in-process Engine."""
    prompts = [[5, 9, 17], [4, 40, 41, 42, 43, 44, 45], [6]]
    params = SamplingParams(max_tokens=6)
    res = launch(2, generate, folders["pp2"], prompts, params, timeout=30, deadline=120)
    _ok(res, 2)
    single = Engine(ppsplit.load(folders["pp2"])).generate(prompts, params)
    for run in res[0][1]:
        assert [o[0] for o in run] == [o.token_ids for o in single]


def test_sampling_with_seeds_equals_single_process(folders):
    """Temperature 0.8, top-p 0.9, top-k 50 with a seed per request: the tokens across 4 ranks equal the in-process
    engine's (a request's draws depend on its seed and output index only); adjusted logits (penalties, a bias,
    min_tokens), logprobs and prompt logprobs travel to the last rank and back."""
    prompts = [[5, 9, 17], [4, 40, 41, 42], [6, 7], [8, 9, 9]]
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    params += [SamplingParams(max_tokens=8, seed=4, repetition_penalty=1.5, frequency_penalty=0.5, min_tokens=4,
                              logit_bias={9: 3.0}, logprobs=2, prompt_logprobs=1)]
    res = launch(4, generate, folders["pp4"], prompts, params, timeout=30, deadline=120)
    _ok(res, 4)
    single = Engine(ppsplit.load(folders["pp4"])).generate(prompts, params)
    assert [o[0] for o in res[0][1][0]] == [o.token_ids for o in single]


def test_choices_sharing_the_prompt_blocks_equal_single_process(folders, hf):
    """n choices across 4 ranks share the prompt's full blocks (host bookkeeping: the block tables every step
    carries, no new message): seeded choices equal the in-process engine's, greedy ones HF's."""
    prompt = [(7 * i) % 120 + 3 for i in range(37)]  # 2 full blocks shared
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=30 + j, ignore_eos=True) for j in range(3)]
    params.append(SamplingParams(max_tokens=6))
    res = launch(4, generate_choices, folders["pp4"], prompt, params, timeout=30, deadline=120)
    _ok(res, 4)
    tokens, shared, in_use = res[0][1]
    assert (shared, in_use) == (3 * 32, 0)
    assert tokens == [o.token_ids for o in Engine(ppsplit.load(folders["pp4"])).generate([prompt] * 4, params)]
    assert tokens[3] == _expected(hf, prompt, params[3])


def test_mismatched_ranks_fail_on_every_rank(folders):
    """Folders from different compiles, a wrong world size, a prompt that does not fit: the same ConfigError on
    every rank, no hang."""
    prompts = [[5, 6, 7]]
    res = launch(2, generate, [folders["pp2"], folders["pp2-bf16"]], prompts, timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError"), res[r]
        assert "rank 1 disagrees with rank 0 on dtype 'bfloat16' (rank 0: 'float32'), fingerprint" in res[r][2], res[r]
    res = launch(2, generate, folders["pp4"], prompts, timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError") and "4 stages but 2 ranks" in res[r][2], res[r]
    res = launch(2, generate, folders["pp2"], [[5] * 60], SamplingParams(max_tokens=20), timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError") and "--max-len" in res[r][2], res[r]
    res = launch(2, generate, folders["pp2"], [[5, 6], [1, 99999]], timeout=10, deadline=40)
    for r in range(2):
        assert res[r][:2] == ("error", "ConfigError") and "outside the vocabulary" in res[r][2], res[r]
    assert res["alive"] == [] and res["elapsed"] < 40


def test_killed_rank_ends_every_process(folders):
    """Rank 1 of 4 is SIGKILLed at its 6th micro-step: every other rank ends by itself with a PipelineError, and
    the first failure reported names rank 1."""
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    res = launch(4, generate_and_fail, folders["pp4"], prompts, SamplingParams(max_tokens=30, ignore_eos=True), 1, 6,
                 "kill", timeout=15, deadline=60)
    assert res[1] == ("exit", -9)
    for r in (0, 2, 3):
        assert res[r][:2] == ("error", "PipelineError"), res[r]
    # Rank 2 sees rank 1 go; rank 0 (which hosts the store) reads the first failure reported; rank 3 sees
    # rank 2 go, and the first report too when rank 0's store is still up.
    assert "rank 1 died" in res[2][2], res[2][2]
    assert "rank 1 died" in res[0][2], res[0][2]
    assert "rank 2 died" in res[3][2] or "rank 1 died" in res[3][2], res[3][2]
    assert res["alive"] == [] and res["elapsed"] < 60


def test_stalled_rank_times_out(folders):
    """The last rank stops answering for longer than the timeout: rank 0 gives up after the timeout, naming it;
    the stalled rank fails on its next transfer once it resumes. Nothing hangs."""
    prompts = [[5, 6, 7, 8], [9, 10]]
    res = launch(2, generate_and_fail, folders["pp2"], prompts, SamplingParams(max_tokens=30, ignore_eos=True), 1, 4,
                 "stall:6", timeout=2, deadline=40)
    assert res[0][:2] == ("error", "PipelineError") and "rank 1 stalled past the timeout" in res[0][2], res[0]
    assert res[1][:2] == ("error", "PipelineError") and "rank 0" in res[1][2], res[1]
    assert res["alive"] == [] and res["elapsed"] < 25


def test_pipelining_schedule_gpipe_gives_the_same_logits(folders):
    """A stage runs as the submodule of torch.distributed.pipelining.PipelineStage under ScheduleGPipe
    (2 microbatches); the merged logits and aux equal the single-process split. A paged stage is refused there."""
    ids = torch.randint(3, VOCAB, (4, 6))
    res = launch(2, pipelining, folders["pp2-plain"], ids, 2, timeout=30)
    _ok(res, 2)
    logits, aux = res[1][1]
    with torch.no_grad():
        ref_logits, ref_aux = ppsplit.load(folders["pp2-plain"])(ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, ref_aux, atol=1e-5, rtol=1e-5)
    with pytest.raises(ppsplit.ConfigError, match="PipelineEngine"):
        ppd.for_pipelining(ppsplit.load_stage(folders["pp2"], 0))


def test_cli_run_prints_text_like_hf(folders, hf, checkpoint, capfd):
    """``ppsplit run`` launches one process per stage itself (torch's elastic launcher) and prints the decoded
    text and tokens/s."""
    from transformers import AutoTokenizer

    from ppsplit.cli import main

    tok = AutoTokenizer.from_pretrained(checkpoint)
    prompts = ["w5 w17 w9 w44", "w7 w3"]
    texts = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        new = _expected(hf, ids[0].tolist(), SamplingParams(max_tokens=6))
        texts.append(tok.decode(new, skip_special_tokens=True))
    code = main(["run", folders["pp2"], "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "6",
                 "--timeout", "30"])
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    assert lines[:2] == [f"[0] {texts[0]}", f"[1] {texts[1]}"], out
    assert "tokens/s (2 stages, gloo, 2 requests)" in lines[2], out


def test_cli_run_errors_are_one_line(folders, capsys):
    from ppsplit.cli import main

    assert main(["run", folders["pp2"], "--prompt-ids", "1,x", "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ppsplit: error: --prompt-ids must be comma-separated token ids like 1,2,3, but got '1,x'"]
    assert main(["run", folders["pp2"], "--prompt-ids", "1,2", "--temperature", "-1"]) == 2
    assert "temperature must be a number from 0 (greedy) to 100, but got -1.0" in capsys.readouterr().err
    assert main(["run", folders["pp2"], "--prompt-ids", "1,2", "-k", "2"]) == 2
    assert "holds no drafter; compile it with --drafter" in capsys.readouterr().err
