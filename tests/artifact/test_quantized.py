"""FP8 checkpoints (block-scaled ``quant_method: "fp8"`` and compressed-tensors FP8): compile keeps the FP8 bytes,
load runs them, and the logits equal transformers' own loading of the same checkpoint; bad input is refused."""
import hashlib
import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Mxfp4Config

import ppsplit
from ppsplit.cli import main
from ppsplit.core.checked import FolderError
from ppsplit.core.fx_utils import get_tensor
from ppsplit.triton_kernels.fp8 import fp8_linear

FP8 = torch.float8_e4m3fn
ops = torch.ops.ppsplit
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_blocks(w: torch.Tensor, bn: int, bk: int, power_of_two: bool = False):
    """An independent block quantiser: one fp32 scale per [bn, bk] block (a last block may be partial), amax/448,
    or with ``power_of_two`` the least power of two at least that (``scale_fmt: "ue8m0"``)."""
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float32)
    q = torch.empty(n, k, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].double()
            s = float(block.abs().max()) / 448.0 or 1.0
            s = 2.0 ** math.ceil(math.log2(s)) if power_of_two else s
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / s).float().to(FP8)
    return q, scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """fp64, one element at a time over the blocks: W[n, k] = fp8(W_q[n, k]) * scale[n // bn, k // bk]."""
    n, k = q.shape
    s = scale.double().reshape(-(-n // bn), -(-k // bk))
    rows = torch.arange(n)[:, None] // bn
    cols = torch.arange(k)[None, :] // bk
    return q.double() * s[rows, cols]


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                      eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def write_quantized(folder, scheme: str, model=None, power_of_two: bool = False, block: int = 128):
    """The tiny model saved, then its linear weights quantised as ``scheme`` writes them: "fp8" (``block`` x
    ``block`` blocks, weight_scale_inv; ``power_of_two`` scales), "fp8-tensor" (no ``weight_block_size``: a 0-d
    weight_scale_inv per weight, as transformers saves a per-tensor FP8 model), "ct-channel" / "ct-tensor"
    (compressed-tensors float-quantized, weight_scale)."""
    model = model or _tiny()
    model.save_pretrained(folder, safe_serialization=True)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if not (name.endswith(".weight") and "proj" in name.rsplit(".", 2)[-2] and w.dim() == 2):
            out[name] = w
            continue
        n, k = w.shape
        if scheme == "fp8":
            out[name], out[name[:-6] + "weight_scale_inv"] = quantize_blocks(w, block, block, power_of_two)
        elif scheme == "fp8-tensor":
            q, s = quantize_blocks(w, n, k)
            out[name], out[name[:-6] + "weight_scale_inv"] = q, s.reshape(())
        else:
            q, s = quantize_blocks(w, 1, k) if scheme == "ct-channel" else quantize_blocks(w, n, k)
            out[name], out[name[:-6] + "weight_scale"] = q, s.reshape(n, 1) if scheme == "ct-channel" else s.reshape(1)
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(folder, "config.json")))
    if scheme.startswith("fp8"):
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": [block, block] if scheme == "fp8" else None}
    else:
        weights = {"num_bits": 8, "type": "float", "strategy": scheme[3:], "symmetric": True, "dynamic": False,
                   "observer": "minmax"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    return folder


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return write_quantized(tmp_path_factory.mktemp("fp8") / "tiny-fp8", "fp8")


@pytest.fixture(scope="module")
def hf_fp8(fp8_checkpoint):
    return AutoModelForCausalLM.from_pretrained(fp8_checkpoint, dtype=torch.float32).eval()  # dequantises on the CPU


def _greedy(step, ids, new):
    for _ in range(new):
        ids = torch.cat([ids, step(ids)[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_fp8_compile_load_equals_hf(fp8_checkpoint, hf_fp8, pp, tmp_path, capsys):
    out = tmp_path / f"fp8-pp{pp}"
    assert main(["compile", str(fp8_checkpoint), "--pp", str(pp), "-o", str(out)]) == 0
    split = ppsplit.load(str(out))
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(pp))
    with torch.no_grad():
        ref = hf_fp8(ids).logits
        got = split(ids)[0]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(_greedy(lambda x: split(x)[0], ids, 4), _greedy(lambda x: hf_fp8(x).logits, ids, 4))
    # Structure: every linear runs on its FP8 weight; nothing was dequantised.
    fp8_calls = sum(n.target is torch.ops.ppsplit.fp8_linear.default for s in split.stages for n in s.graph.nodes)
    assert fp8_calls == 3 * len(LINEARS)
    assert not any(n.target is torch.ops.aten.linear.default and "lm_head" not in str(n.args[1])
                   for s in split.stages for n in s.graph.nodes)
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["quantization"]["method"] == "fp8" and manifest["quantization"]["block"] == [128, 128]
    assert sum(manifest["quantization"]["linears"]) == 21 and sum(manifest["quantization"]["dequantized"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "quantized: fp8 float8_e4m3fn weights, 128x128 blocks" in capsys.readouterr().out


def _tensor_hashes(path):
    with safe_open(path, framework="pt") as f:
        return {k: hashlib.sha256(f.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for k in f.keys()}


def test_stage_files_hold_the_fp8_bytes_and_half_the_bf16_size(fp8_checkpoint, tmp_path):
    source = _tensor_hashes(fp8_checkpoint / "model.safetensors")
    fp8_out, bf16_out, bf16_ckpt = tmp_path / "fp8", tmp_path / "bf16", tmp_path / "ckpt-bf16"
    model = _tiny()
    model.to(torch.bfloat16).save_pretrained(bf16_ckpt)
    assert main(["compile", str(fp8_checkpoint), "--pp", "2", "--dtype", "bf16", "-o", str(fp8_out)]) == 0
    assert main(["compile", str(bf16_ckpt), "--pp", "2", "-o", str(bf16_out)]) == 0
    stored = 0
    for k in range(2):
        hashes = _tensor_hashes(fp8_out / f"stage_{k}.safetensors")
        for name, digest in hashes.items():
            if name.endswith(("weight_scale_inv", "proj.weight")):
                assert digest == source[name], name  # FP8 weights and scales byte for byte
                stored += 1
    assert stored == 2 * 3 * len(LINEARS)
    plan = json.load(open(fp8_out / "plan.json"))
    for k in range(2):  # the plan counts the weights as stored (what balance="memory" sees)
        file_bytes = os.path.getsize(fp8_out / f"stage_{k}.safetensors")
        assert 0.97 * file_bytes < plan["stages"][k]["bytes"] <= file_bytes, (k, plan["stages"][k]["bytes"], file_bytes)
    size = lambda d: sum(os.path.getsize(d / f"stage_{k}.safetensors") for k in range(2))  # noqa: E731
    ratio = size(fp8_out) / size(bf16_out)
    assert 0.45 < ratio < 0.55, ratio


def write_ue8m0(folder, stored: str, model=None, block: int = 128):
    """The model's linears quantised in ``block`` x ``block`` blocks with power-of-two scales (``scale_fmt:
    "ue8m0"``, as DeepSeek-V3.1 ships them), each scale stored as ``stored``: "F32" (its value), "U8" (its E8M0
    exponent byte, as transformers' MXFP8 checkpoints store it) or "F8_E8M0"."""
    write_quantized(folder, "fp8", model or _tiny(seed=2), power_of_two=True, block=block)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv") and stored != "F32":
            byte = (t.log2() + 127).to(torch.uint8)
            tensors[name] = byte if stored == "U8" else byte.view(torch.float8_e8m0fnu)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(folder, "config.json")))
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    return folder


@pytest.mark.parametrize("stored", ["F32", "U8", "F8_E8M0"])
def test_ue8m0_scales_compile_and_equal_hf(stored, tmp_path, capsys):
    """Power-of-two block scales (``scale_fmt: "ue8m0"``) stored as values or as E8M0 exponents: the FP8 weights
    stay byte for byte, the scales are kept as fp32 values (exact), and the logits equal transformers' own loading
    of the checkpoint."""
    ckpt = write_ue8m0(tmp_path / stored, stored)
    out = tmp_path / f"out-{stored}"
    assert main(["compile", str(ckpt), "--pp", "2", "-o", str(out)]) == 0
    source = load_file(ckpt / "model.safetensors")
    stage = {**load_file(out / "stage_0.safetensors"), **load_file(out / "stage_1.safetensors")}
    name = "model.layers.1.mlp.down_proj"
    assert stage[f"{name}.weight"].dtype == FP8
    assert torch.equal(stage[f"{name}.weight"].view(torch.uint8), source[f"{name}.weight"].view(torch.uint8))
    scale = stage[f"{name}.weight_scale_inv"]
    exponent = source[f"{name}.weight_scale_inv"]
    expected = exponent if stored == "F32" else (exponent.view(torch.uint8).double() - 127).exp2().float()
    assert scale.dtype == torch.float32 and torch.equal(scale, expected)
    split = ppsplit.load(str(out))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], hf(ids).logits, atol=1e-5, rtol=1e-5)
    plan = json.load(open(out / "plan.json"))
    for k in range(2):  # the plan counts the fp32 scales the folder holds
        file_bytes = os.path.getsize(out / f"stage_{k}.safetensors")
        assert 0.97 * file_bytes < plan["stages"][k]["bytes"] <= file_bytes, (k, plan["stages"][k]["bytes"], file_bytes)


def test_scale_formats_transformers_writes_are_read():
    """``scale_fmt`` as checkpoints carry it: absent, "float" (what transformers 5.x writes by default), "ue8m0"."""
    from types import SimpleNamespace

    from ppsplit.compile.quantized import read_scheme

    for fmt, exponents in ((None, False), ("float", False), ("fp32", False), ("ue8m0", True)):
        quant = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
        config = SimpleNamespace(quantization_config={**quant, **({"scale_fmt": fmt} if fmt else {})})
        scheme = read_scheme(config, "m")
        assert (scheme.block, scheme.exponents) == ((128, 128), exponents), fmt


def test_exponent_scales_need_scale_fmt_ue8m0(tmp_path, capsys):
    """E8M0 exponents without ``scale_fmt: "ue8m0"`` would be read as numbers: refused in one line, nothing written."""
    ckpt = write_ue8m0(tmp_path / "ckpt", "U8")
    config = json.load(open(ckpt / "config.json"))
    del config["quantization_config"]["scale_fmt"]
    json.dump(config, open(ckpt / "config.json", "w"))
    code, err = _run(["compile", str(ckpt), "--pp", "2", "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1 and "E8M0 exponents need scale_fmt 'ue8m0'" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["ct-channel", "ct-tensor"])
def test_compressed_tensors_fp8_equals_hf(scheme, tmp_path):
    ckpt = write_quantized(tmp_path / scheme, scheme, _tiny(seed=1))
    out = tmp_path / f"{scheme}-pp2"
    assert main(["compile", str(ckpt), "--pp", "2", "-o", str(out)]) == 0
    split = ppsplit.load(str(out))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], hf(ids).logits, atol=1e-5, rtol=1e-5)
    source = _tensor_hashes(ckpt / "model.safetensors")
    for k in range(2):
        for name, digest in _tensor_hashes(out / f"stage_{k}.safetensors").items():
            if name.endswith(("weight_scale", "proj.weight")):
                assert digest == source[name], name
    assert json.load(open(out / "manifest.json"))["quantization"]["scheme"] == scheme[3:]


@pytest.mark.parametrize("n,k,bn,bk", [(200, 300, 128, 128), (128, 256, 128, 128), (7, 33, 1, 33), (7, 33, 7, 33),
                                       (130, 129, 64, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_linear_equals_fp64_reference(n, k, bn, bk, dtype):
    torch.manual_seed(n + k)
    q, scale = quantize_blocks(torch.randn(n, k), bn, bk)
    x = torch.randn(3, 5, k)
    bias = torch.randn(n)
    ref = x.double() @ reference_dequant(q, scale, bn, bk).T + bias.double()
    got = fp8_linear(x.to(dtype), q, scale.reshape(-1) if bn == n else scale, bias.to(dtype), bn, bk)
    tol = {torch.float32: 1e-5, torch.float16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), ref, atol=tol * math.sqrt(k), rtol=tol)


def _run(args, capsys):
    capsys.readouterr()
    code = main(args)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    return code, err


@pytest.mark.parametrize("case", ["gptq", "static", "scale_fmt", "bad_scale", "ct_group", "no_config"])
def test_unsupported_or_inconsistent_checkpoints_are_refused(case, fp8_checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    for f in os.listdir(fp8_checkpoint):
        os.symlink(fp8_checkpoint / f, ckpt / f) if f != "config.json" else None
    config = json.load(open(fp8_checkpoint / "config.json"))
    quant = config["quantization_config"]
    expect = {"gptq": "quant_method 'gptq'", "static": "activation_scheme 'static'", "scale_fmt": "scale_fmt 'ue4m3'",
              "bad_scale": "model.layers.1.mlp.down_proj.weight_scale_inv has shape (3, 2)",
              "ct_group": "compressed-tensors group 'group_0' weight strategy 'group'",
              "no_config": "in F8_E4M3, but its config.json has no quantization_config"}[case]
    if case == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    elif case == "no_config":
        del config["quantization_config"]
    elif case == "static":
        quant["activation_scheme"] = "static"
    elif case == "scale_fmt":
        quant["scale_fmt"] = "ue4m3"
    elif case == "ct_group":
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                         "config_groups": {"group_0": {"weights": {
                                             "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}}
    else:
        os.remove(ckpt / "model.safetensors")
        tensors = load_file(fp8_checkpoint / "model.safetensors")
        name = "model.layers.1.mlp.down_proj.weight_scale_inv"
        tensors[name] = torch.ones(3, 2)  # down_proj [256, 384] in 128x128 blocks needs [2, 3]
        save_file(tensors, ckpt / "model.safetensors")
    json.dump(config, open(ckpt / "config.json", "w"))
    out = tmp_path / "out"
    code, err = _run(["compile", str(ckpt), "--pp", "2", "-o", str(out)], capsys)
    assert code == 2 and len(err) == 1 and expect in err[0], err
    assert not out.exists() and not [e for e in os.listdir(tmp_path) if e.startswith(".out")]
    if case in ("gptq", "static"):
        assert "supported" in err[0] and "block-scaled FP8" in err[0]


@pytest.fixture(scope="module")
def fp8_folder(fp8_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8out") / "fp8-pp2"
    assert main(["compile", str(fp8_checkpoint), "--pp", "2", "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("case", ["scale_shape", "scale_dtype", "method", "fp8_elsewhere", "no_record"])
def test_tampered_quantized_folder_is_one_folder_error(case, fp8_folder, tmp_path, capsys):
    folder = tmp_path / "f"
    os.makedirs(folder)
    for f in os.listdir(fp8_folder):  # hard links: a compiled folder's files are its own (links leading out are refused)
        os.link(fp8_folder / f, folder / f) if f not in ("stage_0.json", "manifest.json") else None
    program = json.load(open(fp8_folder / "stage_0.json"))
    manifest = json.load(open(fp8_folder / "manifest.json"))
    if case == "scale_shape":
        spec = next(t for t in program["tensors"] if t["name"].endswith("q_proj.weight_scale_inv"))
        spec["shape"] = [3, 2]
        expect = "needs 4 values"
    elif case == "scale_dtype":
        spec = next(t for t in program["tensors"] if t["name"].endswith("k_proj.weight_scale_inv"))
        spec["dtype"] = "int8"
        expect = "k_proj.weight_scale_inv (int8) one of float32"
    elif case == "method":
        manifest["quantization"]["method"] = "awq"
        expect = "'awq'"
    elif case == "no_record":
        manifest["quantization"] = None
        expect = "records no quantization"
    else:  # an FP8 weight fed to a plain linear
        node = next(n for n in program["program"]["nodes"] if n.get("target") == "ppsplit::fp8_linear.default")
        node["target"] = "aten::linear.default"
        node["args"] = node["args"][:2]
        expect = "read by something other than ppsplit's FP8 ops"
    json.dump(program, open(folder / "stage_0.json", "w"))
    json.dump(manifest, open(folder / "manifest.json", "w"))
    code, err = _run(["inspect", str(folder)], capsys)
    assert code == 2 and len(err) == 1 and expect in err[0], err
    with pytest.raises(FolderError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        ppsplit.load(str(folder))


def _stacked_experts(source: dict, layer: int, parts: tuple[str, ...], suffix: str) -> torch.Tensor:
    """What transformers' conversion makes of the per-expert tensors ``experts.{e}.{part}.{suffix}``: each expert's
    parts concatenated along dim 0, the experts stacked (an independent restatement, for checking the files)."""
    prefix = f"model.layers.{layer}.mlp.experts."
    count = len({k.split(".")[5] for k in source if k.startswith(prefix)})
    return torch.stack([torch.cat([torch.atleast_1d(source[f"{prefix}{e}.{part}.{suffix}"]) for part in parts])
                        for e in range(count)])


@pytest.mark.parametrize("arch,dtype,scheme", [("qwen3_moe", "float32", "fp8"), ("qwen3_moe", "bfloat16", "fp8"),
                                               ("qwen3_moe", "float32", "ct-channel"),
                                               ("qwen3_moe", "bfloat16", "ct-tensor"),
                                               ("qwen3_moe", "float32", "ct-tensor"),
                                               ("qwen3_moe", "float32", "fp8-tensor"),
                                               ("deepseek_v3", "float32", "ue8m0")])
def test_fp8_moe_experts_stay_fp8_through_the_conversions(arch, dtype, scheme, tmp_path, capsys):
    """qwen3_moe and deepseek_v3 (MLA projections, shared experts; E8M0 exponent-byte scales in 8-blocks) with
    per-expert FP8 tensors in whole blocks (32-blocks, or compressed-tensors' per-channel or per-tensor scales, or
    transformers' own per-tensor layout with 0-d scales: a stack of per-tensor gate and up weights is two blocks an
    expert, each of one weight): transformers' converters
    stack the FP8 experts as stored and their scales alike (experts.gate_up_proj_scale_inv, or _scale), and the
    stages run them on ppsplit's FP8 expert ops: the grouped product a bfloat16 compile traces, the per-token expert
    weights a float32 one traces. The stage files hold the checkpoint's FP8 bytes, the plan counts them, and
    the logits equal transformers' own loading of the checkpoint (in bfloat16: its float32 loading cast to
    bfloat16, whose weights are bit-equal to the dequantised experts)."""
    from tests.architectures.test_moe_compile import moe_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(arch)).eval()
    ckpt = write_ue8m0(tmp_path / "moe", "U8", model, block=8) if scheme == "ue8m0" else \
        write_quantized(tmp_path / "moe", scheme, model, block=32)
    suffix = "weight_scale" if scheme.startswith("ct-") else "weight_scale_inv"
    out = tmp_path / "moe-pp2"
    assert main(["compile", str(ckpt), "--pp", "2", "-o", str(out), "--dtype", dtype]) == 0
    quant = json.load(open(out / "manifest.json"))["quantization"]
    # deepseek_v3's kv_b_proj, read by the MLA attention, in 8-blocks leaves its 16-wide latent dimension no
    # 16-wide tile inside a block: the one tensor dequantised per layer (test_fp8_mla_weight_stays_fp8_... has
    # blocks that the FP8 MLA path reads)
    assert quant["dequantized"] == ([0, 0] if arch == "qwen3_moe" else [2, 2]), quant
    # a layer: 4 attention linears (deepseek_v3: q_a, q_b, kv_a, o) + the 2 expert stacks (+ 3 shared-expert
    # linears); deepseek_v3's layer 0 is dense (3 MLP linears)
    assert quant["linears"] == ([12, 12] if arch == "qwen3_moe" else [7 + 9, 9 + 9]), quant

    source = load_file(ckpt / "model.safetensors")
    stages = [load_file(out / f"stage_{k}.safetensors") for k in range(2)]
    stage = {**stages[0], **stages[1]}
    expert_bytes = 0
    for name, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        weight = stage[f"model.layers.3.mlp.experts.{name}"]
        scale = stage[f"model.layers.3.mlp.experts.{name}{suffix.removeprefix('weight')}"]
        assert weight.dtype == FP8 and scale.dtype == torch.float32
        assert torch.equal(weight.view(torch.uint8), _stacked_experts(source, 3, parts, "weight").view(torch.uint8))
        scales = _stacked_experts(source, 3, parts, suffix)
        want = (scales.float() - 127).exp2() if arch == "deepseek_v3" else scales  # exponent bytes -> values
        # [E, n-blocks, k-blocks]; per-tensor scales ([1] each) stack into [E, parts], one k-block
        assert scale.dim() == 3 and torch.equal(scale.flatten(1), want.flatten(1))
        expert_bytes += weight.numel()
    plan = json.load(open(out / "plan.json"))
    held = [sum(t.numel() * t.element_size() for t in tensors.values()) for tensors in stages]
    # deepseek_v3: the plan, made from the trace, counts kv_b_proj as FP8 (a linear there); the paged stage's
    # latent attention cannot read these blocks, so it is stored dequantised (7% of these tiny stages)
    slack = 0.01 if arch == "qwen3_moe" else 0.08
    assert all(abs(p["bytes"] - h) < slack * h for p, h in zip(plan["stages"], held)), (plan["stages"], held)
    assert expert_bytes == 2 * 4 * moe_config(arch).moe_intermediate_size * 64 * 3 // 2  # one byte per weight

    split = ppsplit.load(str(out))
    ops = {str(n.target) for s in split.stages for n in s.graph.nodes}
    expert_op = "ppsplit.fp8_grouped_mm.default" if dtype == "bfloat16" else "ppsplit.fp8_expert_weights.default"
    assert expert_op in ops and "aten._grouped_mm.default" not in ops
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(getattr(torch, dtype)).eval()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    tol = 1e-5 if dtype == "float32" else 1e-2  # bfloat16: the unquantised model's split differs from HF's as much
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0].float(), hf(ids).logits.float(), atol=tol, rtol=tol)
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert f"expert stacks) {quant['linears']}" in capsys.readouterr().out.replace("\n", " ")

    # A folder whose expert scales do not cover the stack is refused in one line.
    program = json.load(open(out / "stage_1.json"))
    spec = next(t for t in program["tensors"] if t["name"] == f"model.layers.3.mlp.experts.down_proj{suffix[6:]}")
    spec["shape"][0] -= 1
    json.dump(program, open(out / "stage_1.json", "w"))
    code, err = _run(["inspect", str(out)], capsys)
    assert code == 2 and len(err) == 1 and spec["name"] in err[0] and "needs" in err[0], err


def mla_config():
    """Tiny deepseek_v3 whose MLA parts are whole 16-blocks: ``kv_b_proj`` [4 heads x (16 + 16), 32], blocks
    holding one head's key or value rows, as DeepSeek-V3's 128-blocks do (dn = dv = 128)."""
    from tests.architectures.test_moe_compile import moe_config

    cfg = moe_config("deepseek_v3").to_dict()
    for derived in ("head_dim", "qk_head_dim"):
        cfg.pop(derived, None)
    cfg.update(kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    return AutoConfig.for_model(**cfg)


def test_fp8_mla_weight_stays_fp8_in_the_paged_stages(tmp_path, capsys):
    """DeepSeek-V3's FP8 checkpoints: ``kv_b_proj``, which the paged stages read whole in the MLA attention
    (``paged_latent_attention``), stays FP8 with its scales, as stored, where its blocks hold whole heads' parts;
    nothing is dequantised, the plan counts the bytes the stages hold, and the logits equal transformers' own
    loading of the checkpoint. A folder whose MLA attention reads the FP8 weight without its scale is refused."""
    torch.manual_seed(0)
    ckpt = write_quantized(tmp_path / "ds", "fp8", AutoModelForCausalLM.from_config(mla_config()).eval(), block=16)
    out = tmp_path / "ds-pp2"
    assert main(["compile", str(ckpt), "--pp", "2", "-o", str(out)]) == 0
    quant = json.load(open(out / "manifest.json"))["quantization"]
    assert quant["dequantized"] == [0, 0], quant
    source = load_file(ckpt / "model.safetensors")
    stages = [load_file(out / f"stage_{k}.safetensors") for k in range(2)]
    for k, layer in ((0, 1), (1, 3)):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        assert torch.equal(stages[k][name].view(torch.uint8), source[name].view(torch.uint8))
        assert torch.equal(stages[k][name + "_scale_inv"], source[name + "_scale_inv"])
    plan = json.load(open(out / "plan.json"))
    held = [sum(t.numel() * t.element_size() for t in tensors.values()) for tensors in stages]
    assert all(abs(p["bytes"] - h) < 0.01 * h for p, h in zip(plan["stages"], held)), (plan["stages"], held)

    split = ppsplit.load(str(out))
    latents = [n for s in split.stages for n in s.graph.nodes if n.target is ops.paged_latent_attention.default]
    assert len(latents) == 4 and all(n.args[14] is not None and n.args[15:] == (16, 16) for n in latents)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], hf(ids).logits, atol=1e-5, rtol=1e-5)

    program = json.load(open(out / "stage_0.json"))
    node = next(n for n in program["program"]["nodes"] if n.get("target") == "ppsplit::paged_latent_attention.default")
    node["args"] = node["args"][:14]
    json.dump(program, open(out / "stage_0.json", "w"))
    code, err = _run(["inspect", str(out)], capsys)
    assert code == 2 and len(err) == 1 and "paged_latent_attention_default must read a stored weight and scale" in \
        err[0], err


@pytest.mark.parametrize("block", [8, 16])
def test_split_model_of_fp8_mla_modules_with_a_paged_cache(block):
    """DeepSeek-V3 as transformers holds it FP8 on a GPU, split with a paged cache: the MLA attention is proved on
    the FP8 ``kv_b_proj`` (random FP8 values and scales, against their dequantisation) and reads it with its scales
    (8-blocks: the op dequantises it; 16-blocks: on CUDA its heads' parts are read as stored); chunks of a prompt
    equal the dequantised model's logits. Before, the proof divided the FP8 weight, which torch refuses."""
    from ppsplit import CacheConfig

    fp8, ref = _fp8_modules_model(block=block, arch="deepseek_v3", config=mla_config())
    split = ppsplit.split_model(fp8, 2, cache=CacheConfig(2, 32))
    assert split.plan.paged and all(a.replaced and a.detail.startswith("MLA") for a in split.plan.attention)
    latents = [n for s in split.stages for n in s.graph.nodes if n.target is ops.paged_latent_attention.default]
    assert len(latents) == 4 and all(n.args[15:] == (block, block) for n in latents)
    assert all(get_tensor(s, n.args[3].target).dtype == FP8 for s in split.stages for n in s.graph.nodes
               if n in latents)
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = ref(ids).logits
        for lo, hi in [(0, 7), (7, 8), (8, 13)]:
            torch.testing.assert_close(split(ids[:, lo:hi], torch.arange(lo, hi))[0], full[:, lo:hi], atol=1e-5,
                                       rtol=1e-5)


def test_fp8_experts_in_partial_blocks_are_dequantised(tmp_path, capsys):
    """Experts whose dimensions are not whole blocks (64 x 32 weights in 128 x 128 blocks): stacked and
    concatenated, a block of the stack would hold two experts' blocks with two scales, so the compile dequantises
    them (counted per stage, shown by inspect) and the rest stays FP8; the logits equal from_pretrained's."""
    from tests.architectures.test_moe_compile import moe_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config("qwen3_moe")).eval()
    ckpt = write_quantized(tmp_path / "moe", "fp8", model)
    out = tmp_path / "moe-pp2"
    assert main(["compile", str(ckpt), "--pp", "2", "-o", str(out)]) == 0
    quant = json.load(open(out / "manifest.json"))["quantization"]
    assert quant["dequantized"] == [4, 4] and quant["linears"] == [8, 8], quant  # 2 stacks and 4 linears a layer
    with safe_open(str(out / "stage_1.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.3.mlp.experts.gate_up_proj").get_dtype() == "F32"
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    split = ppsplit.load(str(out))
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], hf(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("card,index", [("NVIDIA H200", 0), ("NVIDIA H100 80GB HBM3", 1), ("NVIDIA H200", None)])
def test_one_row_tiles_follow_the_card(card, index, monkeypatch):
    """``linear_config`` keys the one-row tiles by the card the input is on (bench/RESULTS.md section 41): 8 rows a
    program for Llama-3.1-8B's fused gate/up on an H200 only, 2 rows for everything else and off CUDA; the GEMM's
    tiles at more rows do not depend on it. Every FP8 path (plain, SiLU-and-multiply, rotary epilogue) asks with its
    input's device, so the folds and the plain GEMV sum in the same order on one card."""
    from ppsplit.triton_kernels import fp8

    seen = []
    monkeypatch.setattr(fp8, "_cuda_card", lambda i: seen.append(i) or card)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    device = torch.device("cuda", index) if index is not None else torch.device("cuda")
    h200 = card.endswith("H200")
    assert fp8.linear_config(1, 28672, 4096, device) == ((8, 2048, 4, 2) if h200 else (2, 2048, 4, 4))
    assert fp8.linear_config(1, 4096, 14336, device) == (2, 2048, 4, 4)
    assert seen[0] == (3 if index is None else index)
    for off in (None, torch.device("cpu")):
        assert fp8.linear_config(1, 28672, 4096, off) == (2, 2048, 4, 4)
    assert fp8.linear_config(32, 28672, 4096, device) == fp8.gemm_config(28672)


@pytest.mark.parametrize("n,k,bn,bk,m", [(200, 300, 128, 128, 1), (200, 300, 128, 128, 5), (7, 33, 1, 33, 1),
                                         (7, 33, 7, 33, 3), (130, 256, 64, 128, 17), (130, 256, 64, 128, 40),
                                         (40, 600, 64, 256, 1), (40, 600, 64, 256, 9), (100, 256, 48, 128, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [None, (8, 128, 4, 2), (32, 1024, 4, 3), (16, 64, 4, 2, 3)])
def test_triton_fp8_kernels_equal_fp64_reference(n, k, bn, bk, m, dtype, config):
    """The GEMV (one row) and GEMM kernels, run on CPU tensors under TRITON_INTERPRET=1 (conftest), with the
    default tiles, with tiles inside a k-block and across several (the GEMV sums each k-block apart), with GEMV
    programs whose rows straddle scale blocks (48 rows high), and with the GEMM's k split over three ranges (their
    fp32 partial sums added by a second kernel)."""
    from ppsplit.triton_kernels.fp8 import HAVE_TRITON, fp8_usable, launch_fp8_linear

    if not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors, which needs triton and TRITON_INTERPRET=1 (conftest)")
    torch.manual_seed(n * m + k)
    q, scale = quantize_blocks(torch.randn(n, k), bn, bk)
    x, bias = torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
    assert fp8_usable(x, q, bk)
    ref = x.double() @ reference_dequant(q, scale, bn, bk).T + bias.double()
    got = launch_fp8_linear(x, q, scale, bias, bn, bk, config=config)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), ref, atol=tol * math.sqrt(k), rtol=tol)
    assert not fp8_usable(x, q, 96) or 96 >= k  # a k-block a 128-wide tile would straddle takes the torch path


def _gated_inputs(width, k, bn, bk, dtype, device="cpu"):
    """A fused gate/up FP8 weight ``[2 * width, k]`` in ``[bn, bk]`` blocks, one row ``x`` and a bias."""
    torch.manual_seed(width + k)
    q, scale = quantize_blocks(torch.randn(2 * width, k), bn, bk)
    x, bias = torch.randn(1, k).to(dtype), torch.randn(2 * width).to(dtype)
    return [t.to(device) for t in (x, q, scale, bias)]


@pytest.mark.parametrize("width,k,bn,bk,config", [(100, 300, 128, 128, None), (37, 256, 16, 128, (8, 128, 4, 2)),
                                                   (64, 200, 1, 200, (2, 256, 4, 2)), (384, 256, 128, 128, None),
                                                   (40, 600, 64, 256, (4, 512, 4, 2))])
@pytest.mark.parametrize("gate_first", [True, False])
def test_gated_fp8_gemv_is_the_two_kernels_bit_for_bit(width, k, bn, bk, config, gate_first):
    """``launch_fp8_linear_silu_mul`` (the GEMV whose epilogue multiplies) under TRITON_INTERPRET=1 (conftest), fp16:
    the same bits as the GEMV then ``silu_mul``'s kernel, with the gate rows first or second, outputs that do not
    fill the last program, scale blocks the outputs straddle, tiles over several k-blocks; and within fp16's
    tolerance of the fp64 ``silu(a) * b`` of the dequantised product."""
    from ppsplit.triton_kernels.fp8 import launch_fp8_linear, launch_fp8_linear_silu_mul
    from ppsplit.triton_kernels.pointwise import launch_silu_mul

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 (conftest)")
    x, q, scale, bias = _gated_inputs(width, k, bn, bk, torch.float16)
    gate, up = (0, width) if gate_first else (width, 0)
    y = launch_fp8_linear(x, q, scale, bias, bn, bk, config=config)
    want = launch_silu_mul(y[..., gate:gate + width], y[..., up:up + width])
    got = launch_fp8_linear_silu_mul(x, q, scale, bias, bn, bk, gate, up, width, config=config)
    assert got.shape == (1, width) and torch.equal(got, want)
    ref = x.double() @ reference_dequant(q, scale, bn, bk).T + bias.double()
    ref = torch.nn.functional.silu(ref[..., gate:gate + width]) * ref[..., up:up + width]
    torch.testing.assert_close(got.double(), ref, atol=4e-3 * math.sqrt(k), rtol=4e-3)


def test_gated_fp8_op_refuses_rows_outside_the_weight():
    from ppsplit.triton_kernels.fp8 import launch_fp8_linear_silu_mul

    x, q, scale, bias = _gated_inputs(64, 128, 128, 128, torch.float16)
    with pytest.raises(ValueError, match="do not lie in a weight of 128 rows"):
        launch_fp8_linear_silu_mul(x, q, scale, bias, 128, 128, 0, 100, 64)


def test_fused_pointwise_folds_silu_mul_into_the_fp8_gate_up(fp8_folder):
    """``fuse_pointwise`` on a loaded FP8 stage with fused projections: each layer's ``silu_mul`` of the two halves of
    its gate/up ``fp8_linear`` becomes one ``fp8_linear_silu_mul``, no slice of that projection is left, and the
    logits are the unfolded stage's bit for bit (on the CPU the op is the two ops); a stage whose gate and up stay
    two projections keeps its ``silu_mul``."""
    from ppsplit.passes.rewrites.pointwise import fuse_pointwise

    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ppsplit.load(str(fp8_folder), fuse_projections=True)(ids)[0]
        split = ppsplit.load(str(fp8_folder), fuse_projections=True)
        layers = [sum(1 for f in s.meta["ppsplit.projections"].fused if "gate_proj" in f.weight) for s in split.stages]
        counts = [fuse_pointwise(stage) for stage in split.stages]
        assert [c["fp8_linear_silu_mul"] for c in counts] == layers and sum(layers) == 3, counts
        assert all(c["silu_mul"] == 0 for c in counts), counts
        for stage in split.stages:
            folded = [n for n in stage.graph.nodes if n.target is torch.ops.ppsplit.fp8_linear_silu_mul.default]
            gate_up = {n.args[1].target for n in folded}
            assert all(".fused_gate_proj_up_proj." in t for t in gate_up)
            assert not [n for n in stage.graph.nodes if n.target is torch.ops.ppsplit.fp8_linear.default
                        and n.args[1].target in gate_up]
            assert all(n.args[6:] == (0, 384, 384) for n in folded)
        assert torch.equal(split(ids)[0], want)

        apart = ppsplit.load(str(fp8_folder), fuse_projections=False)
        assert [fuse_pointwise(stage)["silu_mul"] for stage in apart.stages] == layers
        assert all("fp8_linear_silu_mul" not in fuse_pointwise(stage) for stage in apart.stages)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gated_fp8_gemv_on_gpu_is_the_two_kernels_and_captures():
    """bf16 on the GPU at Llama-3.1-8B's gate/up (2 x 14336 rows, 4096 wide, 128-blocks): the gated GEMV against the
    GEMV then ``silu_mul``'s kernel, bit for bit (libdevice's ``exp`` and the IEEE division, both compiled), then
    captured in a CUDA graph and replayed."""
    from ppsplit.triton_kernels.fp8 import launch_fp8_linear, launch_fp8_linear_silu_mul
    from ppsplit.triton_kernels.pointwise import launch_silu_mul

    x, q, scale, _ = _gated_inputs(14336, 4096, 128, 128, torch.bfloat16, "cuda")
    y = launch_fp8_linear(x, q, scale, None, 128, 128)
    want = launch_silu_mul(y[..., :14336], y[..., 14336:])
    got = launch_fp8_linear_silu_mul(x, q, scale, None, 128, 128, 0, 14336, 14336)
    assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launch_fp8_linear_silu_mul(x, q, scale, None, 128, 128, 0, 14336, 14336)
    x.copy_(torch.randn_like(x))
    graph.replay()
    y = launch_fp8_linear(x, q, scale, None, 128, 128)
    assert torch.equal(captured, launch_silu_mul(y[..., :14336], y[..., 14336:]))


def _experts(e, n, k, bn, bk, seed):
    """``e`` random experts [n, k] quantised in [bn, bk] blocks by the test's own quantiser: (FP8 stack, scales)."""
    torch.manual_seed(seed)
    pairs = [quantize_blocks(torch.randn(n, k) * 2, bn, bk) for _ in range(e)]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _grouped_reference(x, q, scale, counts, bn, bk):
    """fp64: each expert's rows (``counts`` of them, in order) times its own dequantised weight, transposed."""
    rows = torch.split(x.double(), counts)
    return torch.cat([r @ reference_dequant(q[i], scale[i], bn, bk).T for i, r in enumerate(rows)])


@pytest.mark.parametrize("e,n,k,bn,bk,counts", [(4, 64, 96, 32, 32, [2, 0, 3, 2]), (3, 200, 300, 128, 128, [17, 1, 0]),
                                                (5, 40, 64, 16, 64, [1, 1, 1, 1, 40]), (2, 48, 256, 1, 256, [3, 5]),
                                                (3, 64, 128, 64, 128, [0, 0, 0])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_fp8_grouped_kernel_equals_fp64_reference(e, n, k, bn, bk, counts, dtype):
    """The grouped FP8 kernel of MoE experts under TRITON_INTERPRET=1 (conftest): rows sorted by expert, an expert
    no row chose (nothing written for it), one with more rows than a tile (several row tiles), partial last scale
    blocks (200 x 300 in 128-blocks), per-channel scales, 16-wide k-blocks (a 16-column tile), and no rows at all."""
    from ppsplit.triton_kernels.fp8 import fp8_grouped_usable, launch_fp8_grouped_mm

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 (conftest)")
    q, scale = _experts(e, n, k, bn, bk, seed=n + k)
    x = torch.randn(sum(counts), k).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert fp8_grouped_usable(x, q, bk)
    got = launch_fp8_grouped_mm(x, q, scale, offs, bn, bk)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), _grouped_reference(x, q, scale, counts, bn, bk),
                               atol=tol * math.sqrt(k), rtol=tol)


def test_fp8_expert_ops_torch_path_equals_fp64_reference():
    """The torch paths the CPU stages run: ``fp8_grouped_mm`` (dequantise, then ``torch._grouped_mm``) and
    ``fp8_expert_weights`` (the routed experts' weights, dequantised) against the fp64 reference, on experts with
    partial last blocks."""
    from ppsplit.triton_kernels.fp8 import fp8_expert_weights, fp8_grouped_mm

    q, scale = _experts(3, 40, 72, 16, 32, seed=3)
    counts = [4, 0, 3]
    x = torch.randn(sum(counts), 72)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    torch.testing.assert_close(fp8_grouped_mm(x, q, scale, offs, 16, 32).double(),
                               _grouped_reference(x, q, scale, counts, 16, 32), atol=1e-4, rtol=1e-5)
    ids = torch.tensor([2, 0, 2, 1])
    want = torch.stack([reference_dequant(q[i], scale[i], 16, 32) for i in ids.tolist()])
    got = fp8_expert_weights(q, scale, ids, 16, 32, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want.float())  # one rounding of an exact product


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_grouped_kernel_on_gpu_equals_reference_and_replays_any_routing():
    """bf16 on the GPU, 128-blocks, 8 experts: the grouped kernel against the fp64 reference, then captured in a
    CUDA graph once and replayed with two other routings (its row ranges are read on the device)."""
    from ppsplit.triton_kernels.fp8 import fp8_grouped_mm

    q, scale = _experts(8, 384, 512, 128, 128, seed=8)
    q, scale = q.cuda(), scale.cuda()
    x = torch.randn(24, 512, device="cuda").to(torch.bfloat16)
    offs = torch.zeros(8, dtype=torch.int32, device="cuda")
    routings = [[3, 0, 5, 1, 0, 0, 15, 0], [0, 24, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 3, 0]]

    def check(y, counts):
        ref = _grouped_reference(x.cpu(), q.cpu(), scale.cpu(), counts, 128, 128)
        torch.testing.assert_close(y.double().cpu(), ref, atol=0.05 * math.sqrt(512) / 4, rtol=1e-2)

    offs.copy_(torch.tensor(routings[0]).cumsum(0))
    check(fp8_grouped_mm(x, q, scale, offs, 128, 128), routings[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_grouped_mm(x, q, scale, offs, 128, 128)
    for counts in routings[1:]:
        offs.copy_(torch.tensor(counts).cumsum(0))
        graph.replay()
        check(y, counts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dot_scaled", [True, False])
def test_mxfp4_grouped_kernel_on_gpu_equals_reference_and_replays_any_routing(dot_scaled):
    """bf16 on the GPU, gpt-oss's 2880 inputs (90 groups of 32), 8 experts: the MXFP4 kernel (through
    ``tl.dot_scaled``, and decoding the nibbles itself) against transformers' dequantisation in fp64, then captured
    once and replayed with other routings."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ppsplit.triton_kernels.mxfp4 import launch_mxfp4_grouped_mm

    gen = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (8, 320, 90, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 126, (8, 320, 90), generator=gen, dtype=torch.uint8)
    weights = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).double()  # [E, K, N]
    x = torch.randn(24, 2880, generator=gen).to(torch.bfloat16).cuda()
    blocks, scales = blocks.cuda(), scales.cuda()
    offs = torch.zeros(8, dtype=torch.int32, device="cuda")
    routings = [[3, 0, 5, 1, 0, 0, 15, 0], [0, 24, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 3, 0]]

    def check(y, counts):
        want = torch.cat([r @ weights[i] for i, r in enumerate(torch.split(x.double().cpu(), counts))])
        torch.testing.assert_close(y.double().cpu(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)

    def run():
        return launch_mxfp4_grouped_mm(x, blocks, scales, offs, dot_scaled=dot_scaled)

    offs.copy_(torch.tensor(routings[0]).cumsum(0))
    check(run(), routings[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    for counts in routings[1:]:
        offs.copy_(torch.tensor(counts).cumsum(0))
        graph.replay()
        check(y, counts)


@pytest.mark.gpu
def test_fp8_stage_on_cuda_equals_reference_and_captures(fp8_folder):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ppsplit.core.ragged import CacheLayout, RaggedStep

    stage = ppsplit.load_stage(str(fp8_folder), 0, "cuda")
    step = RaggedStep.lockstep(1, 1, 0, CacheLayout.of(stage.meta["ppsplit.plan"]))  # the folder's paged cache
    ids = torch.randint(3, 64, (1,))
    aux = torch.empty(0, 1, 256)
    inputs = [t.cuda() for t in (ids, step.positions, aux, *step.tensors()[1:])]
    eager = stage(*inputs)[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = stage(*inputs)[0]
    graph.replay()
    torch.testing.assert_close(out, eager)
    cpu = ppsplit.load_stage(str(fp8_folder), 0, "cpu")(ids, step.positions, aux, *step.tensors()[1:])[0]
    torch.testing.assert_close(eager.cpu(), cpu, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_programmatic_launch_gives_a_captured_fp8_step_the_same_bits(fp8_checkpoint, tmp_path):
    """A bf16 compile of the FP8 checkpoint, stage 0 on the GPU, its decode step at batch 1 (the FP8 GEMVs, the gated
    one, the norm, rope_write and paged attention kernels) captured twice as the runtime captures it: with
    programmatic dependent launch and without. The same kernels on the same tiles, so a kernel that reads before it
    waits is the only way a bit could differ: 50 replays each, interleaved, give the same bits."""
    from ppsplit.core.ragged import CacheLayout, RaggedStep
    from ppsplit.triton_kernels.common import programmatic_launch, supports_programmatic_launch

    if not supports_programmatic_launch(torch.empty(0, device="cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    out = tmp_path / "bf16"
    assert main(["compile", str(fp8_checkpoint), "--pp", "2", "-o", str(out), "--dtype", "bfloat16"]) == 0
    stage = ppsplit.load_stage(str(out), 0, "cuda")
    assert stage.meta["ppsplit.pointwise"].get("fp8_linear_silu_mul"), stage.meta["ppsplit.pointwise"]
    step = RaggedStep.lockstep(1, 1, 5, CacheLayout.of(stage.meta["ppsplit.plan"]))
    graphs = []
    for on in (False, True):
        previous = programmatic_launch(on)
        try:
            graph = ppsplit.cuda_graph(stage, 0, 1)
        finally:
            programmatic_launch(previous)
        graph.x.copy_(torch.tensor([7]))
        for static, value in zip(graph.meta, step.tensors()):
            static.copy_(value)
        graphs.append(graph)
    plain, pdl = graphs
    for _ in range(50):
        want = plain.replay().clone()
        assert torch.equal(pdl.replay(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["fp8", "mxfp4"])
def test_quantized_moe_stage_on_cuda_equals_cpu_and_captures(scheme, tmp_path):
    """A bf16 MoE folder with its experts as stored (qwen3_moe FP8 in 32-blocks; gpt-oss MXFP4): stage 0 on the GPU
    (the grouped expert kernels) against the same stage on the CPU (the experts dequantised) for a 5-token prefill,
    then captured in a CUDA graph and replayed."""
    from tests.architectures.test_moe_compile import moe_config

    from ppsplit.core.ragged import CacheLayout, RaggedStep

    if scheme == "fp8":
        torch.manual_seed(0)
        ckpt = write_quantized(tmp_path / "moe", "fp8", AutoModelForCausalLM.from_config(moe_config("qwen3_moe")),
                               block=32)
    else:
        ckpt = write_mxfp4(tmp_path / "moe")
    out = tmp_path / "out"
    assert main(["compile", str(ckpt), "--pp", "2", "-o", str(out), "--dtype", "bfloat16"]) == 0
    stage = ppsplit.load_stage(str(out), 0, "cuda")
    expert_op = "fp8_grouped_mm" if scheme == "fp8" else "mxfp4_grouped_mm"
    assert any(expert_op in str(n.target) for n in stage.graph.nodes)
    step = RaggedStep.lockstep(1, 5, 0, CacheLayout.of(stage.meta["ppsplit.plan"]))
    ids = torch.randint(3, 100, (5,), generator=torch.Generator().manual_seed(1))
    aux = torch.empty(0, 5, 64, dtype=torch.bfloat16)
    inputs = [t.cuda() for t in (ids, step.positions, aux, *step.tensors()[1:])]
    eager = stage(*inputs)[0].clone()
    cpu = ppsplit.load_stage(str(out), 0, "cpu")(ids, step.positions, aux, *step.tensors()[1:])[0]
    torch.testing.assert_close(eager.float().cpu(), cpu.float(), atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = stage(*inputs)[0]
    graph.replay()
    torch.testing.assert_close(captured, eager)


def test_fused_fp8_projections_equal_hf(fp8_folder, hf_fp8):
    """load(fuse_projections=True): q/k/v and gate/up become one fp8_linear each over the stacked FP8 weights and
    their stacked block scales."""
    split = ppsplit.load(str(fp8_folder), fuse_projections=True)
    fused = [f for s in split.stages for f in s.meta["ppsplit.projections"].fused]
    assert len(fused) == 2 * 3 and all(".fused_" in f.weight for f in fused)
    for s in split.stages:
        calls = [n for n in s.graph.nodes if n.target is torch.ops.ppsplit.fp8_linear.default]
        assert len(calls) == 4 * sum(1 for f in s.meta["ppsplit.projections"].fused if "q_proj" in f.weight)
        assert all(dict(s.named_parameters())[n.args[1].target].dtype == FP8 for n in calls)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], hf_fp8(ids).logits, atol=1e-5, rtol=1e-5)


def test_split_model_of_hf_loaded_fp8_model(hf_fp8):
    """split_model of the model transformers loaded from the FP8 checkpoint (on the CPU transformers dequantises it
    into plain linears, so it splits like any model)."""
    split = ppsplit.split_model(hf_fp8, pp=2)
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], hf_fp8(ids).logits, atol=1e-5, rtol=1e-5)


def _fp8_modules_model(block: int = 32, ue8m0: bool = False, arch: str = "qwen3_moe", config=None):
    """Tiny ``arch`` (a MoE) as transformers holds an FP8 checkpoint on a GPU (its own ``replace_with_fp8_linear``:
    ``FP8Linear`` projections, ``FP8Experts``), filled from a random model by the test's quantiser; and that model
    with every quantised weight replaced by its exact dequantisation (the reference)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    from tests.architectures.test_moe_compile import moe_config

    torch.manual_seed(0)
    config = config or moe_config(arch)
    ref = AutoModelForCausalLM.from_config(config).eval()
    fp8 = AutoModelForCausalLM.from_config(config).eval()
    fp8.load_state_dict(ref.state_dict())
    replace_with_fp8_linear(fp8, modules_to_not_convert=["lm_head"],
                            quantization_config=FineGrainedFP8Config(weight_block_size=[block, block]))
    params = dict(ref.named_parameters())

    def quantised(w):
        q, s = quantize_blocks(w.detach(), block, block, power_of_two=ue8m0)
        w.copy_(reference_dequant(q, s, block, block).float())
        return q, (s.log2() + 127).to(torch.uint8).view(torch.float8_e8m0fnu) if ue8m0 else s

    as_param = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
    kinds = set()
    with torch.no_grad():
        for name, module in fp8.named_modules():
            kind = type(module).__name__
            if kind == "FP8Linear":
                q, s = quantised(params[f"{name}.weight"])
                module.weight, module.weight_scale_inv = as_param(q), as_param(s)
            elif "FP8Experts" in kind:
                for p in ("gate_up_proj", "down_proj"):
                    pairs = [quantised(w) for w in params[f"{name}.{p}"]]
                    setattr(module, p, as_param(torch.stack([q for q, _ in pairs])))
                    setattr(module, f"{p}_scale_inv", as_param(torch.stack([s for _, s in pairs])))
            else:
                continue
            kinds.add(kind)
    assert kinds == {"FP8Linear", "FP8Experts"}, kinds
    return fp8, ref


def test_split_model_of_transformers_fp8_modules():
    """A model as transformers holds an FP8 checkpoint on a GPU (``FP8Linear``, ``FP8Experts``, whose own forwards
    call kernels from the hub): while tracing, they run ppsplit's FP8 ops on their own tensors, so the stages keep the
    FP8 weights as loaded, and the logits equal the dequantised model's."""
    fp8, ref = _fp8_modules_model()
    split = ppsplit.split_model(fp8, pp=2)
    ops = {str(n.target) for s in split.stages for n in s.graph.nodes}
    assert {"ppsplit.fp8_linear.default", "ppsplit.fp8_grouped_mm.default"} <= ops
    assert all(p.dtype == FP8 for s in split.stages for n, p in s.named_parameters() if n.endswith("proj"))
    assert not any("forward" in vars(m) for m in fp8.modules())  # the modules are as they were
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_split_model_of_fp8_modules_with_e8m0_scales():
    """transformers' ue8m0 layout (``weight_scale_inv`` as ``float8_e8m0fnu`` powers of two, linears and expert
    stacks): the trace reads their fp32 values, so the stages hold fp32 scales equal to ``2 ** (e - 127)``, the
    model gets its own E8M0 parameters back, and the logits equal the dequantised model's."""
    fp8, ref = _fp8_modules_model(ue8m0=True)
    scales = {n: p for n, p in fp8.named_parameters() if n.endswith("_scale_inv")}
    assert scales and all(p.dtype == torch.float8_e8m0fnu for p in scales.values())
    split = ppsplit.split_model(fp8, pp=2)
    held = {n: p for s in split.stages for n, p in s.named_parameters() if n.endswith("_scale_inv")}
    assert held.keys() == scales.keys()
    for n, p in held.items():
        want = (scales[n].view(torch.uint8).float() - 127).exp2()
        assert p.dtype == torch.float32 and torch.equal(p, want), n
    assert all(p is scales[n] for n, p in fp8.named_parameters() if n in scales)  # the model's own, unchanged
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_split_model_refuses_fp8_modules_it_cannot_run():
    """Scales in a dtype the ops cannot read (integer exponent bytes) are refused in one line that names the
    parameter and says what to do, and the model keeps its tensors."""
    from ppsplit.core.errors import ConfigError

    fp8, _ = _fp8_modules_model(ue8m0=True)
    module = fp8.get_submodule("model.layers.1.self_attn.o_proj")
    module.weight_scale_inv = torch.nn.Parameter(module.weight_scale_inv.view(torch.uint8), requires_grad=False)
    before = dict(fp8.named_parameters())
    with pytest.raises(ConfigError, match=r"o_proj: weight_scale_inv is torch.uint8.*ppsplit compile") as err:
        ppsplit.split_model(fp8, pp=2)
    assert "\n" not in str(err.value)
    assert all(p is before[n] for n, p in fp8.named_parameters())


def test_plan_command_counts_fp8_bytes_as_compile_does(fp8_checkpoint, fp8_folder, capsys):
    capsys.readouterr()
    assert main(["plan", str(fp8_checkpoint), "--pp", "2", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    compiled = json.load(open(fp8_folder / "plan.json"))
    assert [s["bytes"] for s in planned["stages"]] == [s["bytes"] for s in compiled["stages"]]
    assert compiled["stages"][1]["bytes"] < 0.3 * 4 * compiled["stages"][1]["params"]  # FP8, not the fp32 skeleton


def write_mxfp4(folder):
    """Tiny gpt-oss saved with MXFP4 experts (``*_blocks`` U8 [E, N, K/32, 16] + ``*_scales`` E8M0 [E, N, K/32],
    random bytes and exponents) and quant_method "mxfp4", as gpt-oss ships."""
    from tests.architectures.test_moe_compile import moe_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config("gpt_oss")).eval()
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # stored [E, in, out]; MXFP4 packs [E, out, in / 32, 16]
        tensors[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(118, 124, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.load(open(folder / "config.json"))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(config, open(folder / "config.json", "w"))
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_experts_stay_as_stored_and_equal_hf(dtype, tmp_path, capsys):
    """gpt-oss's MXFP4 experts: the stage files hold the checkpoint's blocks and scales byte for byte (a quarter of
    the bf16 bytes, about), the plan counts them so, and the stages run ppsplit's MXFP4 expert ops on them: the
    grouped product where a bfloat16 compile traced ``_grouped_mm``, the routed experts' weights where a float32 one
    traced ``batched_mm``. The logits equal transformers' own dequantisation (in bfloat16: its float32 loading cast
    to bfloat16, whose expert weights are exactly the MXFP4 values)."""
    from tests.architectures.test_moe_compile import moe_config

    folder = write_mxfp4(tmp_path / "gpt-oss-mxfp4")
    out = tmp_path / "mxfp4-pp2"
    assert main(["compile", str(folder), "--pp", "2", "-o", str(out), "--dtype", dtype]) == 0
    layers = moe_config("gpt_oss").num_hidden_layers
    quant = json.load(open(out / "manifest.json"))["quantization"]
    assert quant["method"] == "mxfp4" and sum(quant["dequantized"]) == 0 and sum(quant["linears"]) == 2 * layers
    source = load_file(folder / "model.safetensors")
    stages = [load_file(out / f"stage_{k}.safetensors") for k in range(2)]
    stage = {**stages[0], **stages[1]}
    for name in [n for n in source if n.endswith(("_blocks", "_scales"))]:
        assert stage[name].dtype == torch.uint8 and torch.equal(stage[name], source[name]), name
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in stage)
    packed = sum(t.numel() for n, t in stage.items() if n.endswith(("_blocks", "_scales")))
    weights = sum(t.numel() * 2 for n, t in stage.items() if n.endswith("_blocks"))  # two values a byte
    assert packed < 0.27 * 2 * weights  # 17 bytes per 32 values: 27% of them in bf16
    plan = json.load(open(out / "plan.json"))
    held = [sum(t.numel() * t.element_size() for t in tensors.values()) for tensors in stages]
    assert all(abs(p["bytes"] - h) < 0.01 * h for p, h in zip(plan["stages"], held)), (plan["stages"], held)
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "mxfp4 experts (*_blocks + *_scales) as stored" in capsys.readouterr().out

    split = ppsplit.load(str(out))
    ops = {str(n.target) for s in split.stages for n in s.graph.nodes}
    assert ("ppsplit.mxfp4_grouped_mm.default" if dtype == "bfloat16" else "ppsplit.mxfp4_expert_weights.default") \
        in ops and "aten._grouped_mm.default" not in ops
    # transformers' own dequantisation (asked for: with `kernels` installed, 5.25 would fetch a hub kernel instead)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    hf = hf.to(getattr(torch, dtype)).eval()
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    tol = 1e-4 if dtype == "float32" else 2e-2
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0].float(), hf(ids).logits.float(), atol=tol, rtol=tol)

    # A folder whose blocks and scales disagree is refused in one line.
    program = json.load(open(out / "stage_0.json"))
    spec = next(t for t in program["tensors"] if t["name"].endswith("experts.down_proj_scales"))
    spec["shape"][-1] += 1
    json.dump(program, open(out / "stage_0.json", "w"))
    code, err = _run(["inspect", str(out)], capsys)
    assert code == 2 and len(err) == 1 and "MXFP4 experts" in err[0], err


@pytest.mark.parametrize("counts,dtype,dot_scaled", [([2, 0, 3, 2], torch.float32, True),
                                                     ([17, 1, 0, 4], torch.float16, True),
                                                     ([17, 1, 0, 4], torch.float16, False),
                                                     ([0, 0, 0, 0], torch.float16, True)])
@pytest.mark.parametrize("config", [None, (16, 64, 32, 4, 2, 3), (16, 32, 64, 4, 2, 2)])
def test_triton_mxfp4_grouped_kernel_equals_reference(counts, dtype, dot_scaled, config):
    """The MXFP4 grouped kernel under TRITON_INTERPRET=1 (conftest), through ``tl.dot_scaled`` (fp16 rows) and
    through its own nibble decoding (fp32 rows, or asked for), against transformers' own
    ``convert_moe_packed_tensors`` (which also fixes the layout: the low nibble first, the expert transposed) in
    fp64 products: random bytes (every nibble, both signs), exponents around 127, an expert no row chose, one with
    more rows than a tile, no rows at all, 100 columns (a partial column tile), 96 inputs (a partial k tile); on the
    default tiles and split over 3 input ranges of 32, or 2 of 64 (the second partial)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ppsplit.triton_kernels.mxfp4 import launch_mxfp4_grouped_mm, mxfp4_expert_weights

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 (conftest)")
    gen = torch.Generator().manual_seed(len(counts) + sum(counts))
    blocks = torch.randint(0, 256, (4, 100, 3, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 132, (4, 100, 3), generator=gen, dtype=torch.uint8)
    weights = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).double()  # [E, K, N]
    x = torch.randn(sum(counts), 96, generator=gen).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = launch_mxfp4_grouped_mm(x, blocks, scales, offs, dot_scaled=dot_scaled, **({"config": config} if config
                                                                                     else {}))
    want = torch.cat([r @ weights[i] for i, r in enumerate(torch.split(x.double(), counts))])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol * 16 * math.sqrt(96), rtol=tol)
    ids = torch.tensor([3, 0, 3])
    assert torch.equal(mxfp4_expert_weights(blocks, scales, ids, torch.float32).double(), weights[ids])


def test_mxfp4_ops_refuse_mismatched_tensors():
    """The MXFP4 ops check their tensors before any kernel could read past one: scales of another shape, blocks of
    another dtype, rows of another width."""
    from ppsplit.triton_kernels.mxfp4 import mxfp4_expert_weights, mxfp4_grouped_mm

    blocks, scales = torch.zeros(2, 8, 2, 16, dtype=torch.uint8), torch.full((2, 8, 2), 127, dtype=torch.uint8)
    offs = torch.tensor([1, 2], dtype=torch.int32)
    assert mxfp4_grouped_mm(torch.randn(2, 64), blocks, scales, offs).shape == (2, 8)
    with pytest.raises(ValueError, match="cannot take rows of 32"):
        mxfp4_grouped_mm(torch.randn(2, 32), blocks, scales, offs)
    with pytest.raises(ValueError, match="uint8 scales"):
        mxfp4_expert_weights(blocks, scales[:, :, :1], torch.tensor([0]), torch.float32)
    with pytest.raises(ValueError, match="uint8 blocks"):
        mxfp4_expert_weights(blocks.to(torch.int16), scales, torch.tensor([0]), torch.float32)
