"""Reading EAGLE-3 checkpoints into an ``Eagle3Drafter``, and the drafter inside a compiled folder.

Checkpoint facts (SafeAILab/EAGLE ``cnets.py``, SpecForge, speculators, vLLM/SGLang ``llama_eagle3.py``): the
config formats are in ``ppsplit.core.drafter_config``; tensors ``fc``, ``midlayer.*`` (speculators and vLLM:
``layers.0.*``), ``norm``, ``lm_head``, ``d2t`` (target id = draft id + d2t[draft id]), ``t2d`` (the draft ids'
mask over the target vocabulary: checked against ``d2t``), optional ``input_norm`` / ``fc_norm.<k>`` (norms of the
taps before ``fc``), optional ``embed_tokens`` (else the target's embedding is used). Files: ``model.safetensors``
or ``pytorch_model.bin`` (read as plain tensors only).

A compiled folder keeps the drafter in ``drafter/`` (``config.json`` + ``drafter.safetensors``) with its taps
resolved to ppsplit numbering, the rotary frequencies and its embedding copy: ``ppsplit.load`` attaches it as
``split.drafter`` without transformers and without reading stage 0.
"""
from __future__ import annotations

import json
import os

import torch

from ppsplit.core.drafter_config import (DFLASH_KEYS, DRAFTER_KEYS, FAMILY_KEYS, FORMAT_NUMBERING, aux_ids,
                                         detect_format, dflash_drafter_config, dflash_family, drafter_config,
                                         is_deepspec, is_dflash)
from ppsplit.eagle3.drafter import Eagle3Drafter
from ppsplit.eagle3.mtp import is_mtp_target
from ppsplit.core.errors import ConfigError
from ppsplit.artifact.folder import DRAFTER, FolderError, check_drafter
from ppsplit.core.options import TAP_NUMBERINGS, eagle3_taps, to_taps
from ppsplit.core.tensors import model_dtype

_LAYER = "midlayer."


def drafter_taps(cfg: dict, num_layers: int, aux_convention: str | None = None) -> tuple[int, ...]:
    """The taps (ppsplit/vLLM numbering) a drafter config asks for: ``eagle_aux_hidden_state_layer_ids`` read in
    ``aux_convention``, by default the format's own (speculators: ``"vllm"``, as written; SpecForge/SafeAILab flat
    configs: ``"sglang"``, layer outputs, +1); absent ids mean EAGLE-3's default ``(2, L//2, L-3)``. A compiled
    folder's drafter stores resolved ids as ``ppsplit_taps``.

    Example::

        drafter_taps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32)   # (2, 16, 29)
        drafter_taps({"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [2, 16, 29]}, 32)
    """
    if "ppsplit_taps" in cfg:
        return tuple(cfg["ppsplit_taps"])
    if is_dflash(cfg):
        _, _, ids, numbering = dflash_drafter_config(cfg)
        return to_taps(ids, aux_convention or numbering, num_layers, what="DFlash drafter tap id")
    if aux_convention is None:
        aux_convention = FORMAT_NUMBERING[detect_format(cfg)]
    if aux_convention not in TAP_NUMBERINGS:
        raise ConfigError(f"aux_convention must be 'sglang' (alias 'specforge': the config's ids are layer outputs, "
                          f"+1), 'vllm' (ids used as written) or None (the format's own), but got {aux_convention!r}")
    ids = aux_ids(cfg)
    if not ids:
        return eagle3_taps(num_layers)
    if list(ids) != sorted(set(ids)):
        raise ConfigError(f"drafter tap ids {list(ids)} must be distinct and ascending (the order fc was trained on)")
    return to_taps(ids, aux_convention, num_layers, what="drafter tap id")


