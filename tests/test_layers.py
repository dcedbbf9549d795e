"""The house rules, per folder, checked on the imports and names of every module:

    core                 imports nothing of ppsplit above it
    passes, kernels      import only the core and the kernels (kernels: only the core)
    artifact < eagle3 < serve < distributed < compile < cli      imports point down this order
    serving (artifact, serve, distributed) imports no compile code, no transformers, and of the passes only the
    stage rewrites; eagle3 reads raw drafter checkpoints with transformers' rotary code, nothing else of it
    no import cycle between folders; no private name of one module used in another (tests included)
"""
import ast
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"ppsplit": "ppsplit", "ppsplit.passes": "passes", "ppsplit.triton_kernels": "triton_kernels"}
# Folder -> layer. The facade (ppsplit/__init__.py) and ``python -m ppsplit.run`` sit on top.
LAYERS = {"ppsplit.core": 0, "ppsplit.triton_kernels": 1, "ppsplit.passes": 2, "ppsplit.artifact": 3,
          "ppsplit.eagle3": 4, "ppsplit.serve": 5, "ppsplit.distributed": 6, "ppsplit.compile": 7, "ppsplit.cli": 8,
          "ppsplit": 9}
SERVING = ("ppsplit.artifact", "ppsplit.serve", "ppsplit.distributed")
REWRITES = "ppsplit.passes.rewrites"


