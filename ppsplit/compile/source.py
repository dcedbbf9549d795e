"""Driver support: resolve a MODEL argument (built-in demo, local checkpoint folder, or hub id) to a checkpoint
folder and its config, and build the model skeleton that the passes trace (parameters on the meta device)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import torch

from ppsplit.compile.demo import DEMO_NAME, demo_config, demo_drafter, demo_model, write_demo_tokenizer
from ppsplit.core.errors import ConfigError

DEMO_VERSION = 2  # 2: with a tokenizer


def cache_dir() -> str:
    return os.environ.get("PPSPLIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ppsplit")


def resolve_model(model: str) -> str:
    """A local folder holding ``config.json`` and safetensors weights for MODEL.

    ``demo`` is written once into ``$PPSPLIT_CACHE`` (default ``~/.cache/ppsplit``), and so is a GGUF file's
    conversion (``materialize_gguf``); a hub id is looked up in the local Hugging Face cache, then downloaded where
    the network allows.
    """
    if model == DEMO_NAME:
        return materialize_demo()
    gguf = gguf_file(model)
    if gguf is not None:
        return materialize_gguf(gguf)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ConfigError(f"{model} is a folder without config.json; pass a checkpoint folder saved with "
                              "save_pretrained, a hub id, or 'demo'")
        return model
    if os.path.exists(model):
        raise ConfigError(f"{model} is a file; pass a checkpoint folder, a .gguf file, a hub id, or 'demo'")
    if not _looks_like_hub_id(model):
        raise ConfigError(f"{model} does not exist; pass a checkpoint folder, a hub id like org/name, or 'demo'")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors"]
    try:
        return snapshot_download(model, allow_patterns=patterns, local_files_only=True)
    except Exception:  # not cached: try the network
        pass
    try:
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{model} is not a local folder, not in the local Hugging Face cache, and could not be "
                          f"downloaded ({type(e).__name__}: {first}); pass a checkpoint folder or 'demo'") from None


def gguf_file(model: str) -> str | None:
    """The GGUF file MODEL names: the file itself, or the one ``.gguf`` in a folder without ``config.json``."""
    if os.path.isfile(model) and model.lower().endswith(".gguf"):
        return model
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        found = sorted(f for f in os.listdir(model) if f.lower().endswith(".gguf"))
        if len(found) > 1:
            raise ConfigError(f"{model} holds {len(found)} GGUF files ({', '.join(found[:4])}); pass the one to "
                              "compile, like " + os.path.join(model, found[0]))
        return os.path.join(model, found[0]) if found else None
    return None


def materialize_gguf(path: str) -> str:
    """A GGUF file as a Hugging Face checkpoint folder in ``cache_dir()`` (named by the file's SHA-256, written once):
    transformers' GGUF loader reads and dequantises it to float32 (a GGUF-loaded model does not ``save_pretrained``,
    so its tensors go into a model built from the same config), and its tokenizer, chat template included, is
    saved beside. ``ppsplit compile --dtype`` then casts as for any checkpoint. The conversion holds the whole model
    in memory once."""
    import hashlib
    import logging

    log = logging.getLogger("ppsplit")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    name = os.path.basename(path)

    def write(tmp):
        import importlib.util

        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]  # transformers' GGUF loader's
        if missing:
            raise ConfigError(f"reading {name} needs {' and '.join(missing)}: pip install gguf accelerate (or "
                              "ppsplit[gguf])")
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one line of ours instead of tqdm bars per tensor group
        log.info("converting %s with transformers' GGUF loader (dequantised to float32) ...", name)
        start = time.perf_counter()
        folder = os.path.dirname(os.path.abspath(path))
        try:
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001 (transformers raises many kinds for a file it cannot read)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise ConfigError(f"transformers could not load {path} as a GGUF model ({type(e).__name__}: {first})") \
                from None
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)  # dequantised at load: a plain float32 checkpoint now
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict(), assign=True)
        plain.save_pretrained(tmp)
        del loaded, plain
        try:
            AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 (a GGUF without tokenizer metadata still compiles, without one)
            log.warning("%s: no tokenizer (%s: %s); the folder will take --prompt-ids only", name, type(e).__name__,
                        (str(e).strip().splitlines() or [""])[0][:200])
        log.info("converted %s in %.1fs", name, time.perf_counter() - start)

    return _materialize(f"gguf-{digest.hexdigest()[:24]}", write)


def materialize_demo() -> str:
    """Save the demo model (seeded random weights) and its tokenizer as a checkpoint, once; later calls reuse it."""
    def write(tmp):
        demo_model().save_pretrained(tmp, safe_serialization=True)
        write_demo_tokenizer(tmp)
    return _materialize(f"demo-v{DEMO_VERSION}", write)


def materialize_demo_drafter(taps: tuple[int, ...]) -> str:
    """Save the demo's drafter for ``taps`` (``demo.demo_drafter``) as a checkpoint, once per set of taps."""
    from safetensors.torch import save_file

    def write(tmp):
        cfg, tensors = demo_drafter(taps)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    return _materialize(f"demo-v{DEMO_VERSION}-drafter-{'-'.join(map(str, taps))}", write)


def _materialize(name: str, write) -> str:
    """``cache_dir()/name``, written by ``write(folder)`` into a temporary folder renamed into place (a crash leaves
    nothing half-written), unless it is there already."""
    folder = os.path.join(cache_dir(), name)
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # there already: another process wrote it meanwhile (kept, it may be reading it), or a wreck
            if not os.path.isfile(os.path.join(folder, "model.safetensors")):
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_config(model: str):
    """The transformers config of MODEL (a name or folder); a ``ConfigError`` saying what to fix if there is none."""
    if model == DEMO_NAME:
        return demo_config()
    from transformers import AutoConfig

    folder = resolve_model(model)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"cannot read the config of {model}: {first}; pass a checkpoint folder with a valid "
                          "config.json, a hub id, or 'demo'") from None
    check_decoder(config, model)
    return config


def check_decoder(config, name: str) -> None:
    from transformers import AutoModelForCausalLM

    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"{name} is an encoder-decoder model ({config.model_type}); ppsplit splits decoder-only LMs")
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ConfigError(f"{name} ({config.model_type}) is not a decoder LM that transformers can build with "
                          "AutoModelForCausalLM; pass a causal language model")


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters go to the meta device as they are registered (no memory, no init work); buffers computed in
    ``__init__`` (rotary ``inv_freq``, ...) stay real on the CPU, since no checkpoint holds them."""
    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def skeleton(config, dtype: torch.dtype | None = None):
    """The model with every parameter on the meta device, and the values of its buffers (moved to meta too, so
    the model traces as a pure meta model: every shape, no memory, no weights).
    Returns ``(model, {buffer name: CPU tensor})``."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype} if dtype is not None else {}
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs).eval()
    buffers = {name: b.detach().clone() for name, b in model.named_buffers(remove_duplicate=False)
               if b.device.type != "meta"}
    model.to("meta")
    return model, buffers


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "/", "~")) \
        and all(c.isalnum() or c in "-_." for p in parts for c in p)
