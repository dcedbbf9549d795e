"""Drafter training data from a compiled pipeline (``ppsplit collect``): every sequence of a JSONL file goes through
the stages once and is written in the layout SpecForge's offline training reads (its ``OfflineEagle3Dataset`` /
``build_offline_eagle3_dataset``; SpecForge's ``scripts/prepare_hidden_states.py`` writes the same)::

    OUT/collect.json                  what OUT holds: the folder's plan fingerprint, taps, the prompts' hash, options
    OUT/rows_<a>-<b>/data_<i>.ckpt    row i of the prompts file (a torch.save dict), shards of ``shard_size`` rows:
        input_ids         int64 [T]
        loss_mask         int64 [T]            1 on the reply (what the drafter learns to predict), 0 elsewhere
        hidden_state      [1, T, H]            the target's last hidden state after the final norm (lm_head's input)
        aux_hidden_state  [1, T, n_taps * H]   the taps, ascending; tap j = HF hidden_states[j] (SpecForge's id j - 1)
        logits            [1, T, V]            only with ``logits=True``

``layout="dflash"`` writes the files SpecForge's DFlash-family offline training reads (``algorithms.common.
dflash_family_data``: ``normalize_offline_sample``): ``input_ids``, ``loss_mask`` and ``hidden_states [1, T, n_taps
* H]``, the taps ascending (any number; a DFlash drafter's ``target_layer_ids`` ``i`` is tap ``i + 1``), no final
hidden state.

``layout="speculators"`` writes what speculators' offline training reads (``speculators.train.data.ArrowDataset``
with its ``file`` hidden-states transfer, the layout its ``generate_offline_data`` writes from vLLM)::

    OUT/hidden_states/hs_<i>.safetensors   token_ids int64 [T], hidden_states [T, n_taps, H] (taps ascending; the
                                           last is tap L, the last layer's output before the final norm, which
                                           speculators reads as the verifier's last hidden state), loss_mask [T]
    OUT/data-*.arrow, state.json, ...      a ``datasets`` folder of input_ids, loss_mask, seq_len per row (torch
                                           format), written once every row is there

The folder must carry tap L (compile with ``--aux`` listing the drafter's taps and L).

Rows (one JSON object per line): ``{"prompt": str, "response": str}`` (one user turn and the assistant's reply under
the folder's chat template; without ``response`` the target answers greedily, ``generate`` new tokens at most),
``{"text": str}`` (as is, loss on every token), or ``{"input_ids": [...], "loss_mask": [...]}`` (mask optional: all
ones). Each file is written under a temporary name and renamed when complete, so a re-run skips the rows already
written and a failure leaves no half file; an OUT collected from other prompts, folder or options is refused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import fx

from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import fresh_copy, stage_vocab

log = logging.getLogger("ppsplit")
RECORD = "collect.json"
SHARD_SIZE = 5000  # rows per shard folder, as SpecForge's own writer groups them
LAYOUTS = ("eagle3", "dflash", "speculators")  # SpecForge's EAGLE-3 files; its DFlash-family files; speculators'
HIDDEN_STATES = "hidden_states"  # speculators' subfolder
_ROW_KEYS = ({"prompt"}, {"prompt", "response"}, {"text"}, {"input_ids"}, {"input_ids", "loss_mask"})
# The ops an lm_head runs as (traced; ppsplit's GEMV on a GPU; an FP8 head): the final hidden state is their input.
_HEAD_OPS = ("aten::linear", "aten::matmul", "aten::mm", "ppsplit::linear", "ppsplit::fp8_linear")


@dataclass(frozen=True)
class Row:
    """One sequence: token ids and loss mask; ``answer``: the target writes the reply (the ids are the prompt)."""

    index: int
    ids: tuple[int, ...]
    mask: tuple[int, ...]
    answer: bool = False


@dataclass(frozen=True)
class Record:
    """``collect.json``: a re-run into the same OUT must collect the same thing."""

    plan: str
    taps: tuple[int, ...]
    specforge_layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    prompts_sha256: str
    rows: int
    generate: int
    logits: bool
    shard_size: int
    layout: str = "eagle3"


def read_rows(path: str, tokenizer_folder: str | None = None) -> list[Row]:
    """The rows of a JSONL prompts file, tokenised (text with the folder's tokenizer and chat template); a bad line
    is a ``ConfigError`` naming it."""
    if not os.path.isfile(path):
        raise ConfigError(f"--prompts {path} is not a file; pass a JSONL file, one JSON object per line")
    tokenizer = None
    rows = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); write JSONL in UTF-8") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        data = _row_object(line, path, number)
        if tokenizer is None and "input_ids" not in data:
            tokenizer = _tokenizer(tokenizer_folder, path, number)
        rows.append(_row(len(rows), data, tokenizer, f"{path}:{number}"))
    if not rows:
        raise ConfigError(f"{path} holds no rows; write one JSON object per line, like {{\"prompt\": \"Hi\"}}")
    return rows


def _row_object(line: str, path: str, number: int) -> dict:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{number} is not JSON ({e.msg}); write one JSON object per line") from None
    if not isinstance(data, dict) or set(data) not in _ROW_KEYS:
        shown = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{path}:{number} has {shown}; a row is {{prompt[, response]}}, {{text}} or "
                          "{input_ids[, loss_mask]}")
    return data


def _tokenizer(folder: str | None, path: str, number: int):
    from ppsplit.artifact.tokenizer import FolderTokenizer, has_tokenizer

    if folder is None or not has_tokenizer(folder):
        raise ConfigError(f"{path}:{number} is text, but the folder has no tokenizer (tokenizer.json); give rows as "
                          "{\"input_ids\": [...]} or compile from a checkpoint that has one")
    return FolderTokenizer(folder)


def _row(index: int, data: dict, tokenizer, where: str) -> Row:
    for key in ("prompt", "response", "text"):
        if key in data and (not isinstance(data[key], str) or not data[key]):
            raise ConfigError(f"{where}: {key} must be a non-empty string")
    if "text" in data:
        ids = tokenizer.encode(data["text"])
        return Row(index, tuple(ids), (1,) * len(ids))
    if "prompt" in data:
        if tokenizer.chat_template is None:
            raise ConfigError(f"{where} is a prompt, but the folder's tokenizer has no chat template; give the row "
                              "as {\"text\": ...} instead")
        turn = [{"role": "user", "content": data["prompt"]}]
        if "response" not in data:
            prompt = tokenizer.encode_chat(turn)
            return Row(index, tuple(prompt), (0,) * len(prompt), answer=True)
        prompt, reply = tokenizer.encode_reply(turn, data["response"])
        return Row(index, tuple(prompt + reply), (0,) * len(prompt) + (1,) * len(reply))
    ids, mask = data["input_ids"], data.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
        raise ConfigError(f"{where}: input_ids must be a non-empty list of token ids")
    mask = [1] * len(ids) if mask is None else mask
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise ConfigError(f"{where}: loss_mask must be a list of 0 and 1, one per input id ({len(ids)})")
    return Row(index, tuple(ids), tuple(mask))


def check_rows(rows: list[Row], plan, generate: int) -> None:
    """Every row fits the folder: a length its cache holds, a reply to write only with ``generate``."""
    if generate < 0:
        raise ConfigError(f"--generate must be 0 or a number of new tokens, but got {generate}")
    if not plan.n_slots:
        raise ConfigError("the folder has no taps: compile it with --aux (eagle3, or ids like 2,16,29), or with "
                          "--drafter, to collect drafter training data")
    for row in rows:
        if row.answer and not generate:
            raise ConfigError(f"row {row.index} is a prompt without a response: pass --generate N to have the target "
                              "answer it, or give the response")
        length = len(row.ids) + (generate if row.answer else 0)
        if plan.max_len and length > plan.max_len:
            raise ConfigError(f"row {row.index} needs {length} positions but the folder's cache holds {plan.max_len}; "
                              "compile with a larger --max-len, or shorten the row")
    if generate and not plan.max_len:
        raise ConfigError("--generate needs a folder with a KV cache: compile it with --max-batch and --max-len")


# -- the output folder --------------------------------------------------------------------------------------------

def record_of(folder, rows_path: str, rows: int, generate: int, logits: bool, shard_size: int,
              layout: str = "eagle3") -> Record:
    from ppsplit.core.options import TAP_NUMBERINGS

    plan = folder.plan
    with open(rows_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return Record(plan=folder.fingerprint, taps=tuple(plan.taps),
                  specforge_layer_ids=tuple(j - TAP_NUMBERINGS["specforge"] for j in plan.taps),
                  hidden_size=plan.hidden_size, dtype=plan.dtype, prompts_sha256=digest, rows=rows,
                  generate=generate, logits=logits, shard_size=shard_size, layout=layout)


def open_output(out: str, record: Record) -> set[int]:
    """Create ``out`` (or resume it: it must hold the same ``record``); the rows already written there."""
    path = os.path.join(out, RECORD)
    if os.path.isfile(path):
        from ppsplit.artifact.folder import read_json_object

        try:
            old = read_json_object(path)
        except ConfigError:
            raise ConfigError(f"{path} is not the record collect writes (a JSON object); pass another -o, or remove "
                              f"{out} to start again") from None
        ours = json.loads(json.dumps(dataclasses.asdict(record)))
        old.setdefault("layout", "eagle3")  # written before there was a choice
        diff = [k for k in sorted(set(old) | set(ours)) if old.get(k) != ours.get(k)]
        if diff:
            raise ConfigError(f"{out} was collected with another {', '.join(diff)} ({RECORD}); pass another -o, or "
                              "remove it to start again")
    elif os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"{out} exists and is not a collect output (no {RECORD}); pass another -o")
    else:
        os.makedirs(out, exist_ok=True)
        _publish(path, lambda tmp: _write_json(tmp, dataclasses.asdict(record)))
    _remove_stale(out)
    return {i for i in range(record.rows) if os.path.isfile(sample_path(out, i, record.shard_size, record.layout))}


def _remove_stale(out: str) -> None:
    """A killed run's temporary files (one collect writes into OUT at a time)."""
    for shard in os.listdir(out):
        if (shard.startswith("rows_") or shard == HIDDEN_STATES) and os.path.isdir(os.path.join(out, shard)):
            for name in os.listdir(os.path.join(out, shard)):
                if ".ckpt.tmp-" in name or ".safetensors.tmp-" in name:
                    os.remove(os.path.join(out, shard, name))


def sample_path(out: str, index: int, shard_size: int, layout: str = "eagle3") -> str:
    if layout == "speculators":
        return os.path.join(out, HIDDEN_STATES, f"hs_{index}.safetensors")
    start = index // shard_size * shard_size
    return os.path.join(out, f"rows_{start}-{start + shard_size}", f"data_{index}.ckpt")


def write_sample(out: str, index: int, record: Record, tensors: dict[str, torch.Tensor]) -> None:
    """One row's file, whole or not at all (SpecForge lists only names ending ``.ckpt``, speculators reads
    ``hs_<i>.safetensors``)."""
    path = sample_path(out, index, record.shard_size, record.layout)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # clone / contiguous: torch.save writes a view's whole storage, safetensors wants contiguous tensors
    if record.layout == "speculators":
        from safetensors.torch import save_file

        _publish(path, lambda tmp: save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp))
    else:
        _publish(path, lambda tmp: torch.save({k: v.detach().cpu().clone() for k, v in tensors.items()}, tmp))


