"""The MTP layer of a block-FP8 checkpoint (DeepSeek-V3/R1 ship theirs so): its decoder block's linears stay FP8
with their scales, as stored, through the FP8 pass the target's stages go through, in ``load_mtp`` and in a folder
compiled with ``--mtp``.

The checkpoint is the tiny DeepSeek-V3 with an MTP layer of ``tests/eagle3/test_mtp.py``, its projections quantised
in 16 x 16 blocks by the FP8 tests' own quantiser (``tests/artifact/test_quantized.py``), ``eh_proj`` and the MTP
layer's head left in float as DeepSeek-V3 ships them. The reference is ``test_mtp``'s (the DeepSeek-V3 report and
vLLM's ``deepseek_mtp.py``) over weights dequantised in fp64, one block at a time, as vLLM's block-FP8 linear
dequantises them: the target loaded by transformers from the FP8 checkpoint, the block by transformers from the
dequantised tensors.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit import ConfigError
from ppsplit.cli import main
from ppsplit.core.ragged import RaggedStep, Segment
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams
from tests.artifact.test_quantized import FP8, quantize_blocks, reference_dequant
from tests.eagle3.test_mtp import L, V, build, reference

BLOCK = 16
# MLA parts in whole 16-blocks (each block one head's key or value rows, as DeepSeek-V3's 128-blocks are), so the
# paged latent attention reads kv_b_proj as stored too (tests/artifact/test_quantized.py: mla_config); a rope of 32
# makes kv_a_proj_with_mqa's 64 rows two whole blocks a TP rank
MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16)
PREFIX = f"model.layers.{L}."


def quantize(folder, block=BLOCK, channel=False):
    """Every projection of the checkpoint (the target's layers and the MTP layer's block) as block FP8 with a
    ``weight_scale_inv`` beside it, as DeepSeek-V3 ships them (``channel``: compressed-tensors FP8, one
    ``weight_scale`` per output row); the MTP layer's ``eh_proj`` and head stay float."""
    path = os.path.join(folder, "model.safetensors")
    out = {}
    for name, w in load_file(path).items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.endswith(".weight") and "proj" in module and module != "eh_proj" and w.dim() == 2:
            if channel:
                q, scale = quantize_blocks(w, 1, w.shape[1])
                out[name], out[name[:-len("weight")] + "weight_scale"] = q, scale.reshape(-1, 1)
            else:
                out[name], out[name[:-len("weight")] + "weight_scale_inv"] = quantize_blocks(w, block, block)
        else:
            out[name] = w
    save_file(out, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    if channel:
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                      "quantization_status": "compressed", "config_groups": {"group_0": {
                                          "targets": ["Linear"], "weights": weights, "input_activations": None}},
                                      "ignore": ["lm_head"], "kv_cache_scheme": None}
    else:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": [block, block]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def dequantised_block(block, stored: dict, linears: int):
    """``block`` (the one-layer model holding the MTP block) with each of its ``linears`` weights the checkpoint
    stores in FP8 replaced by its fp64 dequantisation (``reference_dequant``: per block, or per row for a
    ``weight_scale``), loaded by transformers' own conversions."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        block.save_pretrained(tmp)
        path = os.path.join(tmp, "model.safetensors")
        tensors = load_file(path)
        swapped = 0
        for name in tensors:
            key = PREFIX + name[len("model.layers.0."):]
            if name.startswith("model.layers.0.") and stored.get(key) is not None and stored[key].dtype == FP8:
                base, (n, k) = key[:-len("weight")], stored[key].shape
                blocks = (BLOCK, BLOCK) if base + "weight_scale_inv" in stored else (1, k)
                scale = stored.get(base + "weight_scale_inv", stored.get(base + "weight_scale"))
                tensors[name] = reference_dequant(stored[key], scale, *blocks).float()
                swapped += 1
        assert swapped == linears
        save_file(tensors, path, metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def chain_logits(split, drafter, ids, chain):
    """The draft logits of a prefill of ``ids`` and of each chained step after it (``test_mtp``'s order)."""
    T = ids.shape[0]
    step = RaggedStep.build([Segment(0, 0, T)], {0: [0]}, split.layout)
    _, aux = split.step(ids, step)
    logits, hidden = drafter(aux[:, None], torch.cat([ids[1:], torch.tensor([chain[0]])])[None], step)
    rows = [logits[0]]
    for j, token in enumerate(chain[1:]):
        one = RaggedStep.build([Segment(0, T + j, 1)], {0: [0]}, split.layout)
        logits, hidden = drafter(hidden[:, -1:], torch.tensor([[token]]), one)
        rows.append(logits[0])
    return torch.cat(rows)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(transformers' FP8 target, reference block, own tensors, FP8 checkpoint, its stored tensors, a folder compiled
    from it with --pp 2 --mtp)."""
    root = tmp_path_factory.mktemp("fp8")
    _, block, own, folder, _ = build(root / "ckpt", **MLA)
    stored = quantize(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # dequantises on the CPU
    out = str(root / "pp2")
    assert main(["compile", folder, "--pp", "2", "--mtp", "-o", out, "--max-batch", "8", "--max-len", "64"]) == 0
    # 5 attention projections, 3 shared-expert linears, 3 per routed expert
    return target, dequantised_block(block, stored, 5 + 3 + 3 * 4), own, folder, stored, out


def _fp8_names(module, layer: str) -> set[str]:
    """The FP8 tensors of decoder layer ``layer`` (``model.layers.{i}.``) in ``module``, without that prefix."""
    return {n[len(layer):] for n, t in [*module.named_parameters(), *module.named_buffers()]
            if n.startswith(layer) and t.dtype == FP8}


def test_fp8_mtp_layer_is_kept_as_stored_and_drafts_as_the_reference(fp8):
    """``load_mtp`` over the FP8 folder's split and the drafter the folder stores: the block holds the same FP8
    weights as the target's MoE layer does (through the same pass), the stored block holds the checkpoint's FP8
    bytes and scales, and the draft logits of a prefill and two chain steps equal the dequantised reference."""
    target, block, own, folder, stored, out = fp8
    split = ppsplit.load(out)
    assert split.drafter.family == "mtp"
    loaded = ppsplit.load_mtp(folder, split=split)
    last = f"model.layers.{L - 1}."  # the target's last layer: MoE, as the MTP layer is
    kept = _fp8_names(split.stages[-1], last)
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.kv_b_proj.weight",
            "self_attn.q_a_proj.weight"} <= kept, kept
    assert json.load(open(os.path.join(out, "manifest.json")))["quantization"]["dequantized"] == [0, 0]
    for drafter in (loaded, split.drafter):
        assert _fp8_names(drafter.block, "model.layers.1.") == kept
        assert drafter.eh_proj.weight.dtype == torch.float32
    files = load_file(os.path.join(out, "mtp", "block.safetensors"))
    for name in ("self_attn.q_a_proj.weight", "self_attn.kv_b_proj.weight", "mlp.shared_experts.down_proj.weight"):
        assert files["model.layers.1." + name].dtype == FP8
        assert torch.equal(files["model.layers.1." + name].view(torch.uint8), stored[PREFIX + name].view(torch.uint8))
        scale = name[:-len("weight")] + "weight_scale_inv"
        assert torch.equal(files["model.layers.1." + scale], stored[PREFIX + scale])
    expert = files["model.layers.1.mlp.experts.down_proj"]
    assert expert.dtype == FP8 and torch.equal(expert[2].view(torch.uint8),
                                               stored[PREFIX + "mlp.experts.2.down_proj.weight"].view(torch.uint8))

    torch.manual_seed(7)
    ids = torch.randint(3, V, (11,))
    chain = (9, 21, 30)  # the token after ids, then two drafts
    ref = reference(target, block, own, ids, chain)
    got = {which: chain_logits(split, drafter, ids, chain) for which, drafter in (("load_mtp", loaded),
                                                                                   ("folder", split.drafter))}
    for logits in got.values():
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["folder"], got["load_mtp"], rtol=1e-5, atol=1e-5)


def test_a_tampered_fp8_mtp_block_is_refused(fp8, tmp_path, capsys):
    """``mtp/block.json`` is checked as a stage program is: an FP8 weight fed to a plain linear is one line from
    ``inspect`` and ``load``."""
    import shutil

    out = str(tmp_path / "f")
    shutil.copytree(fp8[5], out)
    capsys.readouterr()
    assert main(["inspect", out]) == 0
    where = os.path.join(out, "mtp", "block.json")
    program = json.load(open(where))
    node = next(n for n in program["program"]["nodes"] if n.get("target") == "ppsplit::fp8_linear.default")
    node["target"], node["args"] = "aten::linear.default", node["args"][:2]
    json.dump(program, open(where, "w"))
    capsys.readouterr()
    assert main(["inspect", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "read by something other than ppsplit's FP8 ops" in err and "mtp" in err and len(err.splitlines()) == 1, err
    with pytest.raises(ConfigError, match="read by something other than ppsplit's FP8 ops"):
        ppsplit.load(out)


def test_compressed_tensors_glm_mtp_layer_stays_fp8(tmp_path):
    """GLM-4.5 (GQA with biases, MoE) in compressed-tensors FP8, one scale per output row: the MTP block keeps the
    FP8 weights the target's MoE layer keeps, and the drafts of ``load_mtp`` and of the ``--mtp`` folder equal the
    reference over the dequantised weights."""
    _, block, own, folder, _ = build(tmp_path / "ckpt", arch="glm4_moe")
    stored = quantize(folder, channel=True)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = str(tmp_path / "pp2")
    assert main(["compile", folder, "--pp", "2", "--mtp", "-o", out, "--max-batch", "8", "--max-len", "64"]) == 0
    split = ppsplit.load(out)
    loaded = ppsplit.load_mtp(folder, split=split)
    kept = _fp8_names(split.stages[-1], f"model.layers.{L - 1}.")
    assert {"mlp.experts.gate_up_proj", "self_attn.q_proj.weight", "mlp.shared_experts.up_proj.weight"} <= kept
    for drafter in (loaded, split.drafter):
        assert _fp8_names(drafter.block, "model.layers.1.") == kept
    ids = torch.randint(3, V, (9,), generator=torch.Generator().manual_seed(3))
    chain = (5, 17, 26)
    # 4 attention projections, 3 shared-expert linears, 3 per routed expert
    ref = reference(target, dequantised_block(block, stored, 4 + 3 + 3 * 4), own, ids, chain)
    for drafter in (loaded, split.drafter):
        torch.testing.assert_close(chain_logits(split, drafter, ids, chain), ref, rtol=1e-4, atol=1e-4)


def test_fp8_mtp_output_equals_greedy_at_pp2(fp8):
    """Three requests of different lengths, K = 2 and 3, the FP8 folder's own MTP layer and ``load_mtp``'s: the
    output equals transformers' greedy decoding of the FP8 checkpoint, and the two drafters draft alike."""
    target, _, _, folder, _, out = fp8
    split = ppsplit.load(out)
    loaded = ppsplit.load_mtp(folder, split=split)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, V, (n,), generator=gen).tolist() for n in (4, 9, 13)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for k in (2, 3):
        outs = Engine(split, drafter=split.drafter, num_draft_tokens=k).generate(prompts, params)
        again = Engine(split, drafter=loaded, num_draft_tokens=k).generate(prompts, params)
        for prompt, got, expected in zip(prompts, outs, again):
            with torch.no_grad():
                greedy = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                         eos_token_id=None)[0, len(prompt):].tolist()
            assert got.token_ids == greedy == expected.token_ids
            assert got.drafts == expected.drafts and got.accepted == expected.accepted


