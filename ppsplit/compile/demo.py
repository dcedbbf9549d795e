"""The built-in demo model: a small Llama-style decoder with seeded random weights (no download), a byte-level BPE
tokenizer for it, trained offline on a seeded synthetic corpus, so the demo folder takes text prompts, and a
one-layer EAGLE-3 drafter with seeded random weights, so ``-k`` works on the demo folder out of the box."""
from __future__ import annotations

import json
import os
import random

import torch

DEMO_NAME = "demo"
DEMO_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the config's bos_token_id=1 and eos_token_id=2
# A ChatML-style template; the model's weights are random, so any fixed format serves.
DEMO_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
                      "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
_WORDS = """the of and to in is that it for was on are as with his they at be this from have or by one had not but what
all were when we there can an your which their said if do will each about how up out them then she many some so these
would other into has more her two like him see time could no make than first been its who now people my made over did
down only way find use may water long little very after words called just where most know get through back much go good
new write our me man too any day same right look think also around another came come work three word must because does
part even place well such here take why things help put years different away again off went old number great tell men
say small every found still between name should home big give air line set own under read last never us left end along
while might next sound below saw something thought both few those always looked show large often together asked house
world going want school important until form food keep children feet land side without boy once animals life enough took
sometimes four head above kind began almost live page got earth need far hand high year mother light parts country
father let night following picture being study second eyes soon times story boys since white days ever paper hard near
sentence better best across during today others however sure means knew try told young miles sun ways thing whole hear
example heard several change answer room sea against top turned learn point city play toward five using himself usually
model stage token pipeline split layer serve request cache draft hello""".split()


def demo_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       torch_dtype="float32")


def demo_model(seed: int = 0) -> torch.nn.Module:
    """The demo model with the same weights on every machine (seeded initialisation)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(demo_config()).eval()


def demo_tokenizer_json() -> str:
    """``tokenizer.json`` of the demo: byte-level BPE over exactly the model's 1024 ids (3 special tokens, the 256
    bytes, merges learnt from a seeded corpus of common words), so every id the model can produce decodes. The
    tokenizers library's trainer is deterministic: the same text on every machine."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + "." for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=demo_config().vocab_size, special_tokens=list(DEMO_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def write_demo_tokenizer(folder: str) -> None:
    """The demo's ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, a leading ``<s>``, the chat
    template) into ``folder``."""
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(demo_tokenizer_json())
    unk, bos, eos = DEMO_SPECIAL_TOKENS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "unk_token": unk,
              "add_bos_token": True, "chat_template": DEMO_CHAT_TEMPLATE}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def demo_drafter(taps: tuple[int, ...]) -> tuple[dict, dict]:
    """``(config, tensors)`` of a one-layer EAGLE-3 drafter for the demo reading ``taps`` (ppsplit numbering), in
    the SpecForge layout (flat Llama config, ``midlayer.`` tensors, ids numbered ``j - 1``). Its weights are seeded
    random, like the demo's: speculative decoding runs exactly, and few drafts are accepted."""
    target = demo_config()
    h, heads, kv, inter = target.hidden_size, 4, 2, 512
    hd, vocab = h // heads, target.vocab_size
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
           "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps, "hidden_act": "silu",
           "max_position_embeddings": target.max_position_embeddings, "rope_theta": 10000.0, "vocab_size": vocab,
           "draft_vocab_size": vocab, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in taps],
                                                       "use_aux_hidden_state": True}}
    g = torch.Generator().manual_seed(1)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    shapes = {"fc.weight": (h, len(taps) * h), "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h), "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, heads * hd), "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
              "lm_head.weight": (vocab, h)}
    tensors = {name: w(*shape) for name, shape in shapes.items()}
    for norm in ("midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = torch.ones(h)
    return cfg, tensors
