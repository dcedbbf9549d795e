"""What the benchmarks share: the banner line, a random Llama-3.1-8B-shaped model, graph replays, and the inputs
and calls of a split's stages (the same for every script, so their figures compare)."""
from __future__ import annotations

import sys

import torch
import transformers

import ppsplit
from ppsplit.core.graphs import capture
from ppsplit.core.ragged import CacheLayout, RaggedStep

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from shapes import config  # noqa: E402


def banner(device: str) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return f"torch {torch.__version__}, transformers {transformers.__version__}, ppsplit {ppsplit.__version__}, {name}"


def build_model(shape: str, device: str, dtype=torch.bfloat16, **overrides):
    """A model of a published shape (``shapes.SHAPES``) with random weights, built on ``device``."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config(shape, **overrides), dtype=dtype).eval()


def graphed(fn, device: str = "cuda"):
    """``fn`` (no arguments, static inputs captured by closure) as a CUDA-graph replay; plain ``fn`` on the CPU."""
    if device != "cuda":
        return fn
    graph, _ = capture(fn, torch.device("cuda", torch.cuda.current_device()))
    graph.keep = fn  # the captured tensors stay alive with the graph
    return graph.replay


def stage_inputs(split, k: int, batch: int, tokens: int, position: int, device):
    """Random inputs of stage ``k``: token ids into stage 0, a hidden state of the stage's width (values carried
    beside the hidden state are zeros, valid for any of them) into the others, positions from ``position``."""
    gen = torch.Generator().manual_seed(k)
    if k == 0:
        x = torch.randint(0, 100, (batch, tokens), generator=gen)
    else:
        x = torch.randn(batch, tokens, split.plan.hidden_size, generator=gen).to(split.dtype)
        x = torch.nn.functional.pad(x, (0, split.plan.width(k) - split.plan.hidden_size))
    return x.to(device), torch.arange(position, position + tokens, device=device), split.new_aux(batch, tokens, device)


def stage_runs(split, batch: int, tokens: int, position: int, device: str):
    """One step through every stage in a row: on CUDA each stage's captured graph replayed, on the CPU the stages
    called. A paged split runs the lockstep batch as a ragged step (row ``b`` is sequence slot ``b``, the split's own
    lockstep allocation), so the step attends over ``position`` live keys per sequence as a lockstep one does.
    Returns a function that runs the step and returns the last stage's output (on CUDA its graph's static buffer)."""
    step = None
    if split.plan.paged:
        step = RaggedStep.lockstep(batch, tokens, position, CacheLayout.of(split.plan)).to(device)
    runs = []
    for k, stage in enumerate(split.stages):
        x, positions, aux = stage_inputs(split, k, batch, tokens, position, device)
        meta = (positions,)
        if step is not None:
            x, aux, meta = x.flatten(0, 1), aux.flatten(1, 2), step.tensors()
        if device == "cuda":
            g = ppsplit.cuda_graph(stage, 0, batch * tokens) if step is not None else \
                ppsplit.cuda_graph(stage, batch, tokens)
            g.x.copy_(x)
            for static, value in zip(g.meta, meta):
                static.copy_(value)
            runs.append(g.replay)
        else:
            runs.append(lambda stage=stage, inputs=(x, meta[0], aux, *meta[1:]): stage(*inputs)[0])

    def run():
        with torch.no_grad():
            for r in runs:
                out = r()
        return out
    run()
    return run