def test_an_fp8_eh_proj_is_dequantised_and_mxfp4_is_refused(fp8, tmp_path, capsys):
    """Some checkpoints store the MTP layer's own ``eh_proj`` in FP8 too (DeepSeek-V3 ships it in BF16): the drafter
    holds it dequantised with its scale (it runs outside the block, as a float linear), in ``load_mtp`` and in the
    folder ``--mtp`` writes. An MXFP4 checkpoint is refused in one line, nothing written."""
    _, _, _, folder, stored, out = fp8
    quantised, mxfp4 = tmp_path / "eh", tmp_path / "mxfp4"
    os.makedirs(quantised)
    os.symlink(os.path.join(folder, "config.json"), quantised / "config.json")
    tensors = dict(stored)
    name = PREFIX + "eh_proj.weight"
    q, scale = quantize_blocks(stored[name], BLOCK, BLOCK)
    tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = q, scale
    save_file(tensors, quantised / "model.safetensors", metadata={"format": "pt"})
    want = reference_dequant(q, scale, BLOCK, BLOCK).float()
    drafter = ppsplit.load_mtp(str(quantised), split=ppsplit.load(out))
    torch.testing.assert_close(drafter.eh_proj.weight, want, rtol=0, atol=0)
    assert main(["compile", str(quantised), "--pp", "2", "--mtp", "-o", str(tmp_path / "eh-pp2"), "--max-batch", "8",
                 "--max-len", "64"]) == 0
    own = load_file(tmp_path / "eh-pp2" / "mtp" / "drafter.safetensors")
    assert torch.equal(own["eh_proj.weight"], want)

    os.makedirs(mxfp4)
    os.symlink(os.path.join(folder, "model.safetensors"), mxfp4 / "model.safetensors")
    cfg = json.load(open(os.path.join(folder, "config.json")))
    (mxfp4 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    capsys.readouterr()
    assert main(["compile", str(mxfp4), "--pp", "2", "--mtp", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "MTP layers of an MXFP4 checkpoint are not supported" in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(ConfigError, match="MXFP4"):
        ppsplit.load_mtp(str(mxfp4), split=ppsplit.load(out))


def test_fp8_mtp_folder_cut_for_tensor_parallelism(fp8, tmp_path_factory, capfd):
    """``compile --pp 2 --tp 2 --mtp`` of the FP8 checkpoint: the stages (FP8 blocks and scales) are cut over two TP
    ranks, the MTP block is stored whole (no collective in its program) and runs on the last stage's TP rank 0,
    beside the pipeline, as an EAGLE-3 drafter does. On 4 gloo ranks every output equals transformers' greedy one,
    and each request's drafts and acceptance equal the in-process engine's over the folder compiled without
    ``--tp``; ``ppsplit run DIR -k 3`` prints the same."""
    from tests.processes import launch, tp_generate

    target, _, _, folder, _, whole = fp8
    cut = str(tmp_path_factory.mktemp("tp") / "tp2")
    assert main(["compile", folder, "--pp", "2", "--tp", "2", "--mtp", "-o", cut, "--max-batch", "8", "--max-len",
                 "64"]) == 0
    stage = json.load(open(os.path.join(cut, "stage_1.json")))["program"]["nodes"]
    block = json.load(open(os.path.join(cut, "mtp", "block.json")))["program"]["nodes"]
    assert any("all_reduce" in str(n.get("target")) for n in stage)
    assert not any("all_reduce" in str(n.get("target")) or "all_gather" in str(n.get("target")) for n in block)
    stored, alone = (load_file(os.path.join(f, "mtp", "block.safetensors")) for f in (cut, whole))
    assert stored.keys() == alone.keys() and all(torch.equal(stored[n].view(torch.uint8), alone[n].view(torch.uint8))
                                                 for n in stored if stored[n].dtype == FP8)
    assert main(["inspect", cut]) == 0
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, V, (n,), generator=gen).tolist() for n in (3, 7, 12)]
    new, k = 10, 3
    res = launch(4, tp_generate, cut, prompts, new, k, True, deadline=600, timeout=120)
    assert all(res[r][0] == "ok" for r in range(4)), {r: res[r][:3] for r in range(4)}
    single = ppsplit.load(whole)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    ref = Engine(single, drafter=single.drafter, num_draft_tokens=k).generate(prompts, params)
    for prompt, (tokens, accepted, drafts), expected in zip(prompts, res[0][1], ref):
        with torch.no_grad():
            greedy = target.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                     eos_token_id=None)[0, len(prompt):]
        assert tokens == greedy.tolist() == expected.token_ids
        assert len(drafts) >= 3 and (accepted, drafts) == (expected.accepted, expected.drafts)
    # ppsplit run starts the 4 ranks itself (torch's elastic launcher): the same tokens and acceptance
    capfd.readouterr()
    code = main(["run", cut, "--prompt-ids", ",".join(map(str, prompts[1])), "--max-new-tokens", str(new),
                 "--ignore-eos", "-k", str(k), "--timeout", "60"])
    printed, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    assert printed.splitlines()[0] == ",".join(map(str, ref[1].token_ids)), printed
    assert f"K={k}, mean acceptance length {ref[1].mean_acceptance_length:.2f}" in printed, printed