def finish(job: "Job") -> None:
    """speculators' layout: once every row's file is there, the ``datasets`` folder its trainer indexes them by."""
    record = job.record
    if record.layout != "speculators":
        return
    from safetensors import safe_open

    columns: dict = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(record.rows):
        path = sample_path(job.out, i, record.shard_size, record.layout)
        if not os.path.isfile(path):
            return  # an interrupted run: the next one writes the index
        with safe_open(path, framework="pt") as f:
            ids, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
        columns["input_ids"].append(ids.tolist())
        columns["loss_mask"].append(mask.tolist())
        columns["seq_len"].append(len(ids))
    import datasets

    index = datasets.Dataset.from_dict(columns)
    index.set_format(type="torch")  # as speculators' preprocessing leaves it: its dataset compares tensors
    index.save_to_disk(job.out)


def _publish(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def sample_tensors(row_ids: list[int], mask: list[int], hidden: torch.Tensor, aux: torch.Tensor,
                   logits: torch.Tensor | None, layout: str = "eagle3") -> dict[str, torch.Tensor]:
    """The file of one sequence of ``T`` tokens from the last stage's ``hidden [T, H]``, ``aux [n_slots, T, H]``
    and ``logits [T, V]``, in ``layout`` (``LAYOUTS``)."""
    n, t, h = aux.shape
    out = {"input_ids": torch.tensor(row_ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}
    taps = aux.permute(1, 0, 2).reshape(1, t, n * h)
    if layout == "dflash":
        out["hidden_states"] = taps
    elif layout == "speculators":
        out = {"token_ids": out["input_ids"], "hidden_states": aux.permute(1, 0, 2), "loss_mask": out["loss_mask"]}
    else:
        out.update(hidden_state=hidden.reshape(1, t, -1), aux_hidden_state=taps)
    if logits is not None:
        out["logits"] = logits.reshape(1, t, -1)
    return out


# -- the last stage's final hidden state ---------------------------------------------------------------------------

def with_head_input(stage: fx.GraphModule) -> fx.GraphModule:
    """A copy of the last stage (same tensors) that also returns the input of its head: ``y, aux, hidden``."""
    copy = fresh_copy(stage)
    output = next(n for n in reversed(copy.graph.nodes) if n.op == "output")
    y, aux = output.args[0]
    head = _head(y)
    if head is None:
        raise ConfigError("the last stage's logits do not come from a linear head, so its final hidden state cannot "
                          "be found; collect needs it (SpecForge trains on it)")
    output.args = ((y, aux, head.args[0]),)
    copy.graph.lint()
    copy.recompile()
    return copy


def _head(y: fx.Node) -> fx.Node | None:
    """The first head op above the logits, breadth first (a soft-cap or a cast may follow the head)."""
    seen, queue = {y}, [y]
    while queue:
        node = queue.pop(0)
        if node.op == "call_function" and getattr(node.target, "name", lambda: "")() in _HEAD_OPS:
            return node
        for up in node.all_input_nodes:
            if up not in seen:
                seen.add(up)
                queue.append(up)
    return None


class HeadInput(torch.nn.Module):
    """The last stage, keeping the final hidden state of its latest call in ``hidden``."""

    def __init__(self, stage: fx.GraphModule):
        super().__init__()
        self.stage = with_head_input(stage)
        self.hidden = None

    def forward(self, *args):
        y, aux, self.hidden = self.stage(*args)
        return y, aux


# -- in one process -----------------------------------------------------------------------------------------------

@dataclass
class Job:
    """A checked collection: where it writes, what it records, the rows still to write."""

    out: str
    record: Record
    rows: list[Row]
    skipped: int


@dataclass
class Report:
    written: int = 0
    skipped: int = 0
    tokens: int = 0
    seconds: float = 0.0


def prepare(folder: str, prompts: str, out: str, *, generate: int = 0, logits: bool = False,
            shard_size: int = SHARD_SIZE, layout: str = "eagle3") -> Job:
    """Everything that can be refused, before a stage loads: the folder's plan, the rows, ``out`` (created, or resumed
    when it holds the same collection). The rows already in ``out`` are left out of the job."""
    from ppsplit.artifact.folder import CompiledFolder

    opened = CompiledFolder(folder)
    if opened.plan.tp > 1:
        raise ConfigError(f"{folder} is cut for tensor parallelism (tp={opened.plan.tp}), which collect does not run: "
                          f"compile the model without --tp for collecting")
    if shard_size < 1:
        raise ConfigError(f"--shard-size must be at least 1, but got {shard_size}")
    if layout not in LAYOUTS:
        raise ConfigError(f"--layout must be one of {', '.join(LAYOUTS)}, but got {layout!r}")
    plan = opened.plan
    if layout == "speculators" and plan.num_layers not in plan.taps:
        raise ConfigError(f"--layout speculators stores the last layer's output (tap {plan.num_layers}) beside the "
                          f"taps, and {folder} carries {list(plan.taps)}: compile it with --aux "
                          f"{','.join(map(str, [*plan.taps, plan.num_layers]))}")
    rows = read_rows(prompts, folder)
    check_rows(rows, opened.plan, generate)
    record = record_of(opened, prompts, len(rows), generate, logits, shard_size, layout)
    done = open_output(out, record)
    return Job(out, record, [r for r in rows if r.index not in done], len(done))


@torch.no_grad()
def run(job: Job, split) -> Report:
    """Write ``job``'s rows through ``split`` (the folder, ``ppsplit.load``-ed), answering the prompts that ask for a
    reply first, a few batches at a time.

    Example::

        job = prepare("smollm2-pp2", "prompts.jsonl", "smollm2-data", generate=128)
        report = run(job, ppsplit.load("smollm2-pp2"))
    """
    report = Report(skipped=job.skipped)
    vocab = stage_vocab(split.stages[0])
    for row in job.rows:
        if max(row.ids) >= vocab:
            raise ConfigError(f"row {row.index} has token id {max(row.ids)}, outside the model's {vocab} ids")
    start = last_log = time.perf_counter()
    chunk = max(1, split.plan.max_batch) * 4
    for at in range(0, len(job.rows), chunk):
        rows = job.rows[at:at + chunk]
        if any(r.answer for r in rows):
            log.info("collect: the target answers rows %d to %d (%d new tokens at most)", rows[0].index,
                     rows[-1].index, job.record.generate)
        for row in answered(split, rows, job.record.generate):
            write_sample(job.out, row.index, job.record, forward(split, row, job.record.logits, job.record.layout))
            report.written += 1
            report.tokens += len(row.ids)
            if time.perf_counter() - last_log > 10:
                last_log = time.perf_counter()
                log.info("collect: %d of %d rows written (%d were already in %s), %.2f rows/s", report.written,
                         len(job.rows), job.skipped, job.out, report.written / (last_log - start))
    finish(job)
    report.seconds = time.perf_counter() - start
    return report


def forward(split, row: Row, logits: bool, layout: str = "eagle3") -> dict[str, torch.Tensor]:
    """One row through every stage, the last one keeping its final hidden state: the row's file."""
    last = split.stages[-1]
    split.stages[-1] = head = HeadInput(last)
    try:
        ids = torch.tensor([row.ids])
        y, aux = split(ids, torch.arange(ids.shape[1]))
    finally:
        split.stages[-1] = last
    t = ids.shape[1]
    hidden = head.hidden.reshape(t, -1)
    if hidden.shape[-1] != split.plan.hidden_size:
        raise ConfigError(f"the last stage's head reads a tensor of width {hidden.shape[-1]}, not the hidden state's "
                          f"{split.plan.hidden_size}; collect cannot find the final hidden state of this model")
    return sample_tensors(list(row.ids), list(row.mask), hidden, aux.reshape(aux.shape[0], t, -1),
                          y.reshape(t, -1) if logits else None, layout)


def answered(split, rows: list[Row], generate: int) -> list[Row]:
    """``rows`` with the target's greedy reply appended to those that ask for one (loss on the reply)."""
    asks = [r for r in rows if r.answer]
    if not asks:
        return rows
    prompts = [torch.tensor(r.ids) for r in asks]
    if split.plan.paged:
        outs = split.generate(prompts, generate)
    else:  # a lockstep cache holds one aligned batch: one prompt at a time
        outs = [split.generate(p[None], generate)[0] for p in prompts]
    replies = {r.index: tuple(o[len(r.ids):].tolist()) for r, o in zip(asks, outs)}
    return [dataclasses.replace(r, ids=r.ids + replies[r.index], mask=r.mask + (1,) * len(replies[r.index]),
                                answer=False) if r.answer else r for r in rows]
