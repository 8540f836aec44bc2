"""The package's modules import one another without a cycle (imports inside functions count too): a cycle makes
the import order matter and hides which module owns what."""

import ast
import pathlib

import vllm_mamba2_plugin

PKG = pathlib.Path(vllm_mamba2_plugin.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str) -> set:
    """The package modules ``name`` imports by relative import ("from . import x", "from .x import y")."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                          or (PKG.parent / sub.replace(".", "/")).is_dir() else target)
    return found - {name}


def test_no_import_cycles():
    graph = {_module_name(p): _imports(p, _module_name(p)) for p in PKG.rglob("*.py")}
    # A package's __init__ importing its own submodules is not a cycle with them.
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles
