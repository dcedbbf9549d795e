"""Driver: the MTP layers of a target checkpoint as an ``MTPDrafter`` for a split (``ppsplit.load_mtp``).

The first MTP layer's decoder block is traced by ppsplit's own passes: a two-layer copy of the target's config whose
layer 1 has the MTP layer's type (DeepSeek-V3: MLA + MoE; GLM-4.5: GQA + MoE; Qwen3-Next: full attention + MoE;
MiMo-V2-Flash: sliding-window attention with sinks + a dense MLP), split in two with the tap after layer 1, traced
over the split's ``CacheConfig``. Its stage 1 (layer 1, final norm, lm_head) is the block, filled with the MTP
layer's weights read through transformers' own conversions (per-expert tensors fused as the model keeps them) under
the names of layer 1 (DeepSeek: ``model.layers.{L}.*`` as ``model.layers.1.*``, ``shared_head.norm`` as
``model.norm``, ``shared_head.head`` as ``lm_head``; Qwen3-Next: ``mtp.layers.0.*``, ``mtp.norm``, the target's
``lm_head``; MiMo-V2-Flash: ``model.mtp.layers.0.*`` with ``pre_mlp_layernorm`` as ``post_attention_layernorm``,
``final_layernorm`` as ``model.norm``). Every tensor of the first MTP layer is used or refused; further layers are
left unused, as vLLM's proposer leaves them.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

import torch

from ppsplit.compile.checkpoint import Checkpoint
from ppsplit.compile.conversion import Sources, read_tensor
from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import is_cache_buffer
from ppsplit.core.options import CacheConfig, SplitOptions, StageOptions
from ppsplit.core.ragged import CacheLayout
from ppsplit.core.tensors import model_dtype, module_device
from ppsplit.eagle3.mtp import COUNT_KEYS, MTPDrafter


@dataclass(frozen=True)
class MTPLayout:
    """Where a model type keeps its first MTP layer, and how it differs (vLLM's ``*_mtp.py`` for each)."""

    prefix: str  # every MTP tensor's prefix ({L}: the target's layer count)
    block: str  # the decoder block's prefix
    own: dict  # role -> tensor name under ``prefix``: enorm, hnorm, eh_proj, norm; optional embed, head
    count: str  # config.json's number of MTP layers
    offset_norms: bool = False  # Qwen3-Next's norms scale by 1 + weight
    zero_first: bool = True  # position 0's embedding zeroed (vLLM deepseek_mtp.py, glm4_moe_mtp.py)
    feed_normed: bool = False  # a chain step reads the previous step's output after the MTP norm (qwen3_next_mtp.py)
    attention: str = "full_attention"  # the block's layer type (config.layer_types)
    mlp: str | None = None  # the block's MLP type (config.mlp_layer_types), when the config has one
    renames: tuple = ()  # (block tensor name, the same tensor's name in a target layer) pairs
    counted: str | None = None  # a config.json declaring no count: the MTP layers are the indices under this prefix


_DEEPSEEK = MTPLayout("model.layers.{L}.", "model.layers.{L}.", {
    "enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight", "norm": "shared_head.norm.weight",
    "embed": "embed_tokens.weight", "head": "shared_head.head.weight"}, "num_nextn_predict_layers")
_QWEN_NEXT = MTPLayout("mtp.", "mtp.layers.0.", {
    "enorm": "pre_fc_norm_embedding.weight", "hnorm": "pre_fc_norm_hidden.weight", "eh_proj": "fc.weight",
    "norm": "norm.weight"}, "mtp_num_hidden_layers", offset_norms=True, zero_first=False, feed_normed=True)
LAYOUTS = {  # each built and checked against a reference in tests/eagle3/test_mtp.py
    "deepseek_v3": _DEEPSEEK,
    "glm4_moe": _DEEPSEEK,  # GLM-4.5: the same layout and formula (vLLM glm4_moe_mtp.py)
    "qwen3_next": _QWEN_NEXT,
    # Qwen3.5 text checkpoints, dense and MoE: Qwen3-Next's layout and formula (vLLM qwen3_5_mtp.py)
    "qwen3_5_text": _QWEN_NEXT,
    "qwen3_5_moe_text": _QWEN_NEXT,
    # MiMo-V2-Flash (vLLM mimo_v2_mtp.py): a sliding-window attention layer with a dense MLP, its post-attention norm
    # named pre_mlp_layernorm, final_layernorm as its norm, the target's embedding and lm_head, no position zeroed,
    # the output after final_layernorm fed back
    "mimo_v2_flash": MTPLayout("model.mtp.layers.0.", "model.mtp.layers.0.", {
        "enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
        "norm": "final_layernorm.weight"}, "num_nextn_predict_layers", zero_first=False, feed_normed=True,
        attention="sliding_attention", mlp="dense", renames=(("pre_mlp_layernorm.", "post_attention_layernorm."),),
        counted="model.mtp.layers."),
}
# model types whose MTP layers need modeling code transformers does not have: refused, with the reason
REFUSED = {"mimo": "MiMo-7B's MTP layers (model.mtp_layers.*) run on its own modeling code (MiMoForCausalLM, "
                   "shipped in the checkpoint folder, not in transformers), and ppsplit never runs code from a "
                   "folder, so it cannot draft with them"}
REQUIRED = ("enorm", "hnorm", "eh_proj", "norm")


def mtp_layers(cfg: dict) -> int:
    """How many MTP layers a target ``config.json`` (a dict) declares; 0 when none."""
    for key in (*COUNT_KEYS, "mtp_num_hidden_layers"):
        if key in cfg:
            n = cfg[key]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ConfigError(f"config.json's {key} must be a number of MTP layers >= 0, but is {n!r}")
            return n
    return 0


def load_mtp(model: str, split, device=None) -> MTPDrafter:
    """The first MTP layer of checkpoint folder ``model`` (DeepSeek-V3 / GLM-4.5: ``num_nextn_predict_layers`` > 0,
    weights under ``model.layers.{L}``; Qwen3-Next: ``mtp_num_hidden_layers``, under ``mtp.``; MiMo-V2-Flash: under
    ``model.mtp.layers.0``) as a drafter for ``split``, which must carry tap ``L`` (the last layer's output) and a
    paged cache; on the last stage's device.
    Refused in one line, before anything is traced: another model type, no MTP layers, a split without tap ``L`` or
    a paged cache, a missing or unknown MTP tensor.

    Example::

        split = ppsplit.split_model(model, 2, aux=[model.config.num_hidden_layers], cache=ppsplit.CacheConfig(8, 4096))
        drafter = ppsplit.load_mtp("DeepSeek-V3", split=split)
        ppsplit.Engine(split, drafter=drafter, num_draft_tokens=2).generate(prompts, params)
    """
    from ppsplit.passes.rewrites import apply_rewrites

    device = torch.device(device) if device is not None else module_device(split.stages[-1])
    drafter = _build(model, split.plan, device)
    apply_rewrites(drafter.block, StageOptions(), device=device)
    return drafter


def mtp_checkpoint(model: str) -> tuple[str, dict, MTPLayout, int]:
    """``(folder, config.json, layout, MTP layer count)`` of checkpoint ``model``, or one ``ConfigError`` when it
    has no MTP layers ppsplit can run (what ``ppsplit compile --mtp`` checks before tracing the target)."""
    from ppsplit.compile.source import resolve_model

    folder = resolve_model(model)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {folder}/config.json ({e}); pass the target's checkpoint folder") from None
    kind = raw.get("model_type")
    if kind in REFUSED:
        raise ConfigError(f"{REFUSED[kind]} (model_type {kind!r})")
    if kind not in LAYOUTS:
        raise ConfigError(f"MTP layers of model_type {kind!r} are not supported (supported: {', '.join(LAYOUTS)})")
    layout = LAYOUTS[kind]
    if raw.get("mtp_use_dedicated_embeddings"):
        raise ConfigError("mtp_use_dedicated_embeddings: true (an MTP layer with its own embedding) is not supported")
    quant = raw.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        raise ConfigError(f"{model}: MTP layers of an MXFP4 checkpoint are not supported (FP8 ones are)")
    n = mtp_layers(raw)
    if layout.counted and not any(key in raw for key in (*COUNT_KEYS, "mtp_num_hidden_layers")):
        n = _counted_layers(folder, layout.counted)
    if n == 0:
        raise ConfigError(f"{model} has no MTP layers (config.json's {layout.count} is 0 or absent)")
    return folder, raw, layout, n


def _counted_layers(folder: str, prefix: str) -> int:
    """How many MTP layers the checkpoint in ``folder`` holds under ``prefix`` (``prefix`` + index + ``.``), for a
    config that declares none (vLLM and SGLang read MiMo-V2-Flash's first layer without a count)."""
    indices = {key[len(prefix):].split(".", 1)[0] for key in Checkpoint(folder).where if key.startswith(prefix)}
    return len({i for i in indices if i.isdigit()})


def _build(model: str, plan, device) -> MTPDrafter:
    """The drafter of checkpoint ``model`` for ``plan`` on ``device``, its block as traced (no stage rewrites)."""
    from ppsplit.compile.quantized import read_scheme
    from ppsplit.compile.source import load_config

    folder, raw, layout, n = mtp_checkpoint(model)
    layers = raw["num_hidden_layers"]
    if plan.num_layers != layers:
        raise ConfigError(f"the split has {plan.num_layers} layers but {model} has {layers}; load the MTP layers of "
                          "the split's own checkpoint")
    _check_tap(plan)
    cache = CacheLayout.of(plan)
    checkpoint = Checkpoint(folder)
    prefix, block_prefix = layout.prefix.format(L=layers), layout.block.format(L=layers)
    config = load_config(folder)
    keys = _layer_keys(checkpoint, config, layout, n)
    scheme = read_scheme(config, model)
    dtype = model_dtype(plan)
    block = _load_block(_trace_block(config, layout, plan, dtype), checkpoint, layout, prefix, block_prefix, keys,
                        config, dtype, device, scheme)
    own = {role: _own_tensor(checkpoint, prefix + name, scheme) for role, name in layout.own.items()
           if prefix + name in checkpoint}
    drafter = MTPDrafter(block, config.hidden_size, config.vocab_size, config.rms_norm_eps, layers,
                         plan.taps.index(layers), cache, offset_norms=layout.offset_norms,
                         zero_first=layout.zero_first, feed_normed=layout.feed_normed)
    state = {"target_norm.weight": read_tensor(checkpoint, "model.norm.weight"),
             "embed_tokens": own.get("embed", None), "enorm.weight": own["enorm"], "hnorm.weight": own["hnorm"],
             "eh_proj.weight": own["eh_proj"]}
    if state["embed_tokens"] is None:
        state["embed_tokens"] = read_tensor(checkpoint, "model.embed_tokens.weight")
    if layout.feed_normed:
        state["norm.weight"] = own["norm"]
    try:
        drafter.fill(state)
    except ConfigError as e:
        raise ConfigError(f"{model}: {e}; the checkpoint does not match its config.json") from None
    return drafter.placed(device, dtype)


def write_mtp(folder: str, model: str, split) -> None:
    """Store the first MTP layer of checkpoint ``model`` for ``split`` (the compile's skeleton) in
    ``folder/mtp``: the block's traced program and tensors as a stage's are stored, and the drafter's own
    tensors and settings (``ppsplit.eagle3.mtp.load_folder_mtp`` reads them back)."""
    _store(folder, _build(model, split.plan, torch.device("cpu")), split)


def _store(folder: str, drafter: MTPDrafter, split) -> None:
    """``drafter`` (its block as traced) in ``folder/mtp``: the block as a stage is stored, its own tensors and
    settings beside it."""
    from safetensors.torch import save_file

    from ppsplit.artifact.folder import MTP, MTP_BLOCK, MTP_BLOCK_WEIGHTS, MTP_OWN_WEIGHTS, fingerprint, write_json
    from ppsplit.artifact.program import graph_to_json
    from ppsplit.compile.checkpoint import write_safetensors
    from ppsplit.core.tensors import dtype_name

    block = drafter.block
    persistent = set(block.state_dict().keys())
    specs, stored = [], []
    for kind, items in (("parameter", block.named_parameters(remove_duplicate=False)),
                        ("buffer", block.named_buffers(remove_duplicate=False))):
        for name, t in items:
            init = "zeros" if is_cache_buffer(name) else "file"
            specs.append({"name": name, "kind": kind, "shape": list(t.shape), "dtype": dtype_name(t.dtype),
                          "persistent": kind == "parameter" or name in persistent, "init": init})
            if init == "file":
                stored.append((name, t.detach().contiguous()))
    path = os.path.join(folder, MTP)
    os.makedirs(path)
    write_json(os.path.join(path, MTP_BLOCK), {"stage": split.plan.pp, "plan_sha256": fingerprint(split.plan.to_json()),
                                               "tensors": specs, "program": graph_to_json(block.graph)})
    write_safetensors(os.path.join(path, MTP_BLOCK_WEIGHTS), [(n, tuple(t.shape), t.dtype) for n, t in stored],
                      iter(stored), metadata={"format": "pt", "ppsplit_stage": "mtp"})
    write_json(os.path.join(path, "config.json"), drafter.settings())
    save_file(drafter.own_tensors(), os.path.join(path, MTP_OWN_WEIGHTS), metadata={"format": "pt"})


def _layer_keys(checkpoint: Checkpoint, config, layout: MTPLayout, n: int) -> list[str]:
    """The checkpoint keys of the first MTP layer (the one drafting; vLLM's proposer runs only it), checked before
    any tracing: its own tensors present, and its decoder block holding exactly the tensors of the target's last
    layer of the MTP layer's type (``_expected_block``), so a missing expert or an unknown tensor is named here;
    MiMo-V2-Flash: no tensor under ``model.mtp.`` outside a layer. Further MTP layers (DeepSeek:
    ``model.layers.{L + 1}``; MiMo-V2-Flash: ``model.mtp.layers.1..``) are left unused."""
    layers = config.num_hidden_layers
    prefix, block_prefix = layout.prefix.format(L=layers), layout.block.format(L=layers)
    mine = sorted(key for key in checkpoint.where if key.startswith(prefix))
    for role in REQUIRED:
        if prefix + layout.own[role] not in mine:
            raise ConfigError(f"config.json declares {n} MTP layer(s) but the checkpoint has no "
                              f"{prefix}{layout.own[role]}; the MTP weights are missing (a checkpoint saved without "
                              "them cannot draft)")
    own = {prefix + name for name in layout.own.values()}
    own |= {key[:-len("weight")] + suffix for key in own for suffix in _SCALES} & set(mine)  # read with their weight
    stray = [key for key in mine if key not in own and not key.startswith(block_prefix)]
    if layout.prefix == "mtp." and stray:  # DeepSeek's further layers live under model.layers.{L + 1}, not here
        raise ConfigError(f"the MTP layer has tensors ppsplit does not account for: {', '.join(stray[:4])}; ppsplit "
                          "refuses to drop them (only the first MTP layer drafts)")
    if layout.counted:  # MiMo-V2-Flash: every tensor under model.mtp. belongs to a layer model.mtp.layers.N
        root = layout.counted[:layout.counted.index("layers.")]
        stray = [key for key in checkpoint.where if key.startswith(root) and not (key.startswith(layout.counted)
                 and key[len(layout.counted):].split(".", 1)[0].isdigit())]
        if stray:
            raise ConfigError(f"the checkpoint has MTP tensors outside its layers ({', '.join(sorted(stray)[:4])}) "
                              "that ppsplit does not account for; it refuses to drop them")
    expected = _expected_block(checkpoint, config, layout)
    if expected is None:
        return mine
    block = {_as_layer(key[len(block_prefix):], layout) for key in mine if key.startswith(block_prefix)
             and key not in own}
    if block != set(expected):
        missing, unknown = sorted(set(expected) - block), sorted(block - set(expected))
        if missing:
            raise ConfigError(f"the MTP layer lacks {block_prefix}{_as_block(missing[0], layout)}" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + ", which its decoder "
                              f"block needs (as {expected[missing[0]]}); the MTP weights are incomplete")
        raise ConfigError(f"the MTP layer has tensors a decoder layer of the target does not account for: "
                          f"{', '.join(block_prefix + _as_block(u, layout) for u in unknown[:4])}; ppsplit refuses "
                          "to drop them")
    return [key for key in mine if key.startswith(block_prefix) and key not in own]


def _expected_block(checkpoint: Checkpoint, config, layout: MTPLayout) -> dict[str, str] | None:
    """The tensors the MTP block must hold, by name under a layer's prefix, each with the target tensor of that name
    it is checked against: those of the target's last layer of the block's type (attention type, MoE from
    ``first_k_dense_replace`` on); with ``layout.mlp``, the MLP's from the last layer of that MLP type (MiMo-V2-Flash:
    a sliding-window layer's attention, layer 0's dense MLP). None when the target has no such layer."""
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    first = getattr(config, "first_k_dense_replace", 0)
    same = [i for i in range(layers) if types[i] == layout.attention and i >= first]
    mlps = getattr(config, "mlp_layer_types", None) or []
    mlp = [i for i in range(len(mlps)) if mlps[i] == layout.mlp] if layout.mlp else same
    if not same or not mlp:
        return None
    expected = {}
    for i, is_mlp in ((same[-1], False), (mlp[-1], True)):
        last = f"model.layers.{i}."
        expected.update({key[len(last):]: key for key in checkpoint.where
                         if key.startswith(last) and key[len(last):].startswith("mlp.") == is_mlp})
    return expected


def _as_layer(name: str, layout: MTPLayout) -> str:
    """A block tensor's name under the MTP layer's prefix as a target layer names it (``layout.renames``)."""
    for mine, theirs in layout.renames:
        if name.startswith(mine):
            return theirs + name[len(mine):]
    return name


def _as_block(name: str, layout: MTPLayout) -> str:
    """``_as_layer`` undone: a target layer's tensor name as the MTP layer names it."""
    for mine, theirs in layout.renames:
        if name.startswith(theirs):
            return mine + name[len(theirs):]
    return name


_SCALES = ("weight_scale_inv", "weight_scale")  # an FP8 weight's scale beside it (fp8; compressed-tensors)


def _own_tensor(checkpoint: Checkpoint, key: str, scheme) -> torch.Tensor:
    """One of the MTP layer's own tensors (``enorm``, ``eh_proj``, ...), which the drafter holds in the model dtype:
    as stored, or an FP8 one (some checkpoints quantise ``eh_proj``; DeepSeek-V3 ships it in BF16) dequantised with
    its scale, as a stage's FP8 weight that cannot stay FP8 is."""
    from ppsplit.compile.quantized import check_pair, dequantized, exponent_values, is_exponents

    raw = checkpoint.raw_range(key)
    if not raw.dtype.startswith("F8"):
        return read_tensor(checkpoint, key)
    scale_key = key[:-len("weight")] + (scheme.suffix if scheme is not None else _SCALES[0])
    if scheme is None or scheme.method == "mxfp4" or scale_key not in checkpoint:
        raise ConfigError(f"the checkpoint stores the MTP layer's {key} in {raw.dtype} without a {scale_key} and "
                          "a quantization_config saying how to scale it; the checkpoint is incomplete")
    stored = checkpoint.raw_range(scale_key)
    check_pair(key, raw.shape, scale_key, stored, scheme)
    scale = read_tensor(checkpoint, scale_key)
    scale = exponent_values(scale) if scheme.exponents and is_exponents(stored.dtype) else scale.float()
    return dequantized(read_tensor(checkpoint, key), scale, scheme, torch.float32)


def _mini_config(config, layout: MTPLayout):
    """The target's config cut to two layers, layer 1 of the type of layer ``L`` (the MTP layer's)."""
    mini = copy.deepcopy(config)
    layers = config.num_hidden_layers
    mini.num_hidden_layers = 2
    for key in COUNT_KEYS:
        if hasattr(mini, key):
            setattr(mini, key, 0)
    if hasattr(config, "first_k_dense_replace"):  # DeepSeek, GLM: MoE from this layer on; the MTP layer is at L
        mini.first_k_dense_replace = 1 if layers >= config.first_k_dense_replace else 2
    if getattr(config, "layer_types", None):  # Qwen3-Next: full attention; MiMo-V2-Flash: sliding window
        mini.layer_types = [layout.attention, layout.attention]
    if layout.mlp:  # MiMo-V2-Flash: a dense MLP
        mini.mlp_layer_types = [layout.mlp, layout.mlp]
    return mini


def _trace_block(config, layout: MTPLayout, plan, dtype):
    """Stage 1 of the two-layer copy, traced over ``plan``'s cache, its weights on the meta device."""
    from ppsplit.compile.api import split_model
    from ppsplit.compile.source import skeleton

    cache = CacheConfig(plan.max_batch, plan.max_len, state_slots=max(1, plan.state_slots),
                        block_size=plan.block_size, num_blocks=plan.num_blocks)
    model, _ = skeleton(_mini_config(config, layout), dtype)
    off = StageOptions(fuse_projections=False, fuse_pointwise=False, gemv=False, compile=False)
    mini = split_model(model, options=SplitOptions(pp=2, aux=[2], balance=[1, 1], cache=cache, stage=off))
    return mini.stages[1]


class _Renamed:
    """A checkpoint seen under other names (``{name: checkpoint key}``): what ``Sources`` and ``read_tensor`` read."""

    def __init__(self, checkpoint: Checkpoint, names: dict[str, str]):
        self.checkpoint, self.names = checkpoint, names
        self.where = {name: checkpoint.where[key] for name, key in names.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def raw_range(self, name: str):
        return self.checkpoint.raw_range(self.names[name])

    def read_one(self, name: str) -> torch.Tensor:
        return self.checkpoint.read_one(self.names[name])


def _load_block(stage, checkpoint: Checkpoint, layout: MTPLayout, prefix: str, block_prefix: str, keys: list[str],
                config, dtype, device, scheme=None, head: torch.Tensor | None = None):
    """``stage`` (weights on meta) filled with the MTP layer: its block tensors (``keys``, under ``block_prefix``) as
    layer 1's, its norm as the final norm, its head (or the target's ``lm_head``; ``head`` when given: a checkpoint
    without the target's tensors) as the head. With ``scheme`` (an FP8 checkpoint) its linears run on their FP8
    weights and scales as stored, through the pass the compile's stages go through (``quantize_stage``); a weight
    that pass leaves is dequantised, as a stage's is."""
    from ppsplit.compile.checkpoint import ST_DTYPES
    from ppsplit.compile.source import skeleton
    from ppsplit.compile.writer import quantize_stage

    names = {"model.layers.1." + _as_layer(key[len(block_prefix):], layout): key for key in keys}
    names["model.norm.weight"] = prefix + layout.own["norm"]
    if head is None:
        own_head = prefix + layout.own["head"] if "head" in layout.own else None
        names["lm_head.weight"] = own_head if own_head in checkpoint else "lm_head.weight"
    # buffers: what the model computes in __init__ (rotary, ...); tensors converted straight to the split's dtype
    model, buffers = skeleton(_mini_config(config, layout), dtype)
    view = _Renamed(checkpoint, names)
    sources = Sources(model, view, scheme)
    used = {key for group in sources.groups.values() for key, _ in group.sources} | set(sources.scales.values())
    unknown = sorted(names[name] for name in names if name not in used)
    if unknown:
        raise ConfigError(f"the MTP layer has tensors a decoder layer of {config.model_type} does not account for: "
                          f"{', '.join(unknown[:4])}; ppsplit refuses to drop them")
    if scheme is not None:
        quantize_stage(stage, sources)
    values = {}
    for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
        group = sources.group_of(name)
        key = group is not None and sources.plain_source(group)
        if is_cache_buffer(name):
            values[name] = torch.zeros(t.shape, dtype=t.dtype)
        elif key and view.raw_range(key).dtype == ST_DTYPES.get(t.dtype):  # kept as stored (FP8 weights, their scales)
            values[name] = read_tensor(view, key)
        elif group is not None:
            values[name] = sources.run(group)[name]
        elif name == "lm_head.weight" and head is not None:
            values[name] = head
        elif name in buffers:
            values[name] = buffers[name]
        else:
            raise ConfigError(f"the checkpoint has no tensor that becomes {name} of the MTP layer at {prefix[:-1]}; "
                              "the MTP weights are incomplete")
    stage = stage.to_empty(device=device)
    with torch.no_grad():
        for name, value in values.items():
            target = stage.get_parameter(name) if name in dict(stage.named_parameters()) else stage.get_buffer(name)
            target.copy_(value.to(target.dtype))
    return stage


# -- speculators' ``mtp`` layout (``MTPSpeculatorConfig`` / ``MTPDraftModel``; ``MTPConverter`` writes it) ----------
# speculators 0.9.0's MTP layer classes (``models/mtp/model_definitions.py: mtp_model_classes``); a folder's
# ``transformer_layer_config.model_type`` is one of them. Its formula is Qwen3-Next's (vLLM loads a qwen3_next one as
# ``Qwen3NextMTP``): ``final_layernorm(layer(input_proj(cat(token_layernorm(embed(t[i+1])), hidden_layernorm(h)))))``
# then the verifier's ``lm_head``, the normed output fed to the next step, no zeroed position; norms of the model
# type's own class (Qwen3: ``weight * x``; the others: ``(1 + weight) * x``).
SPECULATORS_MTP_TYPES = ("qwen3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_SPECULATORS_OWN = {"enorm": "token_layernorm.weight", "hnorm": "hidden_layernorm.weight",
                    "eh_proj": "input_proj.weight", "norm": "final_layernorm.weight"}
_SPECULATORS_PREFIX = "mtp_layers.0."
# Top-level config keys: read, or inert (written by save_pretrained, or what the engine decides: the number of drafts
# is ``num_draft_tokens``; the verifier is the split, whose embedding and head the layer uses).
_SPECULATORS_READ = ("speculators_model_type", "speculators_config", "transformer_layer_config",
                     "num_nextn_predict_layers")
_SPECULATORS_INERT = ("architectures", "auto_map", "dtype", "torch_dtype", "speculators_version",
                      "transformers_version", "tie_word_embeddings")
_SPECULATORS_CONFIG = {"algorithm": "read", "proposal_methods": "inert", "default_proposal_method": "inert",
                       "verifier": "inert"}
# Tensors speculators replaces with the verifier's on load (``load_verifier_weights``; ``MTPConverter`` writes a NaN
# ``verifier_lm_head.weight``): ppsplit uses the split's embedding and head instead.
_SPECULATORS_VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")


def is_speculators_mtp(cfg: dict) -> bool:
    """Whether a drafter ``config.json`` (a dict) is speculators' ``mtp`` layout."""
    return cfg.get("speculators_model_type") == "mtp"


def speculators_mtp_config(cfg: dict, where: str):
    """The transformers config of the MTP layer of speculators config ``cfg``, every key checked: read, known inert,
    or refused naming it."""
    from transformers import AutoConfig

    unknown = sorted(set(cfg) - set(_SPECULATORS_READ) - set(_SPECULATORS_INERT))
    if unknown:
        raise ConfigError(f"{where}: speculators' mtp config has {unknown[0]!r}, which ppsplit does not know; remove "
                          f"it or use a folder written by speculators 0.9 (keys: {', '.join(_SPECULATORS_READ)})")
    if cfg.get("num_nextn_predict_layers", 1) != 1:
        raise ConfigError(f"{where}: num_nextn_predict_layers is {cfg['num_nextn_predict_layers']!r}; speculators' mtp "
                          "layout holds one MTP layer (1)")
    spec = cfg.get("speculators_config") or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: speculators_config must be an object, but is {spec!r}")
    unknown = sorted(set(spec) - set(_SPECULATORS_CONFIG))
    if unknown:
        raise ConfigError(f"{where}: speculators_config has {unknown[0]!r}, which ppsplit does not know; remove it")
    if spec.get("algorithm", "mtp") != "mtp":
        raise ConfigError(f"{where}: speculators_config.algorithm is {spec['algorithm']!r}, but the folder is an mtp "
                          "one (speculators_model_type 'mtp')")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type") not in SPECULATORS_MTP_TYPES:
        kind = layer.get("model_type") if isinstance(layer, dict) else layer
        raise ConfigError(f"{where}: transformer_layer_config.model_type is {kind!r}; speculators' mtp layout holds "
                          f"layers of {', '.join(SPECULATORS_MTP_TYPES)}")
    try:
        return AutoConfig.for_model(**layer)
    except Exception as e:  # transformers' validators raise their own types
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()[:160]
        raise ConfigError(f"{where}: transformers cannot read transformer_layer_config ({first})") from None


def final_norm(split) -> torch.Tensor:
    """The target's final norm weight on the last stage (``model.norm.weight``): the first MTP step reads tap ``L``
    through it."""
    stage = split.stages[-1]
    weight = dict(stage.named_parameters()).get("model.norm.weight")
    if weight is None:
        raise ConfigError("the split's last stage has no model.norm.weight (the target's final norm, which an MTP "
                          "layer reads the last hidden state through); this target is not supported")
    return weight.detach()


def load_speculators_mtp(folder: str, split, device=None) -> MTPDrafter:
    """The MTP layer of a speculators ``mtp`` folder (``MTPDraftModel.save_pretrained``, ``MTPConverter``) as a
    drafter for ``split`` (tap ``L``, paged cache), using the split's embedding, final norm and ``lm_head`` as
    speculators uses the verifier's. Refused in one line before tracing: an unknown key, a model type speculators
    has no MTP class for, a layer config that is not the split's target, a missing or unknown tensor."""
    from ppsplit.eagle3.dflash import output_head
    from ppsplit.eagle3.formats import embedding_name
    from ppsplit.passes.rewrites import apply_rewrites

    plan = split.plan
    _check_tap(plan)
    stage0 = split.stages[0]
    name = embedding_name(split)
    embed = dict(stage0.named_parameters()).get(name)
    embed = (embed if embed is not None else stage0.get_buffer(name)).detach()
    head = output_head(split)
    config, checkpoint, keys = speculators_mtp_folder(folder, plan.num_layers, plan.hidden_size, embed.shape[0])
    device = torch.device(device) if device is not None else module_device(split.stages[-1])
    drafter = _speculators_drafter(folder, config, checkpoint, keys, plan, embed.cpu(), final_norm(split).cpu(),
                                   head.cpu(), device)
    apply_rewrites(drafter.block, StageOptions(), device=device)
    return drafter


def _check_tap(plan) -> None:
    """An MTP layer reads tap ``L``: refuse a plan without it."""
    layers = plan.num_layers
    if layers not in plan.taps:
        raise ConfigError(f"MTP reads tap {layers} (the last layer's output) but the split carries "
                          f"{list(plan.taps)}; split with aux including {layers}")


def speculators_mtp_folder(folder: str, layers: int, hidden: int, vocab: int):
    """``(layer config, checkpoint, block tensor keys)`` of speculators ``mtp`` folder ``folder`` for a target of
    ``layers`` x ``hidden`` and vocabulary ``vocab``: its config and tensor names checked, no tensor data read."""
    where = os.path.join(folder, "config.json")
    try:
        with open(where) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {where} ({e}); pass a speculators mtp folder") from None
    config = speculators_mtp_config(cfg, where)
    if (config.num_hidden_layers, config.hidden_size) != (layers, hidden):
        raise ConfigError(f"{where}: the MTP layer is for a target of {config.num_hidden_layers} layers x hidden "
                          f"{config.hidden_size}, but the split's has {layers} x {hidden}; use the MTP layer of this "
                          "target")
    if config.vocab_size != vocab:
        raise ConfigError(f"{where}: the MTP layer's vocabulary ({config.vocab_size}) is not the target's "
                          f"({vocab}); use the MTP layer of this target")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")) \
            and not os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        raise ConfigError(f"{folder} has no model.safetensors; a speculators mtp folder holds its layer there")
    checkpoint = Checkpoint(folder)
    own = {_SPECULATORS_PREFIX + n for n in _SPECULATORS_OWN.values()}
    for key in sorted(own):
        if key not in checkpoint:
            raise ConfigError(f"{folder} has no {key}; the MTP layer is incomplete")
    stray = sorted(k for k in checkpoint.where if not k.startswith(_SPECULATORS_PREFIX)
                   and k not in _SPECULATORS_VERIFIER_TENSORS)
    if stray:
        raise ConfigError(f"{folder} has tensors speculators' mtp layout does not hold: {', '.join(stray[:4])}; "
                          "ppsplit refuses to drop them")
    keys = sorted(k for k in checkpoint.where if k.startswith(_SPECULATORS_PREFIX) and k not in own)
    return config, checkpoint, keys


def _speculators_drafter(folder, config, checkpoint, keys, plan, embed, norm, head, device) -> MTPDrafter:
    """The drafter of a checked speculators folder with the target's ``embed``, final ``norm`` and ``head`` (CPU
    tensors), placed on ``device``, its block as traced (no stage rewrites)."""
    layout = MTPLayout(_SPECULATORS_PREFIX, _SPECULATORS_PREFIX, _SPECULATORS_OWN, "num_nextn_predict_layers",
                       offset_norms=config.model_type != "qwen3", zero_first=False, feed_normed=True)
    dtype = model_dtype(plan)
    block = _load_block(_trace_block(config, layout, plan, dtype), checkpoint, layout, _SPECULATORS_PREFIX,
                        _SPECULATORS_PREFIX, keys, config, dtype, device, head=head)
    layers = plan.num_layers
    drafter = MTPDrafter(block, config.hidden_size, config.vocab_size, config.rms_norm_eps, layers,
                         plan.taps.index(layers), CacheLayout.of(plan), offset_norms=layout.offset_norms,
                         zero_first=False, feed_normed=True)
    read = lambda role: read_tensor(checkpoint, _SPECULATORS_PREFIX + _SPECULATORS_OWN[role])  # noqa: E731
    try:
        drafter.fill({"target_norm.weight": norm, "embed_tokens": embed, "enorm.weight": read("enorm"),
                      "hnorm.weight": read("hnorm"), "eh_proj.weight": read("eh_proj"), "norm.weight": read("norm")})
    except ConfigError as e:
        raise ConfigError(f"{folder}: {e}; the folder does not match its config.json") from None
    return drafter.placed(device, dtype)


def speculators_mtp_source(drafter: str) -> str | None:
    """The folder of ``drafter`` (a path or hub id) when it is speculators' ``mtp`` layout, else None (another
    family: ``ppsplit.eagle3.formats`` reads it and says what is wrong)."""
    from ppsplit.eagle3.formats import resolve_drafter

    folder = resolve_drafter(drafter)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return folder if isinstance(cfg, dict) and is_speculators_mtp(cfg) else None


def check_compiled_speculators_mtp(folder: str, config, convention: str | None) -> int:
    """What ``ppsplit compile --drafter`` checks of speculators ``mtp`` folder ``folder`` for target ``config``
    before tracing; returns the tap it reads (``L``)."""
    if convention is not None:
        raise ConfigError("an MTP drafter reads tap L (the last layer's output) under any numbering; leave out "
                          "--drafter-convention")
    speculators_mtp_folder(folder, config.num_hidden_layers, config.hidden_size, config.vocab_size)
    return config.num_hidden_layers


def write_speculators_mtp(out: str, folder: str, split, checkpoint: Checkpoint, tied: dict) -> None:
    """Store the MTP layer of speculators ``mtp`` folder ``folder`` in ``out/mtp`` as ``write_mtp`` stores a
    checkpoint's own (``ppsplit compile --drafter``): the target's embedding, final norm and head it uses are read
    from the target's ``checkpoint`` (``split`` is the compile's skeleton, weights on meta)."""
    from ppsplit.eagle3.dflash import output_head_name
    from ppsplit.eagle3.formats import embedding_name

    plan = split.plan
    final_norm(split)  # a target without model.norm.weight: its one-line refusal
    read = lambda name: read_tensor(checkpoint, next((n for n in tied.get(name, ()) if n in checkpoint), name))  # noqa: E731
    embed, head = read(embedding_name(split)), read(output_head_name(split))
    config, layer, keys = speculators_mtp_folder(folder, plan.num_layers, plan.hidden_size, embed.shape[0])
    drafter = _speculators_drafter(folder, config, layer, keys, plan, embed, read("model.norm.weight"), head,
                                   torch.device("cpu"))
    _store(out, drafter, split)


def load_drafter(path_or_hub_id: str, split=None, aux_convention: str | None = None, device=None,
                 compile: bool = False):
    """``ppsplit.load_drafter``: a drafter folder (or hub id) for ``split``, on its last stage's device. EAGLE-3,
    DFlash, DFlash2 and DSpark folders are read by ``ppsplit.eagle3.formats.load_drafter`` (see there for the
    formats and ``aux_convention`` / ``compile``); speculators' ``mtp`` folders load here, because their decoder
    block is traced by the passes as ``load_mtp``'s is (``load_speculators_mtp``).

    Example::

        L = model.config.num_hidden_layers
        split = ppsplit.split_model(model, pp=2, aux=[L], cache=ppsplit.CacheConfig(8, 4096))
        drafter = ppsplit.load_drafter("path/to/qwen3-next-mtp", split=split)   # speculators_model_type "mtp"
    """
    from ppsplit.eagle3 import formats

    folder = speculators_mtp_source(path_or_hub_id) if split is not None else None
    if folder is not None:
        if aux_convention is not None:
            raise ConfigError("an MTP drafter reads tap L (the last layer's output) under any numbering; leave "
                              "aux_convention (--drafter-convention) out")
        if compile:
            raise ConfigError("compile=True compiles EAGLE-3 and DFlash drafters; an MTP layer runs as traced: "
                              "leave it out")
        return load_speculators_mtp(folder, split, device)
    return formats.load_drafter(path_or_hub_id, split=split, aux_convention=aux_convention, device=device,
                                compile=compile)


def save_speculators_mtp(folder: str, out: str, verifier: str, speculative_tokens: int = 3) -> str:
    """Write the MTP layer a compiled folder stores (``ppsplit compile --mtp``) as speculators' ``mtp`` layout in
    ``out``: what ``MTPConverter`` writes from the target's checkpoint (``config.json`` with the verifier's config as
    ``transformer_layer_config``, ``model.safetensors`` with the layer under ``mtp_layers.0.``, experts fused), and
    what vLLM and ``MTPDraftModel.from_pretrained`` load. ``verifier``: the target's checkpoint folder (its config
    is recorded; speculators reads the embedding and head from it). Other model types are refused in one line."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig
    import transformers

    from ppsplit.artifact.folder import MTP_BLOCK_WEIGHTS, MTP_OWN_WEIGHTS, CompiledFolder, regular_file
    from ppsplit.compile.source import resolve_model
    from ppsplit.core.tensors import dtype_name

    compiled = CompiledFolder(folder)
    if compiled.mtp is None:
        raise ConfigError(f"{folder} holds no MTP layer; compile it with --mtp")
    settings, program, _ = compiled.check_mtp()
    source = resolve_model(verifier)
    try:
        with open(os.path.join(source, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {source}/config.json ({e}); pass the target's checkpoint as the verifier") \
            from None
    text = raw.get("text_config", raw) if isinstance(raw, dict) else None  # as MTPConverter reads a composite one
    kind = text.get("model_type") if isinstance(text, dict) else None
    if kind not in SPECULATORS_MTP_TYPES:
        raise ConfigError(f"speculators' mtp layout holds MTP layers of {', '.join(SPECULATORS_MTP_TYPES)} only, and "
                          f"this target is {kind!r}: vLLM reads its MTP layer from the target's own checkpoint")
    plan = compiled.plan
    if (text.get("num_hidden_layers"), text.get("hidden_size"), text.get("vocab_size")) != \
            (plan.num_layers, plan.hidden_size, settings["vocab_size"]):
        raise ConfigError(f"the verifier {verifier} ({text.get('num_hidden_layers')} layers, hidden "
                          f"{text.get('hidden_size')}, vocabulary {text.get('vocab_size')}) is not the target {folder} "
                          f"was compiled from ({plan.num_layers}, {plan.hidden_size}, {settings['vocab_size']})")
    if settings["zero_first"] or not settings["feed_normed"]:
        raise ConfigError(f"{folder}'s MTP layer does not follow speculators' formula (position 0 zeroed, or the "
                          "output fed back before its norm); compile it again with --mtp")
    params = {t.name for t in program.tensors if t.kind == "parameter" and t.init == "file"}
    tensors = {}
    with safe_open(regular_file(os.path.join(compiled.mtp, MTP_BLOCK_WEIGHTS), compiled.path), framework="pt") as f:
        for name in sorted(params):
            if name.startswith("model.layers.1."):
                tensors[_SPECULATORS_PREFIX + name[len("model.layers.1."):]] = f.get_tensor(name)
            elif name == "model.norm.weight":
                tensors[_SPECULATORS_PREFIX + _SPECULATORS_OWN["norm"]] = f.get_tensor(name)
            elif name != "lm_head.weight":  # the verifier's head
                raise ConfigError(f"{folder}'s MTP block holds {name}, which speculators' layout has no place for")
    with safe_open(regular_file(os.path.join(compiled.mtp, MTP_OWN_WEIGHTS), compiled.path), framework="pt") as f:
        for role in ("enorm", "hnorm", "eh_proj"):
            tensors[_SPECULATORS_PREFIX + _SPECULATORS_OWN[role]] = f.get_tensor(f"{role}.weight")
    try:
        layer = AutoConfig.for_model(**text).to_diff_dict()  # what MTPSpeculatorConfig serialises
    except Exception as e:  # transformers' validators raise their own types
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()[:160]
        raise ConfigError(f"transformers cannot read {source}/config.json ({first}); pass the target's checkpoint") \
            from None
    dtype = dtype_name(next(iter(tensors.values())).dtype)
    cfg = {"architectures": ["MTPDraftModel"], "dtype": dtype, "num_nextn_predict_layers": 1,
           "speculators_config": {"algorithm": "mtp", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                        "speculative_tokens": speculative_tokens,
                                                        "verifier_accept_k": 1}],
                                  "verifier": {"architectures": raw.get("architectures", []),
                                               "name_or_path": verifier}},
           "speculators_model_type": "mtp", "tie_word_embeddings": False, "transformer_layer_config": layer,
           "transformers_version": transformers.__version__}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    return out
