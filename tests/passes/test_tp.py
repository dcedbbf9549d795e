"""The TP pass (ppsplit.passes.tp) in one process: ``split_model(model, pp=2, tp=2)`` on llama, qwen3, gemma2,
qwen3_moe, deepseek_v3 (MLA, MoE), qwen3_next and nemotron_h (hybrids). The ranks run in lockstep
(``run_ranks``: the all-reduces done in-process) through the stages; oracles: the Hugging Face model's logits and
``output_hidden_states``, and a slicing of its weights written here from the architectures' layouts, independent
of the pass. Refusals: heads that do not divide, a node the pass cannot place."""
import re

import pytest
import torch
from transformers import AutoConfig

import ppsplit
from ppsplit.core.errors import ConfigError
from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment
from ppsplit.passes.sharding.evaluate import run_ranks
from tests.support import random_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")
aten = torch.ops.aten
TP = 2
_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_hidden_layers=4,
            num_experts_per_tok=2)
CONFIGS = {
    "llama": lambda: tiny_config("llama", 4),
    "qwen3": lambda: tiny_config("qwen3", 4),
    "gemma2": lambda: tiny_config("gemma2", 4),
    "qwen3_moe": lambda: AutoConfig.for_model("qwen3_moe", **_MOE, num_experts=4, moe_intermediate_size=32,
                                              head_dim=16),
    "deepseek_v3": lambda: AutoConfig.for_model(
        "deepseek_v3", **dict(_MOE, num_key_value_heads=4), n_routed_experts=4, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1),
    "qwen3_next": lambda: AutoConfig.for_model(
        "qwen3_next", **_MOE, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "nemotron_h": lambda: AutoConfig.for_model(
        "nemotron_h", **{k: v for k, v in _MOE.items() if k != "num_experts_per_tok"}, head_dim=16,
        layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
        ssm_state_size=16, chunk_size=16),
}
TAPS = "0,2,4"


def rows(sizes=None):
    """Cut along dim 0 (the outputs), each of ``sizes(config)`` segments on its own."""
    return ("rows", sizes)


# Hand-written from each architecture's layout: how a weight is cut, by name (the first match wins; the rest are
# held whole). ``rows``: dim 0 in tp pieces (by segments where given); ``cols``: dim 1; ``experts``: dim 1 of a
# [E, 2I, H] gate_up stack by halves, ``experts_down``: dim 2 of [E, H, I].
def _mamba_in(c):
    i, gn = c.mamba_num_heads * c.mamba_head_dim, c.n_groups * c.ssm_state_size
    return (i, i, gn, gn, c.mamba_num_heads)


def _mamba_conv(c):
    i, gn = c.mamba_num_heads * c.mamba_head_dim, c.n_groups * c.ssm_state_size
    return (i, gn, gn)


def _delta_conv(c):
    k = c.linear_num_key_heads * c.linear_key_head_dim
    return (k, k, c.linear_num_value_heads * c.linear_value_head_dim)


LAYOUT = [
    (r"embed_tokens\.weight$|embeddings\.weight$|lm_head\.weight$", rows()),
    (r"(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|in_proj_qkvz|in_proj_ba)\.weight$", rows()),
    (r"(o_proj|down_proj|out_proj)\.weight$", ("cols", None)),
    (r"experts\.gate_up_proj$", ("experts", None)),
    (r"experts\.down_proj$", ("experts_down", None)),
    (r"mixer\.in_proj\.weight$", rows(_mamba_in)),
    (r"mixer\.conv1d\.(weight|bias)$", rows(_mamba_conv)),
    (r"linear_attn\.conv1d\.weight$", rows(_delta_conv)),
    (r"(mixer|linear_attn)\.(A_log|dt_bias|D)$", rows()),
    (r"mixer\.norm\.weight$", rows()),
]


def independent_piece(name: str, t: torch.Tensor, rank: int, config) -> torch.Tensor:
    rule = next((rule for pattern, rule in LAYOUT if re.search(pattern, name)), None)
    if rule is None:
        return t
    kind, sizes = rule
    if kind == "cols":
        return t.chunk(TP, 1)[rank]
    if kind == "experts":
        gate, up = t.chunk(2, 1)
        return torch.cat([gate.chunk(TP, 1)[rank], up.chunk(TP, 1)[rank]], 1)
    if kind == "experts_down":
        return t.chunk(TP, 2)[rank]
    parts = t.split(list(sizes(config)), 0) if sizes else [t]
    return torch.cat([p.chunk(TP, 0)[rank] for p in parts], 0)


_SPLITS: dict = {}


def sharded(arch: str):
    if arch not in _SPLITS:
        model = random_model(CONFIGS[arch](), seed=1)
        split = ppsplit.split_model(model, pp=2, tp=TP, aux=TAPS, cache=ppsplit.CacheConfig(2, 64))
        _SPLITS[arch] = model, split
    return _SPLITS[arch]


def lockstep_prefill(split, ids: list[int]):
    """Logits and aux of a prefill of ``ids`` through every stage, each stage's TP ranks run in lockstep; also
    every rank's output (they must agree: the output and taps are replicated)."""
    layout = CacheLayout.of(split.plan)
    step = RaggedStep.build([Segment(0, 0, len(ids))], {0: list(range(layout.blocks_per_seq))}, layout)
    x = torch.tensor(ids)
    aux = torch.zeros(split.plan.n_slots, len(ids), split.plan.hidden_size)
    outs = []
    for k in range(split.plan.pp):
        ranks = [r.stages[k] for r in split.ranks]
        got = run_ranks(ranks, (x, step.positions, aux, *step.tensors()[1:]))
        outs.append(got)
        x, aux = got[0]
    return x, aux, outs


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_ranks_compute_hf_and_hold_their_shard(arch):
    model, split = sharded(arch)
    assert split.plan.tp == TP and len(split.ranks) == TP and all(s.row > 0 for s in split.plan.sharded)
    ids = [5, 17, 3, 99, 42, 7, 64]
    with torch.no_grad():
        logits, aux, outs = lockstep_prefill(split, ids)
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=1e-4)
    for slot, tap in enumerate(int(t) for t in TAPS.split(",")):
        if tap < model.config.num_hidden_layers:
            torch.testing.assert_close(aux[slot], ref.hidden_states[tap][0], rtol=1e-4, atol=1e-5)
    for got in outs:  # every rank of a stage sends the same hidden state and taps
        for other in got[1:]:
            assert torch.equal(got[0][0], other[0]) and torch.equal(got[0][1], other[1])
    # each rank holds exactly its piece of each weight, as the layout table above cuts it
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    cut = 0
    for r, rank in enumerate(split.ranks):
        for stage in rank.stages:
            for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
                if name.startswith("kv_cache.") or name.endswith("vocab_start"):
                    continue
                want = independent_piece(name, state[name].detach(), r, model.config)
                assert torch.equal(t, want), f"rank {r}: {name} {tuple(t.shape)} is not its piece {tuple(want.shape)}"
                cut += want.shape != state[name].shape
    assert cut > 0
    for rank in split.ranks:  # norms, rotary tables and the router stay whole
        for stage in rank.stages:
            for name, t in stage.named_parameters():
                if re.search(r"(layernorm|\.norm)\.weight$|mlp\.gate\.weight$", name) and "mixer.norm" not in name:
                    assert t.shape == state[name].shape, name


