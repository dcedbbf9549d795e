"""The command line a newcomer meets: a GGUF file compiles, ``--prompt`` goes through the chat template, requests keep
their order and print as text, a missing folder is named, errors name the flags typed, help describes every
argument."""
import os

import numpy as np
import pytest
import torch

import ppsplit
from ppsplit.cli import main
from ppsplit.core.errors import ConfigError

H, LAYERS, INTER, HEADS, KV_HEADS = 64, 2, 128, 4, 2
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_level() -> list[str]:
    """GPT-2's byte-to-character table (a byte-level BPE vocabulary's first 256 tokens)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_gguf(folder: str, name: str = "tiny.gguf") -> str:
    """A tiny Llama as llama.cpp lays it out (float32 tensors, a byte-level BPE tokenizer, a chat template),
    written with the ``gguf`` package."""
    gguf = pytest.importorskip("gguf")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    tokens = ["<s>", "</s>", *_byte_level(), "Ġt", "he"]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template(TEMPLATE)

    def tensor(name, *shape, scale=0.1):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    kv = H // HEADS * KV_HEADS
    tensor("token_embd.weight", len(tokens), H)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", H, scale=1.0)
        tensor(f"blk.{i}.attn_q.weight", H, H)
        tensor(f"blk.{i}.attn_k.weight", kv, H)
        tensor(f"blk.{i}.attn_v.weight", kv, H)
        tensor(f"blk.{i}.attn_output.weight", H, H)
        tensor(f"blk.{i}.ffn_norm.weight", H, scale=1.0)
        tensor(f"blk.{i}.ffn_gate.weight", INTER, H)
        tensor(f"blk.{i}.ffn_up.weight", INTER, H)
        tensor(f"blk.{i}.ffn_down.weight", H, INTER)
    tensor("output_norm.weight", H, scale=1.0)
    tensor("output.weight", len(tokens), H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    """(the GGUF file, the folder ``ppsplit compile FILE.gguf --pp 2`` wrote from it)."""
    root = tmp_path_factory.mktemp("gguf")
    before = os.environ.get("PPSPLIT_CACHE")
    os.environ["PPSPLIT_CACHE"] = str(root / "cache")
    try:
        path = write_gguf(str(root / "src"))
        out = str(root / "pp2")
        assert main(["compile", path, "--pp", "2", "--max-batch", "4", "--max-len", "64", "-o", out]) == 0
    finally:
        if before is None:
            del os.environ["PPSPLIT_CACHE"]
        else:
            os.environ["PPSPLIT_CACHE"] = before
    return path, out


def test_a_gguf_file_compiles_to_the_logits_of_transformers_gguf_load(gguf_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppsplit.artifact.tokenizer import FolderTokenizer

    path, out = gguf_folder
    folder, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    split = ppsplit.load(out)
    ids = torch.tensor([[0, 85, 259, 222, 68, 66, 85, 40]])
    with torch.no_grad():
        want = reference(ids).logits
        got, _ = split(ids, torch.arange(ids.shape[1]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        greedy = reference.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(split.generate(ids, 6), greedy)
    # The tokenizer and the chat template came along, as transformers reads them from the file.
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    folder_tok = FolderTokenizer(out)
    assert folder_tok.encode("the cat") == tok("the cat").input_ids
    assert folder_tok.chat_template == TEMPLATE


def test_a_folder_holding_one_gguf_compiles_and_two_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PPSPLIT_CACHE", str(tmp_path / "cache"))
    write_gguf(str(tmp_path / "one"))
    out = ppsplit.compile_model(str(tmp_path / "one"), str(tmp_path / "pp1"), pp=1)
    assert ppsplit.load(out).plan.pp == 1
    write_gguf(str(tmp_path / "one"), "other.gguf")
    with pytest.raises(ConfigError, match=r"holds 2 GGUF files \(other.gguf, tiny.gguf\); pass the one to compile"):
        ppsplit.compile_model(str(tmp_path / "one"), str(tmp_path / "pp1b"), pp=1)


def test_prompts_keep_their_order_use_the_chat_template_and_print_as_text(gguf_folder, capsys):
    from ppsplit.artifact.tokenizer import FolderTokenizer
    from ppsplit.serve.engine import Engine
    from ppsplit.serve.sampling import SamplingParams

    _, out = gguf_folder
    tok = FolderTokenizer(out)
    args = ["generate", out, "--device", "cpu", "--max-new-tokens", "5", "--ignore-eos"]
    assert main(args + ["--prompt-ids", "5,6,7", "--prompt", "the cat", "--prompt-ids", "9,8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "the cat"}]), add_special_tokens=False)
    assert chat != tok.encode("the cat")
    outs = Engine(ppsplit.load(out)).generate([[5, 6, 7], chat, [9, 8]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert lines[:3] == [f"[{i}] {tok.decode(o.token_ids)}" for i, o in enumerate(outs)]
    assert main(args + ["--prompt", "the cat", "--raw"]) == 0
    raw = Engine(ppsplit.load(out)).generate([tok.encode("the cat")], SamplingParams(max_tokens=5, ignore_eos=True))
    assert capsys.readouterr().out.splitlines()[0] == tok.decode(raw[0].token_ids)


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, but got 0"),
    (["-k", "0"], "-k/--num-draft-tokens must be an integer >= 1, but got 0"),
    (["--top-p", "2"], "--top-p must be a number in (0, 1], but got 2.0"),
    (["--temperature", "-1"], "--temperature must be a number from 0 (greedy) to 100, but got -1.0"),
])
def test_errors_name_the_flags_typed(tmp_path, capsys, flags, message):
    out = ppsplit.compile_model("demo", str(tmp_path / "demo"), pp=1)
    assert main(["generate", out, "--prompt-ids", "1,2", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"ppsplit: error: {message}"


@pytest.mark.parametrize("command", ["generate", "run", "serve", "inspect", "collect"])
def test_a_missing_folder_is_named_as_missing(tmp_path, capsys, command):
    missing = str(tmp_path / "nope")
    extra = {"generate": ["--prompt", "hi"], "run": ["--prompt", "hi"], "collect": ["--prompts", "x", "-o", "y"]}
    assert main([command, missing, *extra.get(command, [])]) == 2
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and "tokenizer" not in err, err


def test_help_describes_every_argument_and_opens_with_what_ppsplit_is(capsys):
    from ppsplit.cli.commands import build_parser

    parser = build_parser()
    assert parser.description.startswith("ppsplit ")
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    undescribed = [f"{name} {a.dest}" for name, p in sub.choices.items() for a in p._actions
                   if a.dest != "help" and not a.help]
    assert not undescribed, undescribed
    generate = sub.choices["generate"].format_help()
    for default in ("(default: 32)", "(default: 0)", "(default: auto)"):
        assert default in " ".join(generate.split()), default
