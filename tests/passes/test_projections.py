"""fuse_projections: sibling linears on one input (q/k/v, gate/up, a MoE's shared expert) become one linear over a
concatenated weight; the stages still equal Hugging Face, hold the fused tensors instead of the separate ones,
and a compiled folder keeps the checkpoint's names and fuses when loaded."""
import json

import pytest
import torch
from safetensors import safe_open
from torch import fx
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig
from ppsplit.passes.rewrites.projections import fuse_projections
from tests.support import VOCAB, tiny_model

aten = torch.ops.aten
CACHE = CacheConfig(batch_size=2, max_len=40)
L = 3
# Siblings per layer: q/k/v, and gate/up (of the MLP, or of the MoE's shared expert).
FUSED = {"llama": (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp", "gate_proj", "up_proj")),
         "qwen2": (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp", "gate_proj", "up_proj")),
         "qwen2_moe": (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp.shared_expert", "gate_proj", "up_proj"))}
_MODELS: dict = {}


def model_and_trace(arch):
    if arch not in _MODELS:
        if arch == "qwen2_moe":  # not in tests.support.ARCHS: a MoE with a shared expert and its 1-wide gate
            torch.manual_seed(0)
            cfg = AutoConfig.for_model(arch, vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=L, max_position_embeddings=256,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])
            model = AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
        else:
            model = tiny_model(arch, num_layers=L)
        _MODELS[arch] = (model, ppsplit.trace_model(model, cache=CACHE))
    return _MODELS[arch]


def linears(split) -> int:
    return sum(1 for s in split.stages for n in s.graph.nodes if n.target is aten.linear.default)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe"])
def test_fused_stages_equal_hf(arch):
    model, traced = model_and_trace(arch)
    plain = ppsplit.split_model(traced, 2, aux=[1, 2])
    split = ppsplit.split_model(traced, 2, aux=[1, 2], fuse_projections=True)

    # Structure: per layer, q/k/v -> 1 linear and gate/up -> 1 linear; the stage holds the concatenation (biases
    # too) under a derived name and no longer the separate tensors.
    assert linears(plain) - linears(split) == 3 * L
    hf = dict(model.named_parameters())
    for k, stage in enumerate(split.stages):
        held = dict(stage.named_parameters())
        report = stage.meta["ppsplit.projections"]
        sp = split.plan.stages[k]
        assert len(report.fused) == 2 * (sp.end - sp.start)
        for i in range(sp.start, sp.end):
            for parent, *names in FUSED[arch]:
                prefix = f"model.layers.{i}.{parent}"
                fused = f"{prefix}.fused_{'_'.join(names)}"
                for kind in ("weight", "bias") if arch != "llama" and parent == "self_attn" else ("weight",):
                    parts = [hf[f"{prefix}.{n}.{kind}"] for n in names]
                    assert torch.equal(held[f"{fused}.{kind}"], torch.cat(parts))
                    # the model's own tensors are now views of the concatenation: fusing costs no memory
                    assert all(p.untyped_storage().data_ptr() == held[f"{fused}.{kind}"].untyped_storage().data_ptr()
                               for p in parts)
                    assert not any(f"{prefix}.{n}.{kind}" in held for n in names)
        if arch == "qwen2_moe":  # the 1-wide shared-expert gate stays on its own, and says why
            assert all("too few" in why for _, why in report.skipped) and report.skipped
            assert all(f"model.layers.{i}.mlp.shared_expert_gate.weight" in held for i in range(sp.start, sp.end))

    # Numbers: prefill logits and taps equal HF's; cached greedy decoding equals HF's generate.
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 7))
    logits, aux = split(ids, torch.arange(7))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    for slot, tap in enumerate((1, 2)):
        torch.testing.assert_close(aux[slot], ref.hidden_states[tap], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(split.generate(ids, 12), expected)


def test_tied_weights_are_left_alone():
    """Layer 0's up_proj shares gate_proj's tensor, and layer 2's q_proj is layer 1's: those stay as they are
    (the shared tensor under its names, its linear separate); the others still fuse; the numbers equal HF."""
    model = tiny_model("llama", num_layers=L)
    layers = model.model.layers
    layers[0].mlp.up_proj.weight = layers[0].mlp.gate_proj.weight
    layers[2].self_attn.q_proj.weight = layers[1].self_attn.q_proj.weight
    split = ppsplit.split_model(model, 1, fuse_projections=True)
    stage = split.stages[0]
    report = stage.meta["ppsplit.projections"]
    fused = {f.weight for f in report.fused}
    assert "model.layers.0.mlp.fused_gate_proj_up_proj.weight" not in fused
    assert "model.layers.0.self_attn.fused_q_proj_k_proj_v_proj.weight" in fused
    assert "model.layers.1.mlp.fused_gate_proj_up_proj.weight" in fused
    assert {"model.layers.1.self_attn.fused_k_proj_v_proj.weight",
            "model.layers.2.self_attn.fused_k_proj_v_proj.weight"} <= fused  # q is shared: k and v fuse alone
    skipped = {name for name, _ in report.skipped}
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.q_proj.weight"} & skipped
    held = dict(stage.named_parameters(remove_duplicate=False))
    assert held["model.layers.0.mlp.gate_proj.weight"] is layers[0].mlp.gate_proj.weight
    assert held["model.layers.1.self_attn.q_proj.weight"] is layers[1].self_attn.q_proj.weight
    ids = torch.randint(3, VOCAB, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], model(ids).logits, atol=1e-5, rtol=1e-5)


def test_mm_and_addmm_forms():
    """``mm(x, W.t())``, ``addmm(b, x, W.t())`` and Conv1D's ``addmm(b, x, W[in, out])`` fuse like ``linear``;
    a group of one is left as it is."""
    torch.manual_seed(0)
    root = torch.nn.Module()
    for name, shape in (("a", (32, 16)), ("b", (48, 16)), ("c", (16, 24)), ("d", (16, 40)), ("e", (20, 16))):
        root.register_parameter(name, torch.nn.Parameter(torch.randn(shape), requires_grad=False))
    for name, n in (("bc", 24), ("bd", 40)):
        root.register_buffer(name, torch.randn(n))
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    w = {n: g.get_attr(n) for n in ("a", "b", "c", "d", "e", "bc", "bd")}
    outs = [g.call_function(aten.mm.default, (x, g.call_function(aten.t.default, (w["a"],)))),
            g.call_function(aten.view.default, (g.call_function(aten.mm.default, (x, g.call_function(
                aten.t.default, (w["b"],)))), [1, 5, 6, 8])),  # a slice of the fused output: viewable as this
            g.call_function(aten.addmm.default, (w["bc"], x, w["c"])),
            g.call_function(aten.addmm.default, (w["bd"], x, w["d"])),
            g.call_function(aten.mm.default, (y, g.call_function(aten.t.default, (w["e"],))))]  # no sibling
    g.output(tuple(outs))
    gm = fx.GraphModule(root, g)
    inp = (torch.randn(5, 16), torch.randn(3, 16))
    expected = gm(*inp)
    report = fuse_projections(gm)
    assert [f.sizes for f in report.fused] == [(32, 48), (24, 40)] and report.skipped == ()
    assert [f.weight for f in report.fused] == ["fused_a_b.weight", "fused_c_d.weight"]
    assert sum(n.target in (aten.mm.default, aten.addmm.default) for n in gm.graph.nodes) == 3
    assert {n for n, _ in [*gm.named_parameters(), *gm.named_buffers()]} == {
        "e", "fused_a_b.weight", "fused_c_d.weight", "fused_c_d.bias"}
    assert torch.equal(gm.fused_a_b.weight, torch.cat([root.a, root.b]))  # [out, in]: stacked on dim 0
    assert torch.equal(gm.fused_c_d.weight, torch.cat([root.c, root.d], 1))  # [in, out]: side by side
    assert torch.equal(gm.fused_c_d.bias, torch.cat([root.bc, root.bd]))
    for got, want in zip(gm(*inp), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_compile_then_load_fuses_at_load(tmp_path, capsys):
    """The folder keeps the checkpoint's tensor names (no fused tensor in any file) and records the option;
    ``load`` fuses, ``load(..., fuse_projections=False)`` does not, and both equal HF."""
    from ppsplit.cli import main

    model, _ = model_and_trace("qwen2")
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "qwen2-pp2"
    assert main(["compile", str(tmp_path / "ckpt"), "--pp", "2", "--aux", "1", "--max-batch", "2", "--max-len", "40",
                 "--fuse-projections", "-o", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["stage_options"]["fuse_projections"] is True
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0 and "sibling projections fused at load" in capsys.readouterr().out
    hf_names = set(dict(model.named_parameters()))
    for k in range(2):
        with safe_open(out / f"stage_{k}.safetensors", framework="pt") as f:
            stored = set(f.keys())
        assert not any("fused_" in n for n in stored) and stored - {"model.rotary_emb.inv_freq"} <= hf_names

    fused, plain = ppsplit.load(str(out)), ppsplit.load(str(out), fuse_projections=False)
    assert linears(plain) - linears(fused) == 3 * L
    assert "model.layers.0.self_attn.fused_q_proj_k_proj_v_proj.bias" in dict(fused.stages[0].named_parameters())
    assert not any(".q_proj." in n or ".up_proj." in n for s in fused.stages for n, _ in s.named_parameters())
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
        ref = model(ids).logits
    torch.testing.assert_close(fused(ids, torch.arange(6))[0], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused.generate(ids, 8), expected)
    assert torch.equal(plain.generate(ids, 8), expected)


def test_option_is_validated():
    with pytest.raises(ppsplit.ConfigError, match="fuse_projections must be True or False or None"):
        ppsplit.SplitOptions(pp=1, fuse_projections="yes")
    with pytest.raises(ppsplit.ConfigError, match="gemv must be True or False, but"):
        ppsplit.SplitOptions(pp=1, gemv=None)


def test_default_fuses_on_cuda_only():
    """``fuse_projections`` left unset (``None``) fuses stages on CUDA devices, compiled or not, and leaves CPU
    stages as traced; ``True`` fuses everywhere. ``fuse_pointwise`` left unset stays off in compiled stages."""
    from ppsplit.passes.rewrites import apply_rewrites

    options = ppsplit.SplitOptions(pp=1).stage
    assert options.fuse_projections is None
    assert options.on("fuse_projections", torch.device("cuda")) and not options.on("fuse_projections",
                                                                                    torch.device("cpu"))
    compiled = ppsplit.SplitOptions(pp=1, compile=True).stage
    assert compiled.on("fuse_projections", torch.device("cuda")) and not compiled.on("fuse_projections",
                                                                                     torch.device("cpu"))
    assert not compiled.on("fuse_pointwise", torch.device("cuda"))
    assert ppsplit.SplitOptions(pp=1).stage.on("fuse_pointwise", torch.device("cuda"))
    assert ppsplit.SplitOptions(pp=1, compile=True, fuse_projections=True).stage.on("fuse_projections",
                                                                                    torch.device("cuda"))
    _, traced = model_and_trace("llama")
    assert "ppsplit.projections" not in ppsplit.split_model(traced, 1).stages[0].meta
    assert ppsplit.split_model(traced, 1, fuse_projections=True).stages[0].meta["ppsplit.projections"].fused
    # a CPU stage handed the CUDA device (what load passes for a stage it puts there) is fused by the default
    stage = ppsplit.split_model(traced, 1, fuse_projections=False).stages[0]
    apply_rewrites(stage, options, torch.device("cuda"))
    assert len(stage.meta["ppsplit.projections"].fused) == 2 * L


def bf16_errors(model32, device: str) -> tuple[float, float]:
    """The largest logit error against ``model32`` (fp32) of its bf16 copy split with and without fused
    projections, each over the fp32 reference's largest logit: (fused, separate)."""
    import copy

    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 12), device=device)
    with torch.no_grad():
        ref = model32.to(device)(ids).logits.double()
        errors = []
        for fuse in (True, False):
            model = copy.deepcopy(model32).to(device=device, dtype=torch.bfloat16)
            split = ppsplit.split_model(model, 2, aux=[1, 2], fuse_projections=fuse)
            assert bool(split.stages[0].meta.get("ppsplit.projections", None)) == fuse
            got = split(ids, torch.arange(12, device=device))[0].double()
            errors.append(float((got - ref).abs().max() / ref.abs().max()))
    return errors[0], errors[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_bf16_is_as_close_to_fp32_as_separate(device):
    """bf16 fused projections are not bit-equal to separate ones (another GEMM shape, another reduction order),
    so they are held to an fp32 reference instead: the fused split's largest logit error (over the largest
    logit) is below 2% and at most 1.5x the separate split's error + 0.2% (both are bf16 rounding)."""
    model32, _ = model_and_trace("llama")
    fused, separate = bf16_errors(model32, device)
    assert fused < 0.02 and fused <= 1.5 * separate + 0.002, (fused, separate)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_stages_on_gpu_bf16(arch):
    """bf16 on a GPU: a fused split's captured ragged bucket equals its eager call exactly, and the fused split's
    logits stay within bf16 rounding of the unfused split's (cuBLAS may pick another kernel for the wider GEMM)."""
    from tests.serve.test_cuda_graphs import ragged_replay_equals_eager

    model = tiny_model(arch).to(device="cuda", dtype=torch.bfloat16)
    ragged_replay_equals_eager(model, fuse_projections=True)
    cache = CacheConfig(batch_size=2, max_len=64)
    plain = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache, fuse_projections=False)
    fused = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache)  # the default on CUDA
    assert linears(plain) - linears(fused) == 3 * len(model.model.layers)
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 9), device="cuda")
    positions = torch.arange(9, device="cuda")
    with torch.no_grad():
        ref = plain(ids, positions)[0]
        got = fused(ids, positions)[0]
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)