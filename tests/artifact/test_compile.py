"""ppsplit compile / inspect / load: artifacts from a sharded checkpoint, errors, and interrupted compiles."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit.cli import main
from tests.support import VOCAB, tiny_model

L = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama with a tied embedding, saved in many small shards."""
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    model = tiny_model("llama", tie_word_embeddings=True)
    model.save_pretrained(folder, max_shard_size="40KB")
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    assert len(shards) > 10 and (folder / "model.safetensors.index.json").exists()
    return folder


@pytest.fixture(scope="module")
def compiled(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "tiny-pp3"
    assert main(["compile", str(checkpoint), "--pp", "3", "--aux", "0,2,5", "-o", str(out)]) == 0
    return out


def test_stage_files_hold_exactly_their_tensors(checkpoint, compiled):
    plan = ppsplit.artifact.folder.CompiledFolder(str(compiled)).plan
    assert plan.pp == 3 and plan.taps == (0, 2, 5)
    assert sorted(os.listdir(compiled)) == sorted(["plan.json", "manifest.json", "generation_config.json"] +
                                                  [f"stage_{k}.{ext}" for k in range(3) for ext in ("json", "safetensors")])
    hf = AutoModelForCausalLM.from_pretrained(checkpoint)
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    for sp in plan.stages:
        with safe_open(compiled / f"stage_{sp.index}.safetensors", framework="pt") as f:
            names = set(f.keys())
            for name in names:
                if name in hf_params:
                    assert torch.equal(f.get_tensor(name), hf_params[name].detach())
        layers = {n for n in hf_params if any(n.startswith(f"model.layers.{i}.") for i in range(sp.start, sp.end))}
        expected = set(layers)
        if sp.index == 0:
            expected.add("model.embed_tokens.weight")
        if sp.index == plan.pp - 1:
            expected |= {"model.norm.weight", "lm_head.weight"}  # tied in the checkpoint, replicated here
        assert names - {"model.rotary_emb.inv_freq"} == expected
        assert "model.rotary_emb.inv_freq" in names  # computed at init, not in the checkpoint: stored with the stage


def test_loaded_stages_match_hf(checkpoint, compiled):
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    split = ppsplit.load(str(compiled))
    ids = torch.randint(3, VOCAB, (2, 7))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, aux = split(ids)
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[0], ref.hidden_states[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[1], ref.hidden_states[2], atol=1e-5, rtol=1e-5)
    stage = ppsplit.load_stage(str(compiled), 1)
    assert stage.meta["ppsplit.stage"] == 1 and set(dict(stage.named_parameters())) <= set(
        dict(split.stages[1].named_parameters()))


def test_loaded_stages_after_the_cuda_rewrites_hold_split_models_ops(checkpoint, compiled):
    """What ``load`` applies on a CUDA device (fused projections, the pointwise folds), applied here on the CPU to the
    folder's stages, leaves the same operators, call for call, as ``split_model`` with those options on the same
    model and cache: a served folder runs what the benchmarks of split_model time. The one difference allowed is an
    ``aten.contiguous`` the compile's trace keeps after the attention, and each such call must find its input
    contiguous when the stage runs (so it copies nothing)."""
    from collections import Counter

    from ppsplit import CacheConfig
    from ppsplit.core.options import StageOptions
    from ppsplit.core.ragged import CacheLayout, RaggedStep
    from ppsplit.passes.rewrites import apply_rewrites

    plan = ppsplit.artifact.folder.CompiledFolder(str(compiled)).plan
    options = StageOptions(fuse_projections=True, fuse_pointwise=True, gemv=True)
    loaded = ppsplit.load(str(compiled))
    for stage in loaded.stages:
        apply_rewrites(stage, options)
    cache = CacheConfig(batch_size=plan.max_batch, max_len=plan.max_len, num_blocks=plan.num_blocks,
                        block_size=plan.block_size)
    split = ppsplit.split_model(AutoModelForCausalLM.from_pretrained(checkpoint).eval(), 3, aux="0,2,5", cache=cache,
                                fuse_projections=True, fuse_pointwise=True, gemv=True)
    contiguous = torch.ops.aten.contiguous.default
    for a, b in zip(loaded.stages, split.stages):
        ops_a, ops_b = ([str(n.target) for n in s.graph.nodes if n.op == "call_function"] for s in (a, b))
        assert "ppsplit.rope_write.default" in ops_a
        extra, missing = Counter(ops_a) - Counter(ops_b), Counter(ops_b) - Counter(ops_a)
        assert not missing and set(extra) <= {str(contiguous)}, (extra, missing)

    copies = []

    class Watch(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is contiguous:
                copies.append(args[0].is_contiguous())
            return super().call_function(target, args, kwargs)

    step = RaggedStep.lockstep(1, 3, 0, CacheLayout.of(plan))
    x = torch.tensor([3, 4, 5])
    aux = torch.zeros(len(plan.taps), 3, plan.hidden_size)
    with torch.no_grad():
        for stage in loaded.stages:
            x, aux = Watch(stage).run(x, step.positions, aux, *step.tensors()[1:])
    assert all(copies), copies


def test_compile_with_cache_decodes_like_hf(checkpoint, tmp_path):
    out = tmp_path / "cached"
    assert main(["compile", str(checkpoint), "--pp", "2", "--max-batch", "2", "--max-len", "40", "-o", str(out)]) == 0
    split = ppsplit.load(str(out))
    assert split.plan.max_len == 40
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(split.generate(ids, 12), expected)


def test_inspect_prints_stages_and_taps(compiled, capsys):
    assert main(["inspect", str(compiled)]) == 0
    text = capsys.readouterr().out
    assert "pp=3" in text and "residual entering layer 2" in text and "stage_2.safetensors" in text
    assert "tap 2 -> slot 1" in text  # what the fuse pass did, per stage


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in err if line.startswith("ppsplit: error")]


@pytest.mark.parametrize("case", ["missing", "no_config", "not_decoder", "missing_shard", "corrupt_shard",
                                  "bad_aux", "bad_pp", "exists"])
def test_bad_input_one_line_exit_2_nothing_written(case, checkpoint, compiled, tmp_path, capsys):
    import shutil

    source = str(checkpoint)
    out = tmp_path / "out"
    args = ["--pp", "2"]
    if case == "missing":
        source = str(tmp_path / "nope")
    elif case == "no_config":
        (tmp_path / "empty").mkdir()
        source = str(tmp_path / "empty")
    elif case == "not_decoder":
        from transformers import T5Config
        T5Config(d_model=32, num_layers=2, num_heads=2, d_kv=16, d_ff=64, vocab_size=64).save_pretrained(tmp_path / "t5")
        source = str(tmp_path / "t5")
    elif case in ("missing_shard", "corrupt_shard"):
        source = str(tmp_path / "ckpt")
        shutil.copytree(checkpoint, source)
        shard = sorted(f for f in os.listdir(source) if f.endswith(".safetensors"))[3]
        if case == "missing_shard":
            os.remove(os.path.join(source, shard))
        else:
            with open(os.path.join(source, shard), "r+b") as f:
                f.truncate(os.path.getsize(os.path.join(source, shard)) // 2)
    elif case == "bad_aux":
        args = ["--pp", "2", "--aux", "1,17"]
    elif case == "bad_pp":
        args = ["--pp", "9"]
    elif case == "exists":
        out = compiled
    before = sorted(os.listdir(tmp_path))
    code, errors = run_cli(["compile", source, *args, "-o", str(out)], capsys)
    assert code == 2 and len(errors) == 1, errors
    expected = {"missing": "does not exist", "no_config": "without config.json", "not_decoder": "encoder-decoder",
                "missing_shard": "is missing", "corrupt_shard": "truncated", "bad_aux": "aux id 17 is out of range",
                "bad_pp": "pp must be between 1 and 5", "exists": "already exists; pass --force"}[case]
    assert expected in errors[0]
    if case != "exists":
        assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary folder
    else:
        assert (compiled / "plan.json").exists()  # untouched


def test_force_replaces_and_failure_midway_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "out"
    ppsplit.compile_model(str(checkpoint), str(out), pp=2)
    ppsplit.compile_model(str(checkpoint), str(out), pp=3, force=True)
    assert ppsplit.artifact.folder.CompiledFolder(str(out)).plan.pp == 3

    calls = {"n": 0}
    real = ppsplit.compile.writer.write_safetensors

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # Ctrl-C while writing stage 1
        return real(*a, **k)

    monkeypatch.setattr(ppsplit.compile.writer, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ppsplit.compile_model(str(checkpoint), str(tmp_path / "new"), pp=3)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_killed_compile_leaves_no_output(tmp_path):
    """SIGTERM during the write removes the temporary folder; SIGKILL leaves no output folder, and the next
    compile clears the dead one's temporary folder."""
    model = tiny_model("llama", num_layers=4, hidden_size=256, intermediate_size=1024, vocab_size=32000)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20MB")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        out = tmp_path / f"out-{sig.name}"
        proc = subprocess.Popen([sys.executable, "-m", "ppsplit.cli", "compile", str(tmp_path / "ckpt"), "--pp", "2",
                                 "-o", str(out)], env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if any(".ppsplit-tmp-" in e for e in os.listdir(tmp_path)):
                proc.send_signal(sig)
                break
            time.sleep(0.005)
        proc.wait(timeout=60)
        assert not out.exists()
        leftovers = [e for e in os.listdir(tmp_path) if ".ppsplit-tmp-" in e]
        if sig == signal.SIGTERM:
            assert proc.returncode == 130 and leftovers == []
    ppsplit.compile_model(str(tmp_path / "ckpt"), str(tmp_path / "final"), pp=2)
    assert [e for e in os.listdir(tmp_path) if ".ppsplit-tmp-" in e] == []


def test_loading_never_runs_code_from_the_folder(compiled, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(compiled, bad)
    program = json.loads((bad / "stage_0.json").read_text())
    next(n for n in program["program"]["nodes"] if n["op"] == "call_function")["target"] = "os.system"
    (bad / "stage_0.json").write_text(json.dumps(program))
    with pytest.raises(ppsplit.ConfigError, match="not an allowed operator"):
        ppsplit.load_stage(str(bad), 0)


@pytest.mark.gpu
def test_load_stages_onto_gpus(compiled):
    """Each stage loads straight onto its device (stage k on GPU k when there are enough GPUs)."""
    n = torch.cuda.device_count()
    devices = [f"cuda:{k % n}" for k in range(3)]
    split = ppsplit.load(str(compiled), devices)
    cpu = ppsplit.load(str(compiled))
    ids = torch.randint(3, VOCAB, (2, 7))
    with torch.no_grad():
        logits, aux = split(ids.to(devices[0]))
        ref_logits, ref_aux = cpu(ids)
    assert logits.device == torch.device(devices[-1])
    torch.testing.assert_close(logits.cpu(), ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux.cpu(), ref_aux, atol=1e-4, rtol=1e-4)


def test_hub_id_resolves_through_the_local_cache(checkpoint, tmp_path, monkeypatch, capsys):
    """A hub id is looked up in the local Hugging Face cache (no network needed when it is there)."""
    import shutil

    import huggingface_hub.constants as hub

    snapshot = tmp_path / "hub" / "models--ppsplit--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(checkpoint, snapshot)
    (tmp_path / "hub" / "models--ppsplit--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--ppsplit--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    assert main(["compile", "ppsplit/tiny-llama", "--pp", "2", "-o", str(tmp_path / "out")]) == 0
    assert ppsplit.artifact.folder.CompiledFolder(str(tmp_path / "out")).plan.pp == 2
    code, errors = run_cli(["compile", "ppsplit/not-there", "--pp", "2", "-o", str(tmp_path / "x")], capsys)
    assert code == 2 and "not in the local Hugging Face cache" in errors[0]
    assert not (tmp_path / "x").exists()