def resolve_drafter(path_or_hub_id: str) -> str:
    """A local folder with the drafter's ``config.json`` and weights (a hub id: local HF cache, then network)."""
    if os.path.isdir(path_or_hub_id):
        return path_or_hub_id
    if os.path.exists(path_or_hub_id) or path_or_hub_id.startswith((".", "/", "~")):
        raise ConfigError(f"drafter {path_or_hub_id} is not a folder; pass a folder with config.json and "
                          "model.safetensors or pytorch_model.bin, or a hub id")
    from huggingface_hub import snapshot_download

    error = None
    for local in (True, False):
        try:
            return snapshot_download(path_or_hub_id, allow_patterns=["*.json", "*.safetensors", "*.bin"],
                                     local_files_only=local)
        except Exception as e:  # not cached, then not reachable
            error = e
    raise ConfigError(f"drafter {path_or_hub_id} is neither a local folder nor a reachable hub id "
                      f"({type(error).__name__}); pass a folder with config.json and weights") from None


def read_drafter(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of a drafter folder, tensor names normalised to ``midlayer.``. Reads
    ``model.safetensors`` / ``drafter.safetensors``, or ``pytorch_model.bin`` with ``weights_only=True`` only."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {folder}/config.json ({e}); an EAGLE-3 drafter folder needs one") from None
    if is_mtp_target(cfg):
        raise ConfigError(f"{folder} is a target checkpoint with MTP layers, not a drafter; load them with "
                          "ppsplit.load_mtp(folder, split=split)")
    if cfg.get("speculators_model_type") == "mtp":  # its block is traced: ppsplit.compile.mtp loads it
        raise ConfigError(f"{folder} is a speculators MTP layer; load it with ppsplit.load_drafter(folder, "
                          "split=split), or store it in a folder with ppsplit compile TARGET --drafter FOLDER")
    for name in ("model.safetensors", "drafter.safetensors"):
        if os.path.isfile(os.path.join(folder, name)):
            from safetensors.torch import load_file

            tensors = load_file(os.path.join(folder, name))
            break
    else:
        path = os.path.join(folder, "pytorch_model.bin")
        if not os.path.isfile(path):
            raise ConfigError(f"{folder} has no model.safetensors or pytorch_model.bin; pass an EAGLE-3 drafter folder")
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True)  # never unpickle arbitrary objects
        except Exception as e:
            raise ConfigError(f"cannot read {path} as plain tensors ({type(e).__name__}); convert it to "
                              "model.safetensors") from None
    out, dflash = {}, is_dflash(cfg)
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0.") and not dflash:  # vLLM's naming of the one layer
            name = _LAYER + name[len("layers.0."):]
        out[name] = t
    return cfg, out


