"""What a new user runs into first: each case reproduced as they met it, and the one-line error they now get."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ppsplit
from ppsplit import CacheConfig, ConfigError, TraceError
from ppsplit.cli import main
from tests.support import VOCAB, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_export_failure_names_the_line_under_a_path_containing_ppsplit(tmp_path):
    """A checkout (or model code) under a folder whose name contains 'ppsplit' keeps the line number."""
    folder = tmp_path / "ppsplit-checkout" / "ppsplit"
    folder.mkdir(parents=True)
    (folder / "user_model.py").write_text(textwrap.dedent("""
        from types import SimpleNamespace
        import torch

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(8, 8)

            def forward(self, x):
                return x + self.proj(x)

        class Branchy(torch.nn.Module):
            _no_split_modules = ["Block"]

            def __init__(self):
                super().__init__()
                self.config = SimpleNamespace(num_hidden_layers=2, vocab_size=16, max_position_embeddings=32)
                self.embed = torch.nn.Embedding(16, 8)
                self.layers = torch.nn.ModuleList([Block(), Block()])
                self.head = torch.nn.Linear(8, 16)

            def forward(self, input_ids, position_ids=None, use_cache=None):
                h = self.embed(input_ids)
                if input_ids.sum() > 3:  # data-dependent Python control flow
                    h = h * 2
                for layer in self.layers:
                    h = layer(h)
                return (self.head(h),)
    """))
    spec = importlib.util.spec_from_file_location("user_model", folder / "user_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(TraceError, match=r"at user_model\.py:25 `if input_ids.sum\(\) > 3:[^`]*` \(the model's own code, "
                                         r"not ppsplit\)"):
        ppsplit.split_model(module.Branchy(), 2)


@pytest.fixture(scope="module")
def cached_split():
    return ppsplit.split_model(tiny_model("llama"), 2, aux=[1], cache=CacheConfig(batch_size=2, max_len=16))


@pytest.mark.parametrize("ids,positions,message", [
    (torch.randint(3, VOCAB, (3, 4)), torch.arange(4), r"batch 3 does not fit the KV cache of 2 sequences"),
    (torch.randint(3, VOCAB, (1, 2)), torch.tensor([15, 16]), r"positions 15\.\.16 do not fit the KV cache of 16"),
    (torch.randint(3, VOCAB, (1, 2)), torch.tensor([-1, 0]), r"positions -1\.\.0 do not fit"),
    (torch.rand(1, 4), torch.arange(4), r"input_ids must be a 2-D integer tensor .* torch.float32"),
    (torch.randint(3, VOCAB, (4,)), torch.arange(4), r"input_ids must be a 2-D integer tensor .* 1-D"),
    (torch.randint(3, VOCAB, (1, 4)), torch.arange(3), r"positions must be a 1-D integer tensor with one cache "
                                                      r"position per token \(4\)"),
    (torch.randint(3, VOCAB, (1, 4)), torch.arange(4.0), r"positions must be .* torch.float32"),
])
def test_runtime_refuses_bad_input_with_the_fix(cached_split, ids, positions, message):
    with pytest.raises(ConfigError, match=message):
        cached_split(ids, positions)


def test_runtime_accepts_good_input_after_refusing_bad(cached_split):
    ids = torch.randint(3, VOCAB, (2, 4))
    logits, aux = cached_split(ids, torch.arange(4))
    assert logits.shape == (2, 4, VOCAB) and aux.shape == (1, 2, 4, 64)
    with pytest.raises(ConfigError, match="positions 16..16"):
        cached_split(ids[:, :1], torch.tensor([16]))


def test_no_gpu_advice_names_the_real_cause(tmp_path, cached_split):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the advice is for machines without one")
    out = ppsplit.compile_model("demo", str(tmp_path / "d"), pp=2)
    with pytest.raises(ConfigError, match=r"device cuda:0 is not available: this machine has no CUDA GPU .*'cpu'"):
        ppsplit.load_stage(out, 1, "cuda:0")
    with pytest.raises(ConfigError, match=r"capture needs CUDA: stage 0 is on cpu and this machine has no CUDA GPU"):
        cached_split.capture(batch=1, tokens=[1])


def test_cli_one_line_errors(tmp_path, capsys):
    assert main(["inspect", "/etc/passwd"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/etc/passwd is a file; pass a folder written by ppsplit compile" in err
    assert err.count("compile the folder again") == 0

    # The output location is checked before the trace: nothing was traced (no "tracing" log line). A folder
    # under a file cannot be created, even by root.
    (tmp_path / "a-file").write_text("")
    bad = str(tmp_path / "a-file" / "out")
    assert main(["compile", "demo", "--pp", "2", "-o", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ppsplit: error: cannot write the output folder {bad}") and "tracing" not in err, err
    assert err.strip().count("\n") == 0 and not os.path.exists(bad)


def test_inspect_checks_the_programs_like_load(tmp_path, capsys):
    out = ppsplit.compile_model("demo", str(tmp_path / "d"), pp=2)
    assert main(["inspect", out]) == 0
    capsys.readouterr()
    program = os.path.join(out, "stage_1.json")
    with open(program) as f:
        text = f.read()
    with open(program, "w") as f:
        f.write(text.replace('"target": "aten::', '"target": "os::', 1))
    assert main(["inspect", out]) == 2
    assert "stage_1.json: the program calls 'os::" in capsys.readouterr().err


def test_duplicate_aux_ids_are_reported(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="ppsplit"):
        assert ppsplit.SplitOptions(pp=2, aux="2,2,3").taps(8) == (2, 3)
    assert "aux ids 2,2,3 repeat a tap; the aux buffer holds each tap once: 2 slots for taps 2,3" in caplog.text


def _cli(*args, cwd=ROOT, **kw):
    return subprocess.run([sys.executable, "-m", "ppsplit.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, **kw)


def test_version_help_and_broken_pipe():
    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"ppsplit {ppsplit.__version__}"
    done = _cli("plan", "--help")
    assert "(default: no taps)" in " ".join(done.stdout.split())
    # `ppsplit plan demo --json | head -1`: the reader leaves early; no traceback.
    proc = subprocess.Popen(f"{sys.executable} -m ppsplit.cli plan demo --pp 2 --json | head -1", shell=True,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert out.strip() == "{" and "Traceback" not in err and "BrokenPipe" not in err, err


def test_import_from_the_folder_that_holds_a_checkout_named_ppsplit(tmp_path):
    """`git clone ... ppsplit`, then a script in the folder above: `import ppsplit` is the real package."""
    os.symlink(ROOT, tmp_path / "ppsplit")
    done = subprocess.run([sys.executable, "-c", "import ppsplit; print(ppsplit.load.__module__)"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ppsplit.serve.runtime", done.stderr


def test_readme_first_folder_generates_and_drafts(tmp_path, capsys):
    """README's first command writes a folder that generates text right away: a paged cache by default (8 slots of
    the demo's 2048 positions) and the demo's drafter for the eagle3 taps, whose speculative output equals greedy."""
    out = str(tmp_path / "demo-pp4")
    assert main(["compile", "demo", "--pp", "4", "--aux", "eagle3", "-o", out, "--force"]) == 0
    split = ppsplit.load(out)
    assert split.plan.paged and (split.plan.max_batch, split.plan.max_len) == (8, 2048)
    assert split.drafter is not None and split.drafter.taps == (2, 4, 5)
    capsys.readouterr()
    assert main(["generate", out, "--prompt", "Hello there", "--max-new-tokens", "8"]) == 0
    plain = capsys.readouterr().out.splitlines()
    assert main(["generate", out, "--prompt", "Hello there", "--max-new-tokens", "8", "-k", "3"]) == 0
    drafted = capsys.readouterr().out.splitlines()
    assert plain[0] == drafted[0] and "8 tokens in" in plain[1] and "mean acceptance length" in drafted[1]


def test_no_cache_folder_says_how_to_generate(tmp_path, capsys):
    out = str(tmp_path / "plain")
    assert main(["compile", "demo", "--pp", "2", "--no-cache", "-o", out]) == 0
    assert not ppsplit.load(out).plan.max_len
    capsys.readouterr()
    assert main(["generate", out, "--prompt-ids", "1,2,3"]) == 2
    assert "compile it without --no-cache" in capsys.readouterr().err
    assert main(["compile", "demo", "--pp", "2", "--no-cache", "--max-batch", "2", "--max-len", "8", "-o", out]) == 2
    assert "--no-cache gives the stages no cache" in capsys.readouterr().err


def test_default_cache_is_left_out_for_a_model_that_takes_none(caplog):
    """A model whose forward takes no cache compiles without one (logged), as before the default."""
    from ppsplit.compile.writer import default_cache_for

    class NoCache(torch.nn.Module):
        def forward(self, input_ids, position_ids=None):
            return input_ids

    assert default_cache_for(tiny_model("llama")) == CacheConfig(batch_size=8, max_len=tiny_model("llama").config
                                                                 .max_position_embeddings)
    with caplog.at_level("INFO", logger="ppsplit"):
        assert default_cache_for(NoCache()) is None
    assert "no KV cache: NoCache.forward takes no cache" in caplog.text
