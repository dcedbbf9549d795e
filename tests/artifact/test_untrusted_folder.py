"""A compiled folder is untrusted input: no string in it runs as code, and every malformed folder is one ppsplit
error naming the file, the same from ``inspect``, ``load``, ``load_stage`` and the first forward step. Its files are
regular files inside it (no pipe, device or link leading out is opened), its chat template and tokenizer run within
a budget, and what loading it allocates is printed by ``inspect`` and capped."""
import hashlib
import json
import os
import shutil
import signal
import stat
import time

import pytest
import torch

import ppsplit
from ppsplit.cli import main
from ppsplit.core.errors import PpsplitError
from tests.support import drafter_config, random_drafter_tensors, write_drafter
from tests.support import VOCAB, tiny_model

JSON_FILES = ("plan.json", "manifest.json", "stage_0.json", "stage_1.json")
# Code payloads, each as a default-argument injection, an expression, a statement break, or a quote break; {mark}
# is a file that any payload which runs creates.
PAYLOADS = (
    'aux=open("{mark}", "w").close()',
    '__import__("os").system("touch {mark}")',
    'x\n__import__("os").system("touch {mark}")\n',
    'x"); open("{mark}", "w").close(); ("',
    "x'); open('{mark}', 'w').close(); ('",
    'a.b).__class__.__init__.__globals__["os"].system("touch {mark}"',
    "lambda: open('{mark}', 'w')",
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A two-stage folder of a tiny Llama with taps, a KV cache and a drafter (every kind of field present)."""
    root = tmp_path_factory.mktemp("untrusted")
    model = tiny_model("llama", num_layers=4)
    model.save_pretrained(root / "ckpt")
    cfg = drafter_config(model.config, aux_ids=[0, 1, 2])
    drafter = write_drafter(str(root / "drafter"), cfg, random_drafter_tensors(cfg))
    out = str(root / "folder")
    ppsplit.compile_model(str(root / "ckpt"), out, pp=2, cache=ppsplit.CacheConfig(batch_size=1, max_len=16),
                          drafter=drafter)
    return out


def strings(data, path=()):
    """``(path, is_key)`` for every string value and every object key in ``data``."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield path + (k,), True
            yield from strings(v, path + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from strings(v, path + (i,))
    elif isinstance(data, str):
        yield path, False


def kind_of(data, path, is_key) -> tuple:
    """The kind of field at ``path``: the path with list indices blanked, and the op of a program node."""
    kind, node = [], data
    for p in path:
        kind.append("*" if isinstance(p, int) else p)
        node = node[p]
        if isinstance(node, dict) and "op" in node and "name" in node:
            kind.append(node["op"])
    return tuple(kind) + (is_key,)


def mutated(data, path, is_key, payload):
    data = json.loads(json.dumps(data))
    parent = data
    for p in path[:-1]:
        parent = parent[p]
    if is_key:
        parent[payload] = parent.pop(path[-1])
    else:
        parent[path[-1]] = payload
    return data


def cases(folder: str, per_kind: int = 1):
    for name in JSON_FILES:
        data = json.load(open(os.path.join(folder, name)))
        seen: dict = {}
        for path, is_key in strings(data):
            kind = kind_of(data, path, is_key)
            if seen.get(kind, 0) < per_kind:
                seen[kind] = seen.get(kind, 0) + 1
                yield name, data, path, is_key


def copy_folder(src: str, dst: str) -> str:
    """The folder's JSON files copied, its tensor files linked (the mutations touch JSON only)."""
    os.makedirs(dst)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(s):
            shutil.copytree(s, d)
        elif name.endswith(".safetensors"):
            os.link(s, d)
        else:
            shutil.copyfile(s, d)
    return dst


def outcome(folder: str, capsys) -> str:
    """``"ok"`` or ``"error"`` from inspect, load and a forward step, which must agree; any other exception fails."""
    code = main(["inspect", folder])
    err = capsys.readouterr().err
    assert code in (0, 2), code
    if code == 2:
        assert err.startswith("ppsplit: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    try:
        split = ppsplit.load(folder)
        for k in range(split.plan.pp):
            ppsplit.load_stage(folder, k)
        logits, _ = split(torch.tensor([[3, 4, 5]]), torch.arange(3))
        assert torch.isfinite(logits).all()
        loaded = "ok"
    except PpsplitError:
        loaded = "error"
    assert loaded == ("ok" if code == 0 else "error"), (loaded, err)
    return loaded


def test_no_string_of_a_folder_runs_code(compiled, tmp_path, capsys):
    mark = str(tmp_path / "PWNED")
    results = {"ok": 0, "error": 0}
    n = 0
    for name, data, path, is_key in cases(compiled):
        for payload in PAYLOADS:
            folder = copy_folder(compiled, str(tmp_path / f"case{n}"))
            n += 1
            with open(os.path.join(folder, name), "w") as f:
                json.dump(mutated(data, path, is_key, payload.format(mark=mark)), f)
            try:
                results[outcome(folder, capsys)] += 1
            except AssertionError as e:
                raise AssertionError(f"{name} {'key' if is_key else 'value'} at {path}: {e}") from None
            assert not os.path.exists(mark), f"{name} {path}: the payload ran"
            shutil.rmtree(folder)
    # The walk reached every kind of field: placeholders, attribute reads, calls, keywords, tensors, plan, manifest.
    assert n > 1000 and results["error"] > 500, (n, results)


def test_the_reported_injection_is_refused(compiled, tmp_path, capsys):
    """The attack from the report: a placeholder target with a default argument."""
    folder = copy_folder(compiled, str(tmp_path / "f"))
    mark = tmp_path / "PWNED"
    path = os.path.join(folder, "stage_0.json")
    data = json.load(open(path))
    node = data["program"]["nodes"][2]
    assert (node["op"], node["target"]) == ("placeholder", "aux")
    node["target"] = f'aux=open("{mark}", "w").close()'
    json.dump(data, open(path, "w"))
    assert outcome(folder, capsys) == "error"
    assert not mark.exists()
    with pytest.raises(PpsplitError, match=r"stage_0.json: nodes\[2\]: the program.s inputs must be x, positions, aux"):
        ppsplit.load(folder)


class Raw:
    """An edit of a file's bytes (the others edit its JSON)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, raw):
        return self.fn(raw)


def rewrite(folder, name, edit):
    path = os.path.join(folder, name)
    if not isinstance(edit, Raw):
        data = json.load(open(path))
        edit(data)
        json.dump(data, open(path, "w"))
    else:
        with open(path, "rb") as f:
            raw = f.read()
        with open(path, "wb") as f:
            f.write(edit(raw))


def set_path(keys, value):
    def edit(data):
        for k in keys[:-1]:
            data = data[k]
        data[keys[-1]] = value
    return edit


def first_file_tensor(folder, k=1):
    data = json.load(open(os.path.join(folder, f"stage_{k}.json")))
    return next(i for i, t in enumerate(data["tensors"]) if t["init"] == "file")


def weights_edit(change):
    def edit(raw):
        import safetensors.torch

        tensors = safetensors.torch.load(raw)
        change(tensors)
        return safetensors.torch.save(tensors, metadata={"format": "pt"})
    return Raw(edit)


MALFORMED = {
    "bad_json": ("plan.json", Raw(lambda raw: raw[: len(raw) // 2]), "plan.json is not valid JSON"),
    "plan_dtype": ("plan.json", set_path(["dtype"], "float8"), "plan.json: dtype 'float8' is not one of"),
    "plan_field_type": ("plan.json", set_path(["num_layers"], "4"), "plan.json.num_layers must be an integer"),
    "plan_unknown_field": ("plan.json", set_path(["extra"], 1), "plan.json has unknown field 'extra'"),
    "stage_list_type": ("plan.json", set_path(["stages"], {"0": 1}), "plan.json.stages must be a list"),
    "manifest_type": ("manifest.json", set_path(["eos_token_id"], "2"), "manifest.json.eos_token_id must be a list"),
    "manifest_files": ("manifest.json", set_path(["stages", 0, "weights"], "../x.safetensors"),
                       "stage 0's files must be stage_0.json and stage_0.safetensors"),
    "unknown_op": ("stage_1.json", None, "operator aten::no_such_op.default is not registered"),
    "tensor_dtype": ("stage_1.json", None, "dtype 'float9' is not one of"),
    "tensor_shape_type": ("stage_1.json", None, "shape[0] must be an integer"),
    "node_shape": ("stage_1.json", None, "ppsplit.shape = 'x' is not a list of sizes or nulls"),
    "stage_index": ("stage_1.json", set_path(["stage"], "1"), "stage_1.json: stage must be an integer"),
    "fingerprint": ("plan.json", set_path(["model_class"], "Other"), "was written with another plan.json"),
    "tensor_missing": ("stage_1.safetensors", None, "does not hold the tensors stage_1.json lists"),
    "tensor_shape": ("stage_1.safetensors", None, "the program expects"),
    "tensor_dtype_file": ("stage_1.safetensors", None, "the program expects"),
    "truncated": ("stage_1.safetensors", Raw(lambda raw: raw[:-100]), "the file is incomplete or corrupt"),
    "oversized": ("stage_1.safetensors", Raw(lambda raw: raw + b"\0" * 64), "the file is incomplete or corrupt"),
    "drafter_config": ("drafter/config.json", set_path(["hidden_size"], "64"), "hidden_size must be an integer"),
    "drafter_taps": ("drafter/config.json", set_path(["ppsplit_taps"], [0, 7]), "the drafter reads taps [0, 7]"),
    "drafter_tensor": ("drafter/drafter.safetensors", None, "has no embed_tokens.weight"),
}


def malformed_edit(case, folder):
    name, edit, _ = MALFORMED[case]
    k = first_file_tensor(folder)
    stored = json.load(open(os.path.join(folder, "stage_1.json")))["tensors"][k]["name"]
    edits = {
        "unknown_op": lambda d: next(n for n in d["program"]["nodes"] if n["op"] == "call_function"
                                     and n["target"].startswith("aten::")).update(target="aten::no_such_op.default"),
        "tensor_dtype": lambda d: d["tensors"][k].update(dtype="float9"),
        "tensor_shape_type": lambda d: d["tensors"][k].update(shape=["64"] + d["tensors"][k]["shape"][1:]),
        "node_shape": lambda d: next(n for n in d["program"]["nodes"] if "ppsplit.shape" in n.get("meta", {}))[
            "meta"].update({"ppsplit.shape": "x"}),
        "tensor_missing": weights_edit(lambda t: t.pop(stored)),
        "tensor_shape": weights_edit(lambda t: t.update({stored: t[stored].flatten()[:-1].clone()})),
        "tensor_dtype_file": weights_edit(lambda t: t.update({stored: t[stored].double()})),
        "drafter_tensor": weights_edit(lambda t: t.pop("embed_tokens.weight")),
    }
    rewrite(folder, name, edit or edits[case])


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_folder_is_one_error_naming_the_file(compiled, tmp_path, capsys, case):
    folder = copy_folder(compiled, str(tmp_path / "f"))
    for name in ("stage_1.safetensors", "drafter/drafter.safetensors"):  # edited in place below: unlink first
        path = os.path.join(folder, name)
        data = open(path, "rb").read()
        os.remove(path)
        open(path, "wb").write(data)
    malformed_edit(case, folder)
    name, _, message = MALFORMED[case]
    assert outcome(folder, capsys) == "error"
    main(["inspect", folder])
    err = capsys.readouterr().err
    assert os.path.basename(name) in err and message in err, err
    with pytest.raises(PpsplitError, match=None) as raised:
        ppsplit.load(folder)
    assert message in str(raised.value)


def test_folders_of_the_earlier_layout_still_load(compiled, tmp_path):
    """A manifest without stage_options (fuse_projections at the top), programs without a plan fingerprint and of
    version 1 (no static shapes on the nodes): what ppsplit wrote before this format."""
    folder = copy_folder(compiled, str(tmp_path / "old"))

    def old_manifest(d):
        d.pop("stage_options")
        d["fuse_projections"] = True

    def old_program(d):
        d.pop("plan_sha256")
        d["program"]["version"] = 1
        for node in d["program"]["nodes"]:
            node.get("meta", {}).pop("ppsplit.shape", None)
    rewrite(folder, "manifest.json", old_manifest)
    for k in range(2):
        rewrite(folder, f"stage_{k}.json", old_program)
    split = ppsplit.load(folder)
    assert split.stages[0].meta["ppsplit.projections"] is not None  # fuse_projections came from the old field
    ref = ppsplit.load(compiled, fuse_projections=True)
    ids = torch.tensor([[3, 4, 5]])
    torch.testing.assert_close(split(ids, torch.arange(3))[0], ref(ids, torch.arange(3))[0])


def test_tokenizer_files_are_data_and_python_files_are_never_copied(tmp_path):
    """compile copies the tokenizer and generation files, never a Python file beside them; the folder's tokenizer
    is read with the tokenizers library and its chat template rendered in Jinja's sandbox."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ppsplit.artifact.tokenizer import FolderTokenizer

    model = tiny_model("llama", num_layers=2)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    mark = tmp_path / "PWNED"
    (ckpt / "tokenization_evil.py").write_text(f"open({str(mark)!r}, 'w')\n")
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}, "eos_token": "w2",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}{{ ''.__class__.__mro__ }}"}))
    out = ppsplit.compile_model(str(ckpt), str(tmp_path / "out"), pp=1)
    assert not any(name.endswith(".py") for name in os.listdir(out))
    t = FolderTokenizer(out)
    assert t.encode("w5 w6") == [5, 6] and t.decode([5, 6]) == "w5 w6" and t.eos_token_ids == (2,)
    with pytest.raises(PpsplitError, match="sandbox forbids"):  # the sandbox blocks __class__ / __mro__
        t.apply_chat_template([{"role": "user", "content": "w5"}])
    assert not mark.exists()


# -- files that are not what they claim: pipes, devices, links leading out, sizes ---------------------------------

class Hang(AssertionError):
    pass


def within(seconds: float, fn, *args):
    """``fn(*args)``, failing the test (not hanging it) if it has not returned after ``seconds``: a timer signal
    interrupts a blocked ``open`` or ``read``."""
    def hang(signum, frame):
        raise Hang(f"{getattr(fn, '__name__', fn)} did not return within {seconds} s (it hangs)")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def replace(folder: str, name: str, kind: str, outside: str) -> None:
    """Turn ``folder/name`` into ``kind``: a named pipe, a character device (``/dev/zero``'s), a link to ``/dev/zero``,
    a link to a copy of the file outside the folder (or to a pipe there, which would block whoever opened it), a
    100 MiB sparse file, a folder."""
    path = os.path.join(folder, name)
    if kind == "copy outside":
        target = os.path.join(outside, name.replace("/", "_"))
        (shutil.copytree if os.path.isdir(path) else shutil.copyfile)(path, target)
    elif kind == "pipe outside":
        target = os.path.join(outside, "pipe_" + name.replace("/", "_"))
        os.mkfifo(target)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    if kind == "pipe":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("making a device node needs CAP_MKNOD")
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    elif kind in ("copy outside", "pipe outside"):
        os.symlink(target, path)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(100 << 20)
    elif kind == "folder":
        os.mkdir(path)


FILE_CASES = {  # (file, what it becomes) -> what the one-line error says
    ("plan.json", "pipe"): "plan.json is a named pipe, not a regular file",
    ("manifest.json", "zero"): "manifest.json leads to /dev/zero, outside",
    ("stage_1.json", "device"): "stage_1.json is a character device",
    ("stage_1.json", "copy outside"): "outside",
    ("stage_1.json", "huge"): "holds 104,857,600 bytes, more than the 67,108,864",
    ("stage_0.json", "folder"): "stage_0.json is a folder",
    ("stage_0.safetensors", "copy outside"): "outside",
    ("stage_1.safetensors", "pipe outside"): "outside",
    ("stage_1.safetensors", "zero"): "leads to /dev/zero, outside",
    ("stage_0.safetensors", "device"): "stage_0.safetensors is a character device",
    ("drafter/config.json", "pipe"): "config.json is a named pipe",
    ("drafter/drafter.safetensors", "copy outside"): "outside",
    ("drafter", "copy outside"): "outside",
}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("name,kind", sorted(FILE_CASES), ids=[f"{n}-{k}" for n, k in sorted(FILE_CASES)])
def test_pipes_devices_and_links_leading_out_are_refused_in_one_line(with_tokenizer, tmp_path, capsys, name, kind):
    folder = copy_folder(with_tokenizer, str(tmp_path / "f"))  # with a tokenizer, so that serve gets to the files
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    replace(folder, name, kind, outside)
    says = FILE_CASES[name, kind]
    assert within(30, main, ["inspect", folder]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ppsplit: error: ") and err.count("\n") == 1 and says in err, err
    assert within(60, main, ["serve", folder, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ppsplit: error: ") and err.count("\n") == 1 and says in err, err
    with pytest.raises(PpsplitError, match=None) as raised:
        within(30, ppsplit.load, folder)
    assert says in str(raised.value)
    if name.endswith(".safetensors") and "/" not in name:  # what one rank of load or serve reads
        with pytest.raises(PpsplitError, match=None) as raised:
            within(30, ppsplit.load_stage, folder, int(name[6]))
        assert says in str(raised.value)


def test_a_link_that_stays_inside_the_folder_loads(compiled, tmp_path, capsys):
    folder = copy_folder(compiled, str(tmp_path / "f"))
    os.makedirs(os.path.join(folder, "weights"))
    os.rename(os.path.join(folder, "stage_0.safetensors"), os.path.join(folder, "weights", "stage_0.safetensors"))
    os.symlink(os.path.join("weights", "stage_0.safetensors"), os.path.join(folder, "stage_0.safetensors"))
    assert outcome(folder, capsys) == "ok"


def test_a_drafter_folder_with_files_ppsplit_never_writes_is_refused(compiled, tmp_path, capsys):
    """``read_drafter`` prefers model.safetensors to drafter.safetensors: a folder must not slip one in."""
    folder = copy_folder(compiled, str(tmp_path / "f"))
    shutil.copyfile(os.path.join(folder, "drafter", "drafter.safetensors"),
                    os.path.join(folder, "drafter", "model.safetensors"))
    assert outcome(folder, capsys) == "error"
    with pytest.raises(PpsplitError, match="model.safetensors is not a file ppsplit writes"):
        ppsplit.load(folder)


# -- what loading allocates ----------------------------------------------------------------------------------------

def refingerprint(folder: str) -> None:
    """Record plan.json's fingerprint in every program again: a hostile folder can, so the checks must not lean on
    it."""
    digest = hashlib.sha256(open(os.path.join(folder, "plan.json"), "rb").read()).hexdigest()[:16]
    for k in range(2):
        rewrite(folder, f"stage_{k}.json", set_path(["plan_sha256"], digest))


def test_inspect_prints_every_allocation_and_refuses_one_past_the_cap(compiled, tmp_path, capsys):
    folder = copy_folder(compiled, str(tmp_path / "f"))
    assert main(["inspect", folder]) == 0
    out = capsys.readouterr().out
    programs = [json.load(open(os.path.join(folder, f"stage_{k}.json"))) for k in range(2)]
    zeros = [t for t in programs[1]["tensors"] if t["init"] == "zeros"]
    assert zeros, "the folder has a KV cache"
    assert "memory loading allocates" in out and f"{zeros[0]['name']} " in out.split("largest zero-initialised")[1]
    # A zero-initialised buffer of 4 TiB, as a program may declare one: printed and refused, by inspect and load.
    def huge(d):
        t = next(t for t in d["tensors"] if t["init"] == "zeros")
        t["shape"] = [1 << 40] + [1] * (len(t["shape"]) - 1)
        t["dtype"] = "float32"
    rewrite(folder, "stage_1.json", huge)
    start = time.monotonic()
    assert main(["inspect", folder]) == 2
    captured = capsys.readouterr()
    assert "4.0 TiB" in captured.out and captured.err.count("\n") == 1
    assert "stage 1 allocates 4.0 TiB" in captured.err and "--max-memory 4097GiB" in captured.err, captured.err
    with pytest.raises(PpsplitError, match="stage 1 of .* allocates 4.0 TiB .* more than cpu has"):
        ppsplit.load(folder)
    assert time.monotonic() - start < 60  # refused before anything was allocated
    assert main(["inspect", folder, "--max-memory", "5TiB"]) == 0  # asked for: printed, not refused
    assert main(["inspect", compiled, "--max-memory", "1KiB"]) == 2
    assert "more than the cap of 1.0 KiB (--max-memory)" in capsys.readouterr().err


def test_an_absurd_cache_in_the_plan_is_refused_before_anything_is_allocated(compiled, tmp_path, capsys):
    folder = copy_folder(compiled, str(tmp_path / "f"))
    rewrite(folder, "plan.json", lambda d: d.update(max_batch=10 ** 9, max_len=10 ** 9, num_blocks=10 ** 12))
    refingerprint(folder)
    assert within(60, outcome, folder, capsys) == "error"
    main(["inspect", folder])
    assert "makes the scheduler keep" in capsys.readouterr().err


# -- the tokenizer and chat template: through inspect, load and serve ---------------------------------------------

CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
ESCAPES = (  # each would run a shell command outside Jinja's sandbox
    "{{ cycler.__init__.__globals__.os.popen('touch MARK').read() }}",
    "{{ joiner.__init__.__globals__['os'].system('touch MARK') }}",
    "{{ lipsum.__globals__['os'].system('touch MARK') }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARK') }}",
    "{{ raise_exception.__globals__['os'].system('touch MARK') }}",
    "{{ strftime_now.__globals__['os'].system('touch MARK') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARK') }}",
    "{% set x = messages.append({'role': 'system', 'content': 'touch MARK'}) %}",
    "{{ (messages|attr('__class__')).__base__.__subclasses__() }}",
)
TEMPLATES = {  # chat template -> what inspect and serve say ("ok": they pass)
    "ok": (CHAT, "ok"),
    "raises on a system turn only": ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
                                     "{% endif %}" + CHAT, "ok"),
    "loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i * j %}{% endfor %}{% endfor %}",
              "took longer than 2 s"),
    "floods": ("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}", "characters, its limit"),
    "raises": ("{{ raise_exception('roles must alternate') }}", "refused these messages: roles must alternate"),
    "divides by zero": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "recurses": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    "allocates": ("{{ ([1] * 10 ** 10) | length }}", "ran out of memory"),
    "does not parse": ("{% for %}", "does not parse"),
    "is 2 MiB": ("x" * (2 << 20), "more than the 1,048,576 ppsplit compiles"),
    **{f"escape {i}": (t, "") for i, t in enumerate(ESCAPES)},
}


def tokenizer_json(vocab: int, pre_tokenizer=None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.Whitespace()
    return tok.to_str()


@pytest.fixture(scope="module")
def with_tokenizer(compiled, tmp_path_factory):
    """``compiled`` with a tokenizer and a chat template (what ppsplit compile copies from a checkpoint)."""
    folder = copy_folder(compiled, str(tmp_path_factory.mktemp("tok") / "f"))
    open(os.path.join(folder, "tokenizer.json"), "w").write(tokenizer_json(VOCAB))
    json.dump({"eos_token": "w2", "chat_template": CHAT}, open(os.path.join(folder, "tokenizer_config.json"), "w"))
    return folder


def verdicts(folder: str, capsys) -> str:
    """``"ok"`` or the one-line error, the same from ``inspect`` and ``serve`` (which checks the folder as inspect
    does before it loads anything); ``load`` reads no tokenizer file and must load regardless."""
    code = within(60, main, ["inspect", folder, "--max-memory", "64GiB"])
    err = capsys.readouterr().err
    assert code in (0, 2) and (code == 0) == (err == ""), err
    if code == 2:
        assert err.startswith("ppsplit: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert within(60, main, ["serve", folder, "--port", "0"]) == 2
        assert capsys.readouterr().err == err  # serve refuses with inspect's words
    split = within(60, ppsplit.load, folder)
    assert torch.isfinite(split(torch.tensor([[3, 4, 5]]), torch.arange(3))[0]).all()
    return "ok" if code == 0 else err


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_chat_templates_inspect_as_they_serve(with_tokenizer, tmp_path, capsys, monkeypatch, case):
    folder = copy_folder(with_tokenizer, str(tmp_path / "f"))
    mark = tmp_path / "PWNED"
    template, says = TEMPLATES[case]
    json.dump({"eos_token": "w2", "chat_template": template.replace("MARK", str(mark))},
              open(os.path.join(folder, "tokenizer_config.json"), "w"))
    monkeypatch.setattr("ppsplit.serve.openai_api.PROMPT_SECONDS", 2.0)  # inspect's and serve's default, shortened
    start = time.monotonic()
    verdict = verdicts(folder, capsys)
    assert time.monotonic() - start < 60
    assert not mark.exists(), "the template ran a command"
    if says == "ok":
        assert verdict == "ok"
    else:
        assert verdict != "ok" and says in verdict, verdict


def test_template_and_tokenizer_files_that_are_not_regular_files_inside(with_tokenizer, tmp_path, capsys):
    from tokenizers import Regex, pre_tokenizers

    cases = {  # (file, what it becomes) -> what the one-line error says
        ("tokenizer.json", "pipe"): "tokenizer.json is a named pipe",
        ("tokenizer.json", "zero"): "tokenizer.json leads to /dev/zero, outside",
        ("tokenizer.json", "device"): "tokenizer.json is a character device",
        ("tokenizer.json", "huge"): "more than the 67,108,864",
        ("tokenizer.json", "pipe outside"): "outside",
        ("tokenizer_config.json", "pipe"): "tokenizer_config.json is a named pipe",
        ("tokenizer_config.json", "copy outside"): "outside",
        ("special_tokens_map.json", "zero"): "special_tokens_map.json leads to /dev/zero",
        ("generation_config.json", "pipe outside"): "outside",
        ("chat_template.jinja", "device"): "chat_template.jinja is a character device",
        ("chat_template.jinja", "pipe"): "chat_template.jinja is a named pipe",
    }
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    for n, ((name, kind), says) in enumerate(sorted(cases.items())):
        folder = copy_folder(with_tokenizer, str(tmp_path / f"f{n}"))
        if not os.path.exists(os.path.join(folder, name)):
            open(os.path.join(folder, name), "w").write("{}")
        replace(folder, name, kind, outside)
        verdict = verdicts(folder, capsys)
        assert says in verdict, (name, kind, verdict)
    # A tokenizer.json that is no tokenizer, and one whose regex backtracks past the engine's limit on any chat.
    for n, (text, says) in enumerate([
            ('{"model": {"type": "Nothing"}}', "is not a tokenizer the tokenizers library reads"),
            (tokenizer_json(VOCAB, pre_tokenizers.Split(Regex(r"(.|.)*\d"), "isolated")), "retry-limit-in-match")]):
        folder = copy_folder(with_tokenizer, str(tmp_path / f"t{n}"))
        open(os.path.join(folder, "tokenizer.json"), "w").write(text)
        verdict = verdicts(folder, capsys)
        assert says in verdict, verdict


def test_the_template_process_has_a_memory_limit(tmp_path):
    from ppsplit.artifact.sandbox import Budget, BudgetError, Sandbox

    box = Sandbox({"tokenizer": tokenizer_json(8), "template": "{{ ('x' * 2 ** 30) | length }}", "specials": {},
                   "add_bos": False}, Budget(max_memory=512 << 20))
    try:
        with pytest.raises(BudgetError, match="ran out of memory"):
            box.call("render", messages=[{"role": "user", "content": "w1"}], add_generation_prompt=True)
        assert box.call("encode", text="w1 w3", add_special_tokens=True) == [1, 3]  # a fresh process answers
    finally:
        box.close()
