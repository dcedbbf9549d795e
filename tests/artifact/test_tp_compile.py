"""``ppsplit compile --tp``: one weights file per (stage, TP rank), each tensor exactly its piece (sha256 against a
slicing of the checkpoint written here, independent of the pass), an FP8 block-scaled checkpoint's scales cut with
their weights; the stored programs, loaded back, run in lockstep equal to Hugging Face. Refused: a piece that
splits a quantisation block; loading a TP folder as if it were not one."""
import hashlib
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit.artifact.folder import CompiledFolder
from ppsplit.cli import main
from ppsplit.core.checked import FolderError
from ppsplit.core.errors import ConfigError
from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment
from ppsplit.passes.sharding.evaluate import run_ranks
from tests.artifact.test_quantized import write_quantized
from tests.support import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
COLUMNS = r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight(_scale_inv)?$|embed_tokens\.weight$|lm_head\.weight$"
ROWS = r"(o_proj|down_proj)\.weight(_scale_inv)?$"


def piece(name: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """A Llama checkpoint tensor as TP rank ``rank`` holds it (vLLM's layout): projections out of the residual
    stream (and the embedding, lm_head) by rows, into it by columns, FP8 block scales as their weights."""
    if re.search(COLUMNS, name):
        return t.chunk(tp, 0)[rank]
    if re.search(ROWS, name):
        return t.chunk(tp, 1)[rank]
    return t


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def check_files(folder: str, checkpoint: str, tp: int) -> int:
    """Every rank file's tensors against the independent slicing of the checkpoint's; returns the pieces checked."""
    stored = load_file(f"{checkpoint}/model.safetensors")
    opened = CompiledFolder(folder)
    checked = 0
    for k in range(opened.plan.pp):
        program = opened.program(k)
        for r in range(tp):
            with safe_open(opened.weights(k, r), framework="pt") as f:
                assert set(f.keys()) == set(program.stored)
                for name in f.keys():
                    got = f.get_tensor(name)
                    if name.endswith("vocab_start"):
                        assert got.tolist() == [r * stored["model.embed_tokens.weight"].shape[0] // tp]
                        continue
                    if name not in stored and name != "lm_head.weight":
                        continue  # computed at init (the rotary table), not in the checkpoint
                    source = name if name in stored else "model.embed_tokens.weight"  # a tied lm_head
                    want = piece(name, stored[source].to(got.dtype), r, tp)
                    assert sha(got) == sha(want), f"stage {k} rank {r}: {name}"
                    checked += 1
    return checked


def lockstep_logits(folder: str, ids: list[int]) -> torch.Tensor:
    """A prefill through the folder's stages, each stage's TP ranks loaded from their files and run in lockstep."""
    opened = CompiledFolder(folder)
    layout = CacheLayout.of(opened.plan)
    step = RaggedStep.build([Segment(0, 0, len(ids))], {0: list(range(layout.blocks_per_seq))}, layout)
    x, aux = torch.tensor(ids), torch.zeros(opened.plan.n_slots, len(ids), opened.plan.hidden_size)
    for k in range(opened.plan.pp):
        ranks = [ppsplit.load_stage(folder, k, tp_rank=r) for r in range(opened.plan.tp)]
        x, aux = run_ranks(ranks, (x, step.positions, aux, *step.tensors()[1:]))[0]
    return x


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp") / "llama"
    model = tiny_model("llama", 4, seed=5)
    model.save_pretrained(folder)
    return str(folder), model


def test_compile_writes_each_ranks_piece(llama, tmp_path, capsys):
    checkpoint, model = llama
    out = str(tmp_path / "llama-pp2-tp2")
    assert main(["compile", checkpoint, "--pp", "2", "--tp", "2", "--aux", "1,3", "--max-batch", "2", "--max-len",
                 "64", "-o", out]) == 0
    assert "pp=2 x tp=2 (4 ranks)" in capsys.readouterr().out
    assert check_files(out, checkpoint, 2) > 20
    manifest = json.load(open(f"{out}/manifest.json"))
    assert [[f["weights"] for f in s["ranks"]] for s in manifest["stages"]] == \
        [[f"stage_{k}.tp{r}.safetensors" for r in range(2)] for k in range(2)]
    ids = [4, 8, 15, 16, 23, 42]
    with torch.no_grad():
        torch.testing.assert_close(lockstep_logits(out, ids), model(torch.tensor([ids])).logits[0], rtol=1e-4,
                                   atol=1e-4)
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "stage_1.tp1.safetensors" in text and "per TP rank" in text and "cut over the TP ranks" in text
    with pytest.raises(FolderError, match="cut for tensor parallelism"):
        ppsplit.load(out)
    with pytest.raises(FolderError, match="tp_rank=r"):
        ppsplit.load_stage(out, 0)


def test_plan_prints_the_layout(llama, capsys):
    assert main(["plan", llama[0], "--pp", "2", "--tp", "4", "--max-batch", "2", "--max-len", "64"]) == 0
    text = capsys.readouterr().out
    assert "pp=2 x tp=4 (8 ranks)" in text and text.count("all-reduce") == 2 and "1 all-gather" in text


def test_fp8_scales_cut_with_their_weights(tmp_path):
    """Blocks of 64: every piece at tp=2 holds whole blocks (k_proj's 128 rows in two 64-row pieces)."""
    checkpoint = write_quantized(tmp_path / "fp8-64", "fp8", block=64)
    out = ppsplit.compile_model(str(checkpoint), str(tmp_path / "fp8-tp2"), pp=1, tp=2,
                                cache=ppsplit.CacheConfig(2, 64))
    assert check_files(out, str(checkpoint), 2) > 20
    program = CompiledFolder(out).program(0)
    assert program.stored["model.layers.0.self_attn.k_proj.weight"].dtype == "float8_e4m3fn"
    assert tuple(program.stored["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape) == (1, 4)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = [3, 9, 27, 14, 41]
    with torch.no_grad():
        torch.testing.assert_close(lockstep_logits(out, ids), hf(torch.tensor([ids])).logits[0], rtol=2e-3,
                                   atol=2e-3)


def test_a_piece_that_splits_a_block_is_refused(tmp_path):
    checkpoint = write_quantized(tmp_path / "fp8-128", "fp8", block=128)
    with pytest.raises(ConfigError, match=r"--tp 2: .*k_proj\.weight has quantisation blocks of 128 along dim 0, and "
                                          r"a piece of 64 splits one; the TP sizes whose pieces hold whole blocks: 1$"):
        ppsplit.compile_model(str(checkpoint), str(tmp_path / "out"), pp=1, tp=2, cache=ppsplit.CacheConfig(2, 64))
    assert not (tmp_path / "out").exists()