def test_collectives_and_stage_structure():
    """llama, per stage: one all-reduce after each row-parallel product (attention and MLP of every layer) and the
    vocab-parallel lookup; the lm_head gathered once; every tap stored from an all-reduced value."""
    _, split = sharded("llama")
    c10d = torch.ops._c10d_functional
    for k, stage in enumerate(split.ranks[1].stages):
        nodes = list(stage.graph.nodes)
        reduces = [n for n in nodes if n.target is c10d.all_reduce.default]
        gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
        layers = split.plan.stages[k].num_layers
        assert len(reduces) == 2 * layers + (k == 0) and len(gathers) == (k == split.plan.pp - 1)
        assert split.plan.sharded[k].all_reduces == len(reduces)
        for n in nodes:
            if n.op == "call_function" and "store" in str(n.target):  # a tap store reads replicated values only
                for a in n.all_input_nodes:
                    assert a.op in ("placeholder", "get_attr") or _replicated(a), (n, a)
    assert "x tp=2 (4 ranks)" in split.plan.describe() and "per TP rank" in split.plan.describe()


def _replicated(node) -> bool:
    """A value computed from all-reduced values, the residual stream or inputs (no partial or split value)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n.op in ("placeholder", "get_attr"):
            continue
        seen.add(n)
        if n.target is torch.ops._c10d_functional.wait_tensor.default:
            continue
        if n.target in (aten.linear.default,):
            return False
        todo.extend(n.all_input_nodes)
    return True


def test_kv_heads_held_by_several_ranks_when_tp_exceeds_them():
    """llama with 2 KV heads at tp=4: each KV head on two ranks (vLLM's replication), the query heads split."""
    model = random_model(tiny_config("llama", 2), seed=2)
    split = ppsplit.split_model(model, pp=1, tp=4, cache=ppsplit.CacheConfig(2, 64))
    k = [r.stages[0].get_parameter("model.layers.0.self_attn.k_proj.weight") for r in split.ranks]
    q = [r.stages[0].get_parameter("model.layers.0.self_attn.q_proj.weight") for r in split.ranks]
    whole = model.model.layers[0].self_attn.k_proj.weight
    assert torch.equal(k[0], k[1]) and torch.equal(k[2], k[3]) and torch.equal(torch.cat([k[0], k[2]]), whole)
    assert q[0].shape[0] == model.model.layers[0].self_attn.q_proj.weight.shape[0] // 4 and not torch.equal(q[0], q[1])
    ids = [9, 8, 7, 6]
    logits, _, _ = lockstep_prefill(split, ids)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(torch.tensor([ids])).logits[0], rtol=1e-4, atol=1e-4)


