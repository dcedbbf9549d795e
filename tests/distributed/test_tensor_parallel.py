"""Tensor parallelism across processes (gloo): folders compiled with ``--tp 2`` run on ``pp x tp`` ranks, TP rank 0
of each stage in the pipeline engine and the other TP rank following it (``ppsplit.distributed.tensor_parallel``).

Oracles: Hugging Face greedy ``generate`` of each of 6 prompts of different lengths, and ``output_hidden_states``
(the taps) and logits of a prefill, on llama, qwen3, gemma2, qwen3_moe, deepseek_v3, qwen3_next (a hybrid) and an
FP8 block-scaled llama; EAGLE-3 speculative decoding equals greedy. Every architecture runs in the same processes,
one job after another (the machine's cores are few). A TP rank killed mid-generation ends every rank with an error.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit.cli import main
from tests.artifact.test_quantized import write_quantized
from tests.passes.test_tp import CONFIGS
from tests.processes import launch, tp_generate_and_fail, tp_suite
from tests.support import drafter_config, random_drafter_tensors, random_model, write_drafter

ARCHS = ["llama", "qwen3", "gemma2", "qwen3_moe", "deepseek_v3", "qwen3_next", "fp8"]
NEW = 6
TAPS = [0, 2, 3]  # each below L=4: equal to HF hidden_states[j]
_rng = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(3, 60, (n,), generator=_rng).tolist() for n in (1, 2, 4, 7, 9, 12)]
PREFILL = [11, 22, 33, 44, 55, 6, 57]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (checkpoint folder, the model Hugging Face loads from it)."""
    root = tmp_path_factory.mktemp("tp-ckpt")
    out = {}
    for arch in ARCHS:
        folder = root / arch
        if arch == "fp8":
            write_quantized(folder, "fp8", block=64)
        else:
            random_model(CONFIGS[arch](), seed=11).save_pretrained(folder)
        out[arch] = str(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return out


@pytest.fixture(scope="module")
def folders(models, tmp_path_factory):
    """(arch, pp) -> a folder compiled with tp=2; ("llama", "eagle3") with a drafter."""
    root = tmp_path_factory.mktemp("tp-out")
    out = {}
    for arch, (checkpoint, model) in models.items():
        for pp in (1, 2):
            out[arch, pp] = ppsplit.compile_model(checkpoint, str(root / f"{arch}-pp{pp}"), pp=pp, tp=2, aux=TAPS,
                                                  cache=ppsplit.CacheConfig(4, 64))
    checkpoint, model = models["llama"]
    cfg = drafter_config(model.config, aux_ids=[t - 1 for t in (1, 2, 3)])  # SpecForge numbering
    drafter = write_drafter(str(root / "drafter"), cfg, random_drafter_tensors(cfg, seed=3))
    out["llama", "eagle3"] = ppsplit.compile_model(checkpoint, str(root / "llama-eagle3"), pp=2, tp=2,
                                                   drafter=drafter, cache=ppsplit.CacheConfig(4, 64))
    return out


def hf_greedy(model, prompt):
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):].tolist()


def check(results, last, jobs, models):
    """``results``: rank 0's (tokens, ...) per job; ``last``: the last stage's TP rank 0's (..., prefill)."""
    for (generated, _), (_, prefill), (folder, _, _, k, ids) in zip(results, last, jobs):
        arch = next(a for a in ARCHS if f"/{a}-" in folder)
        model = models[arch][1]
        tokens = [t for t, _, _ in generated]
        assert k == 0
        assert tokens == [hf_greedy(model, p) for p in PROMPTS], (folder, tokens)
        if ids:
            logits, aux = prefill
            with torch.no_grad():
                ref = model(torch.tensor([ids]), output_hidden_states=True)
            torch.testing.assert_close(logits, ref.logits[0], rtol=1e-3, atol=1e-3)
            for slot, tap in enumerate(TAPS):
                if tap == model.config.num_hidden_layers:
                    continue  # the FP8 llama has 3 layers: tap 3 is before the final norm, HF's entry 3 after it
                torch.testing.assert_close(aux[slot], ref.hidden_states[tap][0], rtol=1e-4, atol=1e-4)