def drafter_rope(cfg: dict, rope: dict, tensors: dict) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies and scale of the drafter, computed by transformers' own Llama rotary code from the
    config's ``rope`` keys so every ``rope_scaling`` type (llama3, yarn, ...) matches; a compiled folder stores them
    and needs no transformers."""
    if "rotary.inv_freq" in tensors:
        return tensors["rotary.inv_freq"].float(), float(cfg.get("ppsplit_rope_scale", 1.0))
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: cfg[k] for k in keys}, **rope))
    return rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0))


def embedding_name(split) -> str:
    """The FQN of the target's input-embedding table: the one read by stage 0's ``aten.embedding``."""
    for node in split.stages[0].graph.nodes:
        if node.op == "call_function" and "embedding" in str(node.target) and node.args \
                and getattr(node.args[0], "op", None) == "get_attr":
            return node.args[0].target
    raise ConfigError("stage 0 of the split has no embedding lookup, which the drafter shares; give the drafter its "
                      "own embed_tokens")


def load_drafter(path_or_hub_id: str, split=None, aux_convention: str | None = None, device=None,
                 compile: bool = False) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter for ``split`` (which must carry the drafter's taps), on its last stage's device.

    Config formats (``ppsplit.core.drafter_config``): speculators (vLLM's), SpecForge's exports and SafeAILab's
    EAGLE-3 with each variant they write; a key ppsplit cannot honour is refused, naming it. Both file formats
    (``model.safetensors``; ``pytorch_model.bin`` read with ``weights_only=True``), both namings (``midlayer.``
    and ``layers.0.``), a separate or shared embedding (without ``embed_tokens`` the drafter references the
    target's embedding table, copied to the last stage's device when stage 0 lives elsewhere, so it never travels
    per step). Tap ids come from the config, numbered as its format writes them unless ``aux_convention``
    (``"sglang"``: SpecForge's layer outputs, +1; ``"vllm"``: as written) says otherwise, see ``drafter_taps``.
    ``compile``:
    Inductor compiles the drafter's forward (``drafter.compile(dynamic=False)``; it fuses the norms, rotary and
    adds, and ``capture`` records the compiled kernels): an 8B-shaped draft step on an H200 went from 367 to
    268 us. Compiling takes a few seconds per shape at the first calls, which is why it is off by default.

    Example::

        split = ppsplit.split_model(model, pp=4, aux="eagle3", cache=ppsplit.CacheConfig(1, 4096))
        drafter = ppsplit.load_drafter("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", split=split)
        out, stats = split.generate(ids, 64, drafter=drafter, num_draft_tokens=4, return_stats=True)
    """
    from ppsplit.core.tensors import module_device

    if split is None:
        raise ConfigError("load_drafter needs split=: the drafter reads the split's taps and embedding; split the "
                          "target with the drafter's taps first (ppsplit compile MODEL --drafter DRAFTER does it)")
    cfg, tensors = read_drafter(resolve_drafter(path_or_hub_id))
    embed = tensors.get("embed_tokens.weight")
    if embed is None or is_deepspec(cfg):
        name = embedding_name(split)
        stage = split.stages[0]
        embed = dict(stage.named_parameters()).get(name)
        embed = (embed if embed is not None else stage.get_buffer(name)).detach()
    device = device if device is not None else module_device(split.stages[-1])
    if is_dflash(cfg):
        from ppsplit.eagle3.dflash import build_dflash, output_head

        drafter = build_dflash(cfg, tensors, split.plan, embed, output_head(split), aux_convention, device,
                               dflash_class(cfg))
    else:
        drafter = build_drafter(cfg, tensors, split.plan, embed, aux_convention, device)
    if compile:
        drafter.compile(dynamic=False)
    return drafter


def dflash_class(cfg: dict) -> type:
    """The module of a DFlash-family drafter config (a checkpoint's, or a compiled folder's ``ppsplit_family``):
    ``DFlashDrafter``, ``DFlash2Drafter`` or ``DSparkDrafter``."""
    from ppsplit.eagle3.dflash import DFlashDrafter
    from ppsplit.eagle3.dflash2 import DFlash2Drafter
    from ppsplit.eagle3.dspark import DSparkDrafter

    return {"dspark": DSparkDrafter, "dflash2": DFlash2Drafter}.get(dflash_family(cfg), DFlashDrafter)


