"""The library's shape: no import cycles (module-level or inside functions), no test-only code, no module
far over 600 lines. A cycle is how a production loader came to import the test tokenizer."""

from __future__ import annotations

import ast
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "lib" / "eagle3data"
MAX_LINES = 700  # "no module much over 600 lines"


def _imports() -> dict[str, set[str]]:
    """Module -> the eagle3data modules it imports anywhere in its body (relative or absolute)."""
    graph: dict[str, set[str]] = {}
    for p in LIB.rglob("*.py"):
        parts = ("eagle3data",) + p.relative_to(LIB).with_suffix("").parts
        mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        pkg = list(parts[:-1])
        deps: set[str] = set()
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = pkg[: len(pkg) - (n.level - 1)]
                    target = ".".join(base + ([n.module] if n.module else []))
                else:
                    target = n.module or ""
                if target.startswith("eagle3data"):
                    deps.add(target)
                    deps.update(f"{target}.{a.name}" for a in n.names)  # `from . import x` names a module
            elif isinstance(n, ast.Import):
                deps.update(a.name for a in n.names if a.name.startswith("eagle3data"))
        graph[mod] = deps
    return {m: {d for d in ds if d in graph and d != m} for m, ds in graph.items()}


def test_no_import_cycles_in_lib():
    graph = _imports()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_library_holds_no_test_only_code():
    for p in LIB.rglob("*.py"):
        text = p.read_text(encoding="utf-8")
        assert "SyntheticTokenizer" not in text and '"synthetic:' not in text, p


def test_no_module_is_far_over_600_lines():
    long = {p.name: n for p in LIB.rglob("*.py") if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long
