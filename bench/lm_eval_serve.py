"""lm-evaluation-harness against ``ppsplit serve``: the same two tasks through its ``local-completions`` model and
through its Hugging Face model (``hf``) on the same checkpoint, scores and per-sample results compared.

    python bench/lm_eval_serve.py DIR --hf HF_DIR [--lm-eval VENV] [--out OUT]

DIR: a compiled folder with a paged cache and a tokenizer, compiled from HF_DIR (e.g. SmolLM2-135M ``--pp 1``).
HF_DIR: the float32 Hugging Face folder ``hf`` loads. VENV: a virtual environment with ``lm-eval`` installed
(``pip install "lm-eval[api]"``; torch and transformers for ``hf``); default: this Python. The script writes two
tasks over local JSONL files (16 rows each, facts written here) to a temporary folder:

- ``ppsplit_mc``: multiple choice (log-likelihood requests: ``echo`` + ``logprobs: 1`` + ``max_tokens: 1`` over token
  ids, lm-eval reads the prompt's logprobs), metrics ``acc`` and ``acc_norm``;
- ``ppsplit_gen``: generate-until (greedy, stop at a newline, 16 tokens at most), metric ``exact_match``.

It starts ``ppsplit serve DIR --cpu-threads 1`` on a free port of 127.0.0.1, runs ``lm_eval`` with
``local-completions`` against it, then with ``hf`` (float32, CPU, one thread), and prints both scores, the largest
difference between the per-choice log-likelihoods of the two, how many greedy flags and generations are identical,
and the wall time of each. Exit status 1 if any score differs.
"""
import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.serve_vllm_client import start_server  # noqa: E402

MC = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of zero degrees", ["Fahrenheit", "Kelvin", "Celsius", "Rankine"], 2),
    ("The chemical symbol for gold is", ["Ag", "Fe", "Cu", "Au"], 3),
    ("A week has seven", ["days", "hours", "months", "years"], 0),
    ("The opposite of hot is", ["warm", "cold", "bright", "loud"], 1),
    ("Bees make", ["milk", "silk", "honey", "wool"], 2),
    ("The sun rises in the", ["west", "north", "south", "east"], 3),
    ("A triangle has three", ["sides", "wheels", "legs", "doors"], 0),
    ("The first letter of the English alphabet is", ["Z", "A", "M", "Q"], 1),
    ("Ice is the solid form of", ["air", "salt", "water", "sand"], 2),
    ("The color of a clear daytime sky is", ["green", "red", "purple", "blue"], 3),
    ("Cows drink water and eat", ["grass", "rocks", "glass", "metal"], 0),
    ("The number after nine is", ["eight", "ten", "seven", "eleven"], 1),
    ("People read books in a", ["garage", "stadium", "library", "kitchen sink"], 2),
    ("The planet we live on is called", ["Mars", "Venus", "Saturn", "Earth"], 3),
]

