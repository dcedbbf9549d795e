"""Resolve a MODEL argument (built-in demo, local checkpoint folder, or hub id) to a config and a model."""
from __future__ import annotations

import os

import torch

from ppsplit.demo import DEMO_NAME, demo_config
from ppsplit.errors import ConfigError


def load_config(model: str):
    """The transformers config of MODEL; a one-line ``ConfigError`` saying what to fix if there is none."""
    if model == DEMO_NAME:
        return demo_config()
    from transformers import AutoConfig

    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(f"{model} is a folder without config.json; pass a checkpoint folder saved with "
                          "save_pretrained, a hub id, or 'demo'")
    if not os.path.isdir(model) and (os.sep in model.strip("./") and os.path.exists(os.path.dirname(model) or ".")
                                     and not _looks_like_hub_id(model)):
        raise ConfigError(f"{model} does not exist; pass a checkpoint folder, a hub id, or 'demo'")
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot read a config for {model!r}: {first}; pass a checkpoint folder with config.json, "
                          "a hub id in the local Hugging Face cache, or 'demo'") from None
    check_decoder(config, model)
    return config


def check_decoder(config, name: str) -> None:
    from transformers import AutoModelForCausalLM

    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"{name} is an encoder-decoder model ({config.model_type}); ppsplit splits decoder-only LMs")
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise ConfigError(f"{name} ({config.model_type}) is not a decoder LM that transformers can build with "
                          "AutoModelForCausalLM; pass a causal language model")


def meta_model(config) -> torch.nn.Module:
    """The model on the meta device: every shape, no memory, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).eval()


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/"))
