"""The whole tree's imports: no module sits in an import circle, and serving/'s jobs stack in
layers (serving/__init__.py). backend/'s own floors: test_backend_layout.py.

Every import counts, wherever it is written (inside a function, under TYPE_CHECKING): an import
moved into a function to dodge a circle is still a circle a reader has to hold in their head.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["backend", "serving", "client", "kernels/specserve_kernels", "perf", "scripts", "tests"]
# serving's layers, lowest first; a folder may import its own layer and those below it
SERVING_LAYERS = [{"triton", "experiments"}, {"launch"}, {"gateway"}]


def module_files() -> dict[str, Path]:
    """dotted module name -> file, for every module of the project's packages."""
    found = {}
    for package in PACKAGES:
        base = ROOT / package
        prefix = base.name
        for path in base.rglob("*.py"):
            parts = [prefix, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(path: Path, own: str, modules: dict[str, Path]) -> set[str]:
    """The project's modules that `own` (at `path`) imports, anywhere in the file."""
    targets = set()
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != own:
                targets.add(name)
    return targets


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(path, name, modules) for name, path in modules.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_is_in_an_import_circle():
    edges = graph()
    assert len(edges) > 250 and sum(map(len, edges.values())) > 700  # the check reads the real tree
    assert circles(edges) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_serving_folders_import_only_their_layer_and_below():
    layer = {folder: i for i, folders in enumerate(SERVING_LAYERS) for folder in folders}
    on_disk = {p.name for p in (ROOT / "serving").iterdir() if (p / "__init__.py").exists()}
    assert on_disk == set(layer)
    upward = []
    for source, targets in graph().items():
        parts = source.split(".")
        if parts[0] != "serving" or len(parts) < 3:
            continue
        for target in targets:
            target_parts = target.split(".")
            if target_parts[0] == "serving" and len(target_parts) >= 2 and target_parts[1] != parts[1]:
                if layer[target_parts[1]] >= layer[parts[1]]:
                    upward.append((source, target))
    assert upward == []


def test_experiments_and_backend_know_nothing_of_triton_or_the_layers_above():
    edges = graph()
    for source, targets in edges.items():
        if source.startswith(("serving.experiments", "backend", "specserve_kernels")):
            assert not {t for t in targets if t.startswith(("serving.triton", "serving.launch", "serving.gateway"))}, source
        if source.startswith(("backend", "specserve_kernels")):
            assert not {t for t in targets if t.startswith(("serving", "client", "perf", "scripts", "tests"))}, source
    for path in (ROOT / "serving" / "experiments").glob("*.py"):
        text = path.read_text()
        assert "tritonclient" not in text and "triton_python_backend_utils" not in text, path.name


def test_the_kernels_folder_shadows_no_package_named_kernels():
    """transformers 5.25 and later import Hugging Face's `kernels` package; from the repository's
    root (where the launcher, the tests and `python -m` run) that name must still reach it."""
    probe = ("import importlib.util, transformers.modeling_utils, specserve_kernels.gemv as g; "
             "s = importlib.util.find_spec('kernels'); print(s and s.origin); print(g.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    kernels_origin, ours = out.stdout.split("\n")[:2]
    assert kernels_origin == "None" or not kernels_origin.startswith(str(ROOT / "kernels"))
    assert ours == str(ROOT / "kernels" / "specserve_kernels" / "gemv.py")