def build_drafter(cfg: dict, tensors: dict, plan, embed: torch.Tensor, aux_convention: str | None,
                  device) -> Eagle3Drafter:
    """The drafter of ``(cfg, tensors)`` for a split with ``plan``, using ``embed`` as its embedding table."""
    taps = drafter_taps(cfg, plan.num_layers, aux_convention)
    cfg, rope, _ = drafter_config(cfg, tensors)
    missing = [t for t in taps if t not in plan.taps]
    if missing:
        raise ConfigError(f"the drafter reads taps {list(taps)} but the split carries {list(plan.taps)} (missing "
                          f"{missing}); split the target with aux={','.join(map(str, taps))}")
    th = cfg["target_hidden_size"]
    if th != plan.hidden_size:
        raise ConfigError(f"the drafter expects target hidden size {th} but the target has {plan.hidden_size}; "
                          "use a drafter trained for this target")
    _check_tensors(cfg, tensors, len(taps))
    vocab = embed.shape[0]
    if (cfg.get("vocab_size") or vocab) != vocab or embed.shape[1] != cfg["hidden_size"]:
        raise ConfigError(f"the drafter's vocabulary x hidden ({cfg.get('vocab_size')} x {cfg['hidden_size']}) does "
                          f"not match the target's embedding {tuple(embed.shape)}; use a drafter trained for this target")
    d2t = draft_map(cfg, tensors, vocab)
    cfg["vocab_size"] = vocab
    if cfg["hidden_act"] not in ("silu", "gelu", "gelu_pytorch_tanh"):
        raise ConfigError(f"drafter hidden_act {cfg['hidden_act']!r} is not supported; use silu, gelu or "
                          "gelu_pytorch_tanh")
    inv_freq, rope_scale = drafter_rope(cfg, rope, tensors)
    dtype = model_dtype(plan)
    device = torch.empty(0, device=device).device
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg, taps, tuple(plan.taps.index(t) for t in taps), torch.empty(0), torch.empty(0),
                                n_slots=plan.n_slots)
    drafter = drafter.to_empty(device=device)
    state = {k: v for k, v in tensors.items() if k not in ("t2d", "embed_tokens.weight", "rotary.inv_freq")}
    state["d2t"] = d2t.long()
    expected = set(drafter.state_dict())
    extra, absent = sorted(set(state) - expected), sorted(expected - set(state))
    if extra:
        raise ConfigError(f"the drafter has tensors its config does not account for: {', '.join(extra[:4])}; ppsplit "
                          "refuses to drop them (a config flag may be missing, or the layout is not supported)")
    if absent:
        raise ConfigError(f"the drafter's config needs tensors the checkpoint lacks: {', '.join(absent[:4])}")
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as e:
        lines = str(e).splitlines()
        raise ConfigError(f"the drafter's tensors do not fit an EAGLE-3 layer: {(lines[1:] or lines)[0].strip()}") from None
    drafter = drafter.to(dtype=dtype)
    # A shared table stays a reference when it already lives on this device in this dtype (one process, one device);
    # otherwise the drafter gets its own copy.
    same = embed.device == device and embed.dtype == dtype
    drafter.embed_tokens = embed.detach() if same else embed.detach().to(device=device, dtype=dtype)
    drafter.inv_freq = inv_freq.to(device)
    drafter.rope_scale = rope_scale
    return drafter.eval()


def _check_tensors(cfg: dict, tensors: dict, n_taps: int) -> None:
    for name in ("fc.weight", "lm_head.weight", f"{_LAYER}self_attn.q_proj.weight"):
        if name not in tensors:
            raise ConfigError(f"the drafter has no {name} tensor; it is not an EAGLE-3 checkpoint (its tensors: "
                              f"{sorted(tensors)[:4]} ...)")
    th = cfg["target_hidden_size"]
    if tuple(tensors["fc.weight"].shape) != (cfg["hidden_size"], n_taps * th):
        raise ConfigError(f"drafter fc.weight is {tuple(tensors['fc.weight'].shape)}, expected "
                          f"({cfg['hidden_size']}, {n_taps * th}) for {n_taps} taps of width {th}")
    for name, t in tensors.items():
        # speculators initialises embed_tokens and lm_head to NaN: a checkpoint saved before they were loaded
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ConfigError(f"the drafter's {name} holds NaN or infinite values; it was saved before being trained "
                              "or loaded (speculators fills embed_tokens and lm_head with NaN until then)")


def draft_map(cfg: dict, tensors: dict, vocab: int) -> torch.Tensor:
    """``d2t`` (checked one-to-one into the target vocabulary, and against ``t2d`` when present)."""
    d2t = tensors.get("d2t")
    if d2t is None:
        if cfg["draft_vocab_size"] != vocab:
            raise ConfigError(f"the drafter has no d2t tensor but its draft vocabulary ({cfg['draft_vocab_size']}) is "
                              f"smaller than the target's ({vocab}); d2t maps draft ids to target ids")
        d2t = torch.zeros(vocab, dtype=torch.long)
    targets = torch.arange(d2t.shape[0]) + d2t.long().cpu()
    if d2t.shape[0] != cfg["draft_vocab_size"] or targets.min() < 0 or targets.max() >= vocab \
            or targets.unique().numel() != targets.numel():
        raise ConfigError(f"the drafter's d2t ({d2t.shape[0]} entries) does not map its {cfg['draft_vocab_size']} "
                          f"draft ids one-to-one into the target vocabulary of {vocab}")
    t2d = tensors.get("t2d")
    if t2d is not None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[targets] = True
        if tuple(t2d.shape) != (vocab,) or not torch.equal(t2d.cpu().bool(), mask):
            raise ConfigError(f"the drafter's t2d (shape {tuple(t2d.shape)}) does not mark exactly the target ids its "
                              "d2t maps to; the vocabulary mapping is inconsistent")
    return d2t


