"""Compile a ~1 GB checkpoint: wall time, peak RSS against the largest stage, read throughput against a plain
copy of the same shards (CPU, this machine).

    python bench/compile_bench.py                 # Llama-style, ~1.1 GB of bf16 weights, pp=4, EAGLE-3 taps
    python bench/compile_bench.py --layers 4      # smaller, quicker
    python bench/compile_bench.py --moe           # Qwen3-MoE-style, ~1.9 GB, per-expert tensors as transformers
                                                  # saves them: compile fuses them per stage (issue 14)
    python bench/compile_bench.py --moe --layers 2 --experts 4   # a quick check that the script works

Every measured step runs in its own process (peak RSS from wait4); the shards were just written, so both the
copy and the compile read them from the page cache.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


def run_measured(cmd, env=None):
    """Run ``cmd``; return (returncode, stdout, stderr, wall seconds, peak RSS bytes)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    return os.waitstatus_to_exitcode(status), out, err, wall, usage.ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE-shaped checkpoint instead of a Llama")
    ap.add_argument("--experts", type=int, default=32, help="experts per layer with --moe")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="ppsplit-compile-bench-")
    src = os.path.join(work, "src")
    env = dict(os.environ, PPSPLIT_CACHE=os.path.join(work, "cache"))

    if not os.path.isdir(src):
        if args.moe:  # save_pretrained writes each expert's gate/up/down as its own tensor, as the hub stores them
            config = ("Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,"
                      f" num_experts={args.experts}, num_experts_per_tok=4, num_hidden_layers={args.layers},"
                      " num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,"
                      " tie_word_embeddings=False)")
        else:
            config = (f"LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers={args.layers},"
                      " num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)")
        build = (
            "import torch, transformers; from transformers import AutoModelForCausalLM;"
            f"cfg = transformers.{config};"
            "torch.manual_seed(0); m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16);"
            f"m.save_pretrained({src!r}, max_shard_size='200MB')")
        code, _, err, wall, _ = run_measured([sys.executable, "-c", build], env)
        assert code == 0, err
        print(f"built the checkpoint in {wall:.0f}s")
    shards = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(src, f)) for f in shards)

    def plain_copy():
        copy_dir = os.path.join(work, "copy")
        shutil.rmtree(copy_dir, ignore_errors=True)
        os.makedirs(copy_dir)
        start = time.perf_counter()
        for f in shards:
            shutil.copyfile(os.path.join(src, f), os.path.join(copy_dir, f))
        elapsed = time.perf_counter() - start
        shutil.rmtree(copy_dir)
        return elapsed

    copy_before = plain_copy()

    cli = [sys.executable, "-m", "ppsplit.cli"]
    code, _, err, idle_wall, idle_rss = run_measured([sys.executable, "-c", "import ppsplit, transformers"], env)
    demo_out = os.path.join(work, "demo-out")
    code, _, err, demo_wall, demo_rss = run_measured(cli + ["compile", "demo", "--pp", "2", "-o", demo_out, "--force"], env)
    assert code == 0, err
    out = os.path.join(work, "out")
    code, _, err, wall, rss = run_measured(cli + ["compile", src, "--pp", str(args.pp), "--aux", "eagle3", "-o", out,
                                                  "--force"], env)
    assert code == 0, err
    split_s = float(re.search(r"split into \d+ stages in ([\d.]+)s", err).group(1))
    total_s = float(re.search(r"wrote .* in ([\d.]+)s", err).group(1))
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    stage_bytes = [s["bytes"] for s in manifest["stages"]]
    write_s = total_s - split_s
    copy_after = plain_copy()  # the page cache's state differs before and after: report the copy both ways
    copy_s = min(copy_before, copy_after)

    gb = 1e9
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        n_tensors = len(json.load(f)["weight_map"])
    n_stage_tensors = sum(len(json.load(open(os.path.join(out, s["program"])))["tensors"]) for s in manifest["stages"])
    print(f"{'MoE (Qwen3-MoE-shaped, per-expert tensors)' if args.moe else 'Llama-shaped'}, {args.layers} layers: "
          f"{n_tensors} checkpoint tensors -> {n_stage_tensors} stage tensors")
    print(f"checkpoint: {len(shards)} shards, {size / gb:.2f} GB; output: {sum(stage_bytes) / gb:.2f} GB in "
          f"{len(stage_bytes)} stage files (largest {max(stage_bytes) / gb:.2f} GB)")
    print(f"{'step':<38} {'wall s':>7} {'peak RSS GB':>11} {'GB/s':>7}")
    print(f"{'plain copy of the shards, before':<38} {copy_before:>7.2f} {'':>11} {size / gb / copy_before:>7.2f}")
    print(f"{'plain copy of the shards, after':<38} {copy_after:>7.2f} {'':>11} {size / gb / copy_after:>7.2f}")
    print(f"{'python -c import ppsplit, transformers':<38} {idle_wall:>7.2f} {idle_rss / gb:>11.2f}")
    print(f"{'compile demo (7 MB), pp=2':<38} {demo_wall:>7.2f} {demo_rss / gb:>11.2f}")
    print(f"{'compile, whole command':<38} {wall:>7.2f} {rss / gb:>11.2f}")
    print(f"{'  of which trace + split':<38} {split_s:>7.2f}")
    print(f"{'  of which streaming the weights':<38} {write_s:>7.2f} {'':>11} {sum(stage_bytes) / gb / write_s:>7.2f}")
    print(f"peak RSS {rss / gb:.2f} GB vs largest stage {max(stage_bytes) / gb:.2f} GB + fixed overhead "
          f"(demo compile {demo_rss / gb:.2f} GB) = {(max(stage_bytes) + demo_rss) / gb:.2f} GB; "
          f"model {size / gb:.2f} GB")
    print(f"streaming read+write {sum(stage_bytes) / gb / write_s:.2f} GB/s vs the faster plain copy "
          f"{size / gb / copy_s:.2f} GB/s: x{(sum(stage_bytes) / write_s) / (size / copy_s):.2f}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