def test_tp_rank_builds_one_rank():
    model = random_model(tiny_config("llama", 2), seed=3)
    one = ppsplit.split_model(model, pp=2, tp=2, tp_rank=1, cache=ppsplit.CacheConfig(2, 64))
    assert isinstance(one, ppsplit.SplitModel) and one.plan.tp == 2
    w = one.stages[0].get_parameter("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(w, model.model.layers[0].mlp.up_proj.weight.chunk(2, 0)[1])


def test_refusals():
    # KV heads that neither divide tp nor are divided by it
    cfg = tiny_config("llama", 2, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    with pytest.raises(ConfigError, match=r"--tp 2: .* 3 heads, and tp must divide them or be a multiple of them"):
        ppsplit.split_model(random_model(cfg), pp=1, tp=2, cache=ppsplit.CacheConfig(2, 64))
    # more ranks than query heads
    with pytest.raises(ConfigError, match=r"--tp 8: .* 4 query heads do not cut into 8 pieces; tp must divide the "
                                          r"query heads: 1, 2, 4"):
        ppsplit.split_model(random_model(tiny_config("llama", 2)), pp=1, tp=8, cache=ppsplit.CacheConfig(2, 64))
    for bad in (dict(tp=0), dict(tp=2, tp_rank=2), dict(tp=True)):
        with pytest.raises(ConfigError, match="tp"):
            ppsplit.SplitOptions(pp=1, **bad)


def test_a_node_it_cannot_place_is_refused_in_one_line():
    """A cumulative sum over the query heads (no TP rule reads a value split along the dim it scans) in a model
    whose tp plan makes q_proj column-parallel: refused, naming the node."""
    from ppsplit.passes.tp import shard_stage

    model = random_model(tiny_config("llama", 2), seed=4)
    stage = ppsplit.split_model(model, pp=1, cache=ppsplit.CacheConfig(2, 64)).stages[0]
    q = next(n for n in stage.graph.nodes if n.target is aten.linear.default
             and n.args[1].target == "model.layers.0.self_attn.q_proj.weight")
    with stage.graph.inserting_after(q):
        scan = stage.graph.call_function(aten.cumsum.default, (q, -1))
    q.replace_all_uses_with(scan, delete_user_cb=lambda u: u is not scan)
    stage.recompile()
    with pytest.raises(ConfigError) as e:
        shard_stage(stage, 2, model.config.base_model_tp_plan)
    message = str(e.value)
    assert "\n" not in message and "cumsum" in message and "q_proj column-parallel" in message
    # without a tp plan the pass keeps q_proj whole instead (exact, and reported)
    cut = shard_stage(stage, 2, None)
    assert "model.layers.0.self_attn.q_proj.weight" not in cut.shards
    assert "model.layers.0.self_attn.o_proj.weight" not in cut.shards