def test_pp2_tp2_four_ranks(folders, models):
    jobs = [(folders[a, 2], PROMPTS, NEW, 0, PREFILL) for a in ARCHS] + \
        [(folders["llama", "eagle3"], PROMPTS, NEW, 3, None)]
    out = launch(4, tp_suite, jobs, deadline=600, timeout=120)
    assert all(out[r][0] == "ok" for r in range(4)), {r: out[r][:3] for r in range(4)}
    check(out[0][1][:-1], out[2][1][:-1], jobs[:-1], models)
    generated = out[0][1][-1][0]  # EAGLE-3 over the grid: the greedy tokens, drafts proposed and accepted
    assert [t for t, _, _ in generated] == [hf_greedy(models["llama"][1], p) for p in PROMPTS]
    assert any(d for _, _, d in generated)  # drafts were proposed and verified
    assert out[1][1][0] == (None, None) and out[3][1][0] == (None, None)  # followers: nothing of their own
    assert out[2][1][0][0].steps > 0  # the last stage's leader ran micro-steps (its engine's Stats)


def test_pp1_tp2_two_ranks(folders, models):
    jobs = [(folders[a, 1], PROMPTS, NEW, 0, PREFILL) for a in ARCHS]
    out = launch(2, tp_suite, jobs, deadline=600, timeout=120)
    assert all(out[r][0] == "ok" for r in range(2)), {r: out[r][:3] for r in range(2)}
    check(out[0][1], out[0][1], jobs, models)


def test_a_dead_tp_rank_ends_every_rank(folders):
    """Global rank 3 (stage 1's second TP rank) dies at its 3rd step: no rank hangs, every survivor fails."""
    out = launch(4, tp_generate_and_fail, folders["llama", 2], PROMPTS, NEW, 3, 3, deadline=120, timeout=20)
    assert out["alive"] == [] and all(out[r][0] in ("error", "exit") for r in range(4)), out
    assert out[3] == ("exit", -9)
    assert any(out[r][0] == "error" and "died" in out[r][2] for r in range(3)), out


def test_ppsplit_run_starts_pp_x_tp_ranks(folders, models, capfd):
    """``ppsplit run`` on a pp=1 x tp=2 folder starts 2 ranks (torch's elastic launcher); rank 0 prints the ids."""
    prompt = PROMPTS[3]
    assert main(["run", folders["llama", 1], "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                 str(NEW), "--timeout", "60"]) == 0
    text = capfd.readouterr().out
    assert ",".join(map(str, hf_greedy(models["llama"][1], prompt))) in text.splitlines(), text


def test_serve_ranks_runs_pp_x_tp_and_other_commands_refuse_a_tp_folder(tmp_path, capsys):
    """``ppsplit serve --ranks 2`` on the demo model at pp=1 x tp=2: greedy completions equal Hugging Face's text, and
    SIGTERM ends the server and both ranks (rank 0's close ends its TP follower's loop). One process, a wrong
    ``--ranks`` and ``collect`` are refused in one line."""
    pytest.importorskip("fastapi")
    from ppsplit.artifact.tokenizer import FolderTokenizer
    from ppsplit.compile.demo import demo_model
    from tests.serve.test_server import MODEL, Live

    folder = ppsplit.compile_model("demo", str(tmp_path / MODEL), pp=1, tp=2, cache=ppsplit.CacheConfig(4, 64))
    assert main(["serve", folder, "--port", "0"]) == 2
    assert "serve it with --ranks 2" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "Hello world"}\n')
    assert main(["collect", folder, "--prompts", str(prompts), "-o", str(tmp_path / "rows")]) == 2
    assert "cut for tensor parallelism (tp=2)" in capsys.readouterr().err
    assert not (tmp_path / "rows").exists()

    tok, model = FolderTokenizer(folder), demo_model()
    server = Live(folder, "--ranks", "2")
    try:
        for text, n in (("Hello world", 6), ("The pipeline splits the model into stages.", 9)):
            ids = tok.encode(text)
            status, body = server.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": n,
                                                           "temperature": 0})
            assert status == 200, body
            with torch.no_grad():
                ref = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
            assert body["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True), (text, body)
    finally:
        code = server.stop()
    assert code == 0, "".join(server.lines)