GEN = [
    ("What is the capital of France?", "Paris"),
    ("What is two plus two?", "4"),
    ("What color is grass?", "Green"),
    ("How many days are in a week?", "7"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the opposite of up?", "Down"),
    ("What animal says moo?", "Cow"),
    ("What is the capital of Italy?", "Rome"),
    ("What is frozen water called?", "Ice"),
    ("How many legs does a spider have?", "8"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("What is the capital of Germany?", "Berlin"),
    ("What gas do plants take in?", "Carbon dioxide"),
    ("What is ten minus three?", "7"),
    ("What star is closest to Earth?", "The Sun"),
    ("What is the capital of Spain?", "Madrid"),
]

FEWSHOT = "Q: What is the capital of England?\nA: London\n\nQ: What is one plus one?\nA: 2\n\n"


def write_tasks(folder: str) -> None:
    with open(os.path.join(folder, "mc.jsonl"), "w") as f:
        for question, choices, answer in MC:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(os.path.join(folder, "gen.jsonl"), "w") as f:
        for question, answer in GEN:
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    # JSON is YAML: the task files need no YAML writer.
    mc = {"task": "ppsplit_mc", "dataset_path": "json",
          "dataset_kwargs": {"data_files": {"test": os.path.join(folder, "mc.jsonl")}}, "test_split": "test",
          "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "choices",
          "doc_to_target": "answer", "target_delimiter": " ",
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                          {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
          "metadata": {"version": 1}}
    gen = {"task": "ppsplit_gen", "dataset_path": "json",
           "dataset_kwargs": {"data_files": {"test": os.path.join(folder, "gen.jsonl")}}, "test_split": "test",
           "output_type": "generate_until", "doc_to_text": FEWSHOT + "Q: {{question}}\nA:",
           "doc_to_target": "{{answer}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 16, "do_sample": False},
           "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                        {"function": "take_first"}]}],
           "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                            "ignore_case": True, "ignore_punctuation": True}],
           "metadata": {"version": 1}}
    for name, task in (("ppsplit_mc.yaml", mc), ("ppsplit_gen.yaml", gen)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(task, f, indent=1)


def run_lm_eval(python: str, model: str, model_args: str, tasks: str, out: str, timeout: int) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", "ppsplit_mc,ppsplit_gen",
           "--include_path", tasks, "--output_path", out, "--log_samples", "--batch_size", "1", "--seed", "0"]
    if model == "hf":
        cmd += ["--device", "cpu"]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval --model {model} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return time.monotonic() - start


def read_results(out: str) -> tuple[dict, dict]:
    [results] = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
    with open(results) as f:
        scores = json.load(f)["results"]
    samples = {}
    for task in ("ppsplit_mc", "ppsplit_gen"):
        [path] = glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True)
        with open(path) as f:
            samples[task] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    return scores, samples


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--hf", required=True, help="the Hugging Face folder DIR was compiled from")
    p.add_argument("--lm-eval", default=None, help="a virtual environment with lm-eval (default: this Python)")
    p.add_argument("--out", default=None, help="keep lm-eval's outputs here (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--timeout", type=int, default=1800)
    args = p.parse_args()
    python = os.path.join(args.lm_eval, "bin", "python") if args.lm_eval else sys.executable
    name = os.path.basename(os.path.normpath(args.folder))
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        tasks = os.path.join(tmp, "tasks")
        os.makedirs(tasks)
        write_tasks(tasks)
        proc, port = start_server(args.folder, name, ["--cpu-threads", "1"])
        try:
            serve_s = run_lm_eval(python, "local-completions",
                                  f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,"
                                  f"tokenizer={args.hf},tokenizer_backend=huggingface,num_concurrent=1,"
                                  f"max_retries=1,tokenized_requests=True", tasks, os.path.join(out, "serve"),
                                  args.timeout)
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(120)
        hf_s = run_lm_eval(python, "hf", f"pretrained={args.hf},dtype=float32", tasks, os.path.join(out, "hf"),
                           args.timeout)
        serve_scores, serve_samples = read_results(os.path.join(out, "serve"))
        hf_scores, hf_samples = read_results(os.path.join(out, "hf"))
    figures = {"serve_wall_s": serve_s, "hf_wall_s": hf_s, "server_exit": code, "tasks": {}}
    same = code == 0
    for task in ("ppsplit_mc", "ppsplit_gen"):
        metrics = sorted(k for k in serve_scores[task] if "," in k and not k.split(",")[0].endswith("stderr"))
        both = {m: (serve_scores[task][m], hf_scores[task].get(m)) for m in metrics}
        row = {"scores": both, "rows": len(serve_samples[task])}
        same &= all(a == b for a, b in both.values()) and len(serve_samples[task]) == len(hf_samples[task])
        if task == "ppsplit_mc":
            # resps: one [[loglikelihood, is_greedy]] per choice
            pairs = [(float(a[0][0]), float(b[0][0]), a[0][1] == b[0][1])
                     for s, h in zip(serve_samples[task], hf_samples[task]) for a, b in zip(s["resps"], h["resps"])]
            row["max_abs_loglikelihood_diff"] = max(abs(a - b) for a, b, _ in pairs)
            row["greedy_flags_equal"] = f"{sum(g for _, _, g in pairs)}/{len(pairs)}"
        else:
            gens = [(s["resps"][0][0], h["resps"][0][0]) for s, h in zip(serve_samples[task], hf_samples[task])]
            row["generations_equal"] = f"{sum(a == b for a, b in gens)}/{len(gens)}"
            row["generations"] = gens
        figures["tasks"][task] = row
        print(f"{task}: " + ", ".join(f"{m} serve {a:.4f} hf {b:.4f}" for m, (a, b) in both.items()) +
              "; " + ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("scores", "generations")), flush=True)
    print(f"wall: local-completions against ppsplit serve {serve_s:.0f} s, hf {hf_s:.0f} s; server exit {code}; "
          f"scores {'equal' if same else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
