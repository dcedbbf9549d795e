"""The layers' imports point one way: core <- passes (+ triton_kernels) <- drivers; serving imports neither the
passes nor transformers."""
import ast
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"ppsplit": "ppsplit", "ppsplit.passes": "passes", "ppsplit.triton_kernels": "triton_kernels"}
CORE = {"ppsplit.core.errors", "ppsplit.core.options", "ppsplit.core.plan", "ppsplit.core.tensors", "ppsplit.core.fx_utils"}


def modules() -> dict[str, str]:
    """Every module of the package (installed names) -> its file."""
    found = {}
    for package, folder in FOLDERS.items():
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                found[module] = os.path.join(ROOT, folder, name)
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
    return [(m, n, line) for m, n, line in out if m.split(".")[0] == "ppsplit"]


def layer(module: str) -> int:
    if module in CORE:
        return 0
    if module.startswith(("ppsplit.passes", "ppsplit.triton_kernels")):
        return 1
    return 2


def test_imports_point_down_without_cycles_or_private_names():
    mods = modules()
    known = set(mods)
    graph = {m: set() for m in mods}
    problems = []
    for mod, path in mods.items():
        for target, name, line in imports(path, known):
            where = f"{os.path.relpath(path, ROOT)}:{line}"
            # `import ppsplit.passes.trace` also runs the packages above it; the package facade is lazy (PEP 562).
            resolved = target if target in known else target.rsplit(".", 1)[0]
            if resolved not in known:
                problems.append(f"{where} imports unknown module {target}")
                continue
            if resolved != mod and resolved != "ppsplit":
                graph[mod].add(resolved)
            if name and name.startswith("_") and not name.endswith("__") and resolved != mod:
                problems.append(f"{where} imports the private name {name} from {resolved}")
            if resolved != "ppsplit" and layer(resolved) > layer(mod):
                problems.append(f"{where}: {mod} (layer {layer(mod)}) imports {resolved} (layer {layer(resolved)})")
    assert not problems, "\n".join(problems)

    # Cycles, by depth-first search.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # The facade imports nothing of its own at import time.
    assert not [t for t, _, _ in imports(mods["ppsplit"], known)]


def test_the_parser_finds_the_imports_it_should():
    """The import parser is not vacuous: it finds the imports this test file knows are there."""
    mods = modules()
    found = {t for t, _, _ in imports(mods["ppsplit.compile.api"], set(mods))}
    assert {"ppsplit.passes.trace", "ppsplit.core.options", "ppsplit.serve.runtime"} <= found
    assert layer("ppsplit.passes.fuse") == 1 and layer("ppsplit.core.plan") == 0 and layer("ppsplit.artifact.loader") == 2


def test_loading_a_compiled_folder_imports_neither_transformers_nor_the_passes(tmp_path):
    import ppsplit

    out = ppsplit.compile_model("demo", str(tmp_path / "demo-pp2"), pp=2, aux="1,4",
                                cache=ppsplit.CacheConfig(batch_size=1, max_len=16))
    script = textwrap.dedent(f"""
        import sys, torch, ppsplit
        split = ppsplit.load({out!r})
        logits, aux = split(torch.tensor([[5, 6, 7]]), torch.arange(3))
        assert logits.shape == (1, 3, 1024) and aux.shape == (2, 1, 3, 256), (logits.shape, aux.shape)
        stage = ppsplit.load_stage({out!r}, 1)
        heavy = sorted(m for m in sys.modules if m == "transformers" or m.startswith(("transformers.", "ppsplit.passes")))
        print("HEAVY", heavy)
        assert not heavy, heavy
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "HEAVY []" in done.stdout