def modules(folders=FOLDERS) -> dict[str, str]:
    """Every module of the package (installed names) -> its file."""
    found = {}
    for package, folder in folders.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            sub = os.path.relpath(dirpath, base).replace(os.sep, ".")
            prefix = package if sub == "." else f"{package}.{sub}"
            for name in sorted(files):
                if name.endswith(".py"):
                    found[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(dirpath, name)
    return found


def imports(path: str, known: set) -> list[tuple[str, str | None, int]]:
    """(module imported, name imported from it or None, line) for every import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                # `from ppsplit.passes import trace` imports a module, not a name.
                out.append((full, None, node.lineno) if full in known else (node.module, a.name, node.lineno))
    return out


def folder(module: str) -> str:
    """The folder (layer) of a module: the longest LAYERS key it falls under."""
    return max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)


def test_imports_follow_the_layers_without_cycles_or_private_names():
    mods = modules()
    known = set(mods)
    graph = {f: set() for f in LAYERS}
    problems = []
    for mod, path in mods.items():
        here = folder(mod)
        for target, name, line in imports(path, known):
            where = f"{os.path.relpath(path, ROOT)}:{line}"
            top = target.split(".")[0]
            if top == "transformers":
                exempt = mod == "ppsplit.eagle3.formats" and name in ("LlamaConfig", "LlamaRotaryEmbedding")
                if (here in SERVING or here == "ppsplit.eagle3") and not exempt:
                    problems.append(f"{where}: {mod} (serving) imports transformers")
                if LAYERS[here] <= LAYERS["ppsplit.artifact"] and here != "ppsplit.passes":
                    problems.append(f"{where}: {mod} imports transformers")
            if top != "ppsplit":
                continue
            resolved = target if target in known else target.rsplit(".", 1)[0]
            if resolved not in known:
                problems.append(f"{where} imports unknown module {target}")
                continue
            there = folder(resolved)
            if name and name.startswith("_") and not name.endswith("__") and resolved != mod:
                problems.append(f"{where} imports the private name {name} from {resolved}")
            if resolved == "ppsplit":
                if name not in (None, "__version__") and mod != "ppsplit":
                    problems.append(f"{where}: {mod} imports {name} from the facade; import it from its module")
                continue
            if there != here:
                graph[here].add(there)
            if LAYERS[there] > LAYERS[here]:
                problems.append(f"{where}: {mod} ({here}) imports {resolved} ({there}), a layer above it")
            elif LAYERS[there] == LAYERS[here] and there != here:
                problems.append(f"{where}: {mod} ({here}) imports {resolved} ({there}) of the same layer")
            if here == "ppsplit.triton_kernels" and there not in ("ppsplit.core", here):
                problems.append(f"{where}: a kernel imports {resolved}")
            if here in SERVING + ("ppsplit.eagle3",) and (
                    there == "ppsplit.compile" or there == "ppsplit.passes" and not resolved.startswith(REWRITES)):
                problems.append(f"{where}: {mod} (serving) imports compile code {resolved}")
    assert not problems, "\n".join(problems)

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(f):
        state[f] = 1
        stack.append(f)
        for t in sorted(graph[f]):
            if state.get(t) == 1:
                pytest.fail("import cycle between folders: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[f] = 2

    for f in sorted(graph):
        if f not in state:
            visit(f)
    # Below the command line, the facade is read for its version only: everything else comes from its own module.
    for mod, path in mods.items():
        if folder(mod) in ("ppsplit", "ppsplit.cli"):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ppsplit" \
                    and node.attr != "__version__" and f"ppsplit.{node.attr}" not in known:
                problems.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {mod} uses ppsplit.{node.attr} from "
                                "the facade; import it from its module")
    assert not problems, "\n".join(problems)
    # The facade imports nothing of its own at import time.
    assert not [t for t, _, _ in imports(mods["ppsplit"], known) if t.startswith("ppsplit")]


def defined_private_names(path: str) -> set[str]:
    """Names with one leading underscore that a module defines: functions, classes, methods, module and class
    attributes, and attributes it sets on ``self``."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def external_names(tree) -> set[str]:
    """Names a file binds to modules other than ppsplit's (``torch``, ``dist``, ``fx``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("ppsplit")}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith(("ppsplit", "tests")):
            names |= {a.asname or a.name for a in node.names}
    return names


def root_name(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def test_no_private_name_of_one_module_is_used_in_another():
    """``x._name`` where ``_name`` is a private name another ppsplit module defines (not ``self._x`` in its own
    module): a private attribute, function or method used across modules. Tests included."""
    mods = modules()
    tests = modules({"tests": "tests"})
    owners: dict[str, set] = {}
    for mod, path in mods.items():
        for name in defined_private_names(path):
            owners.setdefault(name, set()).add(mod)
    problems = []
    for mod, path in {**mods, **tests}.items():
        mine = defined_private_names(path)
        tree = ast.parse(open(path).read(), path)
        external = external_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in owners and node.attr not in mine \
                    and root_name(node) not in external:
                problems.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} uses {node.attr}, private to "
                                f"{', '.join(sorted(owners[node.attr]))}")
    assert not problems, "\n".join(problems)


def test_the_rules_see_what_they_should():
    """The parsers are not vacuous: they find imports and private names this test knows are there."""
    mods = modules()
    found = {t for t, _, _ in imports(mods["ppsplit.compile.api"], set(mods))}
    assert {"ppsplit.passes.trace", "ppsplit.core.options", "ppsplit.serve.runtime"} <= found
    assert folder("ppsplit.passes.rewrites.gemv") == "ppsplit.passes" and folder("ppsplit.core.plan") == "ppsplit.core"
    assert "_resolve" in defined_private_names(mods["ppsplit.artifact.program"])
    assert len(mods) > 50


def test_loading_and_serving_a_folder_imports_no_transformers_and_no_compile_passes(tmp_path):
    import ppsplit

    out = ppsplit.compile_model("demo", str(tmp_path / "demo-pp2"), pp=2, aux="1,4",
                                cache=ppsplit.CacheConfig(batch_size=1, max_len=16))
    script = textwrap.dedent(f"""
        import sys, torch, ppsplit
        split = ppsplit.load({out!r})
        logits, aux = split(torch.tensor([[5, 6, 7]]), torch.arange(3))
        assert logits.shape == (1, 3, 1024) and aux.shape == (2, 1, 3, 256), (logits.shape, aux.shape)
        split.generate(torch.tensor([[5, 6, 7]]), 4)
        stage = ppsplit.load_stage({out!r}, 1)
        heavy = sorted(m for m in sys.modules if m == "transformers" or m.startswith(("transformers.",
                       "ppsplit.compile")) or m.startswith("ppsplit.passes.") and not m.startswith("{REWRITES}"))
        print("HEAVY", heavy)
        assert not heavy, heavy
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "HEAVY []" in done.stdout


PICKS = {"argmax", "multinomial", "searchsorted", "sample"}  # what choosing a token from logits calls
DECODING = {"ppsplit.serve.sampling", "ppsplit.serve.sampler", "ppsplit.serve.speculative"}
SCORING = {"ppsplit.eagle3.drafter", "ppsplit.eagle3.dflash"}  # draft_agreement, block_agreement: teacher-forced
# first drafts, no loop that decodes


def test_tokens_are_chosen_in_the_engine_only():
    """Decoding has one home: the engine's sampler and draft loop. A second decoding loop (the lockstep ``generate``,
    a speculative loop of its own, a per-command decoder) has to choose tokens, so a call that picks a token from
    logits anywhere else in the package fails this test."""
    found = {}
    for mod, path in modules().items():
        if folder(mod) in ("ppsplit.triton_kernels", "ppsplit.passes"):  # kernels and rewrites: no decoding there
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PICKS:
                found.setdefault(mod, []).append(f"{os.path.relpath(path, ROOT)}:{node.lineno} .{node.func.attr}(")
    assert DECODING <= set(found), sorted(found)  # the rule sees the engine's own picks
    stray = [line for mod, lines in found.items() if mod not in DECODING | SCORING for line in lines]
    assert not stray, "tokens chosen outside the engine:\n" + "\n".join(stray)


def test_a_split_that_cannot_page_is_refused_by_every_decoding_entry():
    """A split without a paged cache runs forward only: the engine, generate and ragged steps refuse it in one line."""
    import torch

    import ppsplit
    from ppsplit.serve.engine import Engine
    from tests.support import tiny_model

    split = ppsplit.split_model(tiny_model("llama", num_layers=2), 2)  # no cache
    ids = torch.tensor([[5, 6, 7]])
    assert split(ids)[0].shape == (1, 3, 128)
    for call in (lambda: split.generate(ids, 2), lambda: Engine(split), lambda: split.step(ids[0], None)):
        with pytest.raises(ppsplit.ConfigError):
            call()