def save_drafter(drafter, folder: str) -> None:
    """Write ``drafter`` (EAGLE-3, DFlash, DFlash2 or DSpark) as ``folder/config.json`` +
    ``folder/drafter.safetensors``: resolved taps, the rotary frequencies and its embedding table (a DFlash-family
    drafter: the target's output head too, its family's own keys and every tensor of its heads), so loading it needs
    neither transformers nor the target's stage 0."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    family = getattr(drafter, "family", None)
    dflash = family in FAMILY_KEYS
    keys = (*DRAFTER_KEYS, *DFLASH_KEYS, *FAMILY_KEYS[family], "rope") if dflash else (*DRAFTER_KEYS, "rope")
    cfg = {k: drafter.cfg[k] for k in keys if drafter.cfg.get(k) is not None}
    if family == "dspark":
        cfg["confidence_rule"] = drafter.confidence_rule  # speculators' configs leave it to the default
    cfg.update(ppsplit_taps=list(drafter.taps), ppsplit_rope_scale=drafter.rope_scale)
    if dflash:
        cfg["ppsplit_family"] = family
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    tensors["embed_tokens.weight"] = drafter.embed_tokens.detach().contiguous().cpu()
    tensors["rotary.inv_freq"] = drafter.inv_freq.detach().cpu()
    if dflash:
        tensors["head.weight"] = drafter.head.detach().contiguous().cpu()
    save_file(tensors, os.path.join(folder, "drafter.safetensors"), metadata={"format": "pt"})


# -- compiled folders --------------------------------------------------------------------------------------------
def compile_taps(drafter: str, config, aux, aux_convention: str) -> tuple[int, ...]:
    """The taps ``ppsplit compile --drafter`` splits with (ppsplit numbering), from the drafter's config."""
    if aux is not None:
        raise ConfigError("pass either --aux or --drafter: with a drafter the taps come from its config")
    cfg, _ = read_drafter(resolve_drafter(drafter))
    return drafter_taps(cfg, config.num_hidden_layers, aux_convention)


def write_compiled_drafter(folder: str, drafter: str, split, checkpoint, tied: dict, aux_convention: str) -> None:
    """Store the drafter, its embedding copy included, in ``folder/drafter`` beside the last stage's artifact.
    ``split`` is the compile's skeleton (weights on meta): the embedding is read from the target's checkpoint."""
    cfg, tensors = read_drafter(resolve_drafter(drafter))
    read = lambda name: checkpoint.read_one(next((n for n in tied.get(name, ()) if n in checkpoint), name))  # noqa: E731
    embed = tensors.get("embed_tokens.weight")
    if embed is None or is_deepspec(cfg):  # DeepSpec's copy is checked against the target's, not taken for it
        embed = read(embedding_name(split))
    if is_dflash(cfg):
        from ppsplit.eagle3.dflash import build_dflash, output_head_name

        built = build_dflash(cfg, tensors, split.plan, embed, read(output_head_name(split)), aux_convention, "cpu",
                             dflash_class(cfg))
    else:
        built = build_drafter(cfg, tensors, split.plan, embed, aux_convention, "cpu")
    save_drafter(built, os.path.join(folder, DRAFTER))


def load_folder_drafter(path: str, plan, device):
    """The drafter a compiled folder stores in ``path`` (``ppsplit compile --drafter``), built for one process that
    holds only the last stage (its embedding copy, and a DFlash-family drafter's output head, are in the drafter's
    file)."""
    cfg, _ = check_drafter(path, plan)
    _, tensors = read_drafter(path)
    try:
        if is_dflash(cfg):
            from ppsplit.eagle3.dflash import build_dflash

            head = tensors.pop("head.weight")  # check_drafter saw it
            return build_dflash(cfg, tensors, plan, tensors["embed_tokens.weight"], head, None, device,
                                dflash_class(cfg))
        return build_drafter(cfg, tensors, plan, tensors["embed_tokens.weight"], None, device)
    except ConfigError as e:
        raise FolderError(f"{path}: {e}") from None
