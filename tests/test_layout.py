"""The library's shape, enforced: the pipeline's packages import only backwards (and a stage's parts, where
listed, too), no import cycles, no module over 600 lines (450 in core/ and hidden/), no hand-built sample
key, no test-only or dead names, each package says what it owns.

A cycle is how a production loader came to import the test tokenizer; a key built by hand is how every
API conversation was dropped from training; a second home of a concern is where records get lost.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "lib" / "eagle3data"
# the pipeline, in order: a package imports the core, the packages before it and itself, never one after it
ORDER = ["core", "trainers", "prompts", "generate", "rebuild", "audit", "hidden", "export", "value"]
ENTRY = {"eagle3data", "eagle3data.__main__", "eagle3data.cli", "eagle3data.headless", "eagle3data.preflight"}  # may import any stage
# the imports against the order, with their reasons
ALLOWED = {("eagle3data.core.params.generate", "eagle3data.prompts.formats"):
           "params validate a dataset's format name against the one registry of formats",
           ("eagle3data.core.params.hidden", "eagle3data.trainers.registry"):
           "params validate a layout name, and its final state, against the one registry of trainers",
           ("eagle3data.core.params.export", "eagle3data.trainers.registry"):
           "params validate a trainer name against the one registry of trainers"}
# inside a stage package, its parts (modules and subpackages) in order: a part imports the parts before it and itself,
# never one after it (the store knows no capture, an engine's capture no verification); every part is listed
PARTS = {"hidden": ["mix", "norms", "store", "estimate", "capture", "engines", "verify", "merge", "extract"]}
MAX_LINES = 600
# packages whose modules stay well under the limit (issue 44: room for new checks where they belong)
TIGHT = {"core": 450, "hidden": 450}
# modules the vLLM server loads in its own venv (engine side), with the reason: they import no eagle3data,
# and nothing in eagle3data imports them (the project's import path never needs vllm)
ENGINE_SIDE = {"eagle3data.hidden.engines.vllm_connector.cpu_hidden_states":
               "the CPU build's hidden-states connector, loaded by `kv_connector_module_path` "
               "(hidden/engines/vllm_capture.py)",
               "eagle3data.generate.backends.vllm_cpu_fixes":
               "the CPU build's fixes at T > 0, a vLLM general plugin copied beside its entry point "
               "(generate/backends/vllm_server.py with_cpu_fixes: 01 and 06 at T > 0)"}
# public names kept for users although nothing in the project calls them, with the reason
PUBLIC_API = {"register_tokenizer": "the tokenizer plug-in hook (EAGLE3DATA_PLUGINS, docs/01)",
              "load_draft_vocab": "reads back the draft_vocab.safetensors 05 writes (docs/05)"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(LIB.rglob("*.py")):
        parts = ("eagle3data",) + p.relative_to(LIB).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(inside_functions: bool = True) -> dict[str, set[str]]:
    """Module -> the eagle3data modules it imports (anywhere in its body, or only at module level)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, p in mods.items():
        pkg = mod.split(".") if p.name == "__init__.py" else mod.split(".")[:-1]
        tree = ast.parse(p.read_text(encoding="utf-8"))
        nodes = ast.walk(tree) if inside_functions else iter(tree.body)
        deps: set[str] = set()
        for n in nodes:
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


def _package(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ORDER) else None


def test_every_module_lives_in_a_stage_package_or_is_an_entry_point():
    loose = [m for m in _modules() if m not in ENTRY and _package(m) not in ORDER]
    assert not loose, f"modules outside the pipeline's packages {ORDER}: {loose}"


def test_each_package_says_what_it_owns_and_may_import():
    for name in ORDER:
        init = LIB / name / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert len(doc) > 120 and "May import" in doc, f"{init}: a paragraph on what it owns and what it may import"
        assert len(ast.parse(init.read_text(encoding="utf-8")).body) == 1, f"{init}: the docstring only (no re-exports)"


def _against_the_order(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        if mod in ENTRY:
            continue
        own = ORDER.index(_package(mod))
        for d in deps:
            if (mod, d) in ALLOWED:
                continue
            if d in ENTRY:
                bad.append(f"{mod} -> {d} (an entry point)")
            elif (dp := _package(d)) is not None and ORDER.index(dp) > own:
                bad.append(f"{mod} -> {d} ({dp} comes after {ORDER[own]})")
    return sorted(bad)


def test_packages_import_only_the_core_and_earlier_stages():
    bad = _against_the_order(_imports())
    assert not bad, "imports against the pipeline's direction: " + "; ".join(bad)


def test_the_direction_check_can_fail():
    assert _against_the_order({"eagle3data.core.reader": {"eagle3data.hidden.mix"}}) == [
        "eagle3data.core.reader -> eagle3data.hidden.mix (hidden comes after core)"]


def _part(mod: str) -> tuple[str, str] | None:
    """(stage package, its part) of a module inside a package listed in PARTS."""
    parts = mod.split(".")
    return (parts[1], parts[2]) if len(parts) > 2 and parts[1] in PARTS else None


def _against_the_parts(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        if (here := _part(mod)) is None:
            continue
        order = PARTS[here[0]]
        if here[1] not in order:
            bad.append(f"{mod} (part {here[1]!r} of {here[0]} is not in its order {order})")
            continue
        for d in deps:
            if (there := _part(d)) is not None and there[0] == here[0] and there[1] in order \
                    and order.index(there[1]) > order.index(here[1]):
                bad.append(f"{mod} -> {d} ({there[1]} comes after {here[1]} in {here[0]})")
    return sorted(bad)


def test_a_stages_parts_import_only_earlier_parts():
    bad = _against_the_parts(_imports())
    assert not bad, "imports against a stage's own order: " + "; ".join(bad)


def test_the_parts_check_can_fail():
    assert _against_the_parts({"eagle3data.hidden.store.reader": {"eagle3data.hidden.verify.run"},
                               "eagle3data.hidden.verify.run": {"eagle3data.hidden.store.reader"},
                               "eagle3data.hidden.newthing": set()}) == [
        "eagle3data.hidden.newthing (part 'newthing' of hidden is not in its order " + str(PARTS["hidden"]) + ")",
        "eagle3data.hidden.store.reader -> eagle3data.hidden.verify.run (verify comes after store in hidden)"]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
    return cycles


def test_no_import_cycles_in_lib():
    cycles = _cycles(_imports())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _limit(path: Path) -> int:
    rel = path.relative_to(LIB).parts if path.is_relative_to(LIB) else ()
    return TIGHT.get(rel[0], MAX_LINES) if len(rel) > 1 else MAX_LINES


def _too_long(paths) -> dict[str, int]:
    return {str(p.relative_to(LIB)) if p.is_relative_to(LIB) else p.name: n for p in paths
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > _limit(p)}


def test_the_cycle_and_size_checks_can_fail(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "ok.py").write_text("x = 1\n" * MAX_LINES)
    assert _too_long(tmp_path.glob("*.py")) == {"big.py": MAX_LINES + 1}
    assert _limit(LIB / "hidden" / "store" / "reader.py") == 450 and _limit(LIB / "core" / "params" / "run.py") == 450
    assert _limit(LIB / "audit" / "checks.py") == MAX_LINES and _limit(LIB / "cli.py") == MAX_LINES


def test_no_module_is_over_its_limit():
    """600 lines, 450 in core/ and hidden/ (TIGHT)."""
    long = _too_long(LIB.rglob("*.py"))
    assert not long, long


def _hand_built_keys(source: str) -> list[int]:
    """Lines that build a sample key by hand: a call of `SampleKey(...)`, or an f-string
    `{...dataset...}/{...sample_id...}` (the key's spelling), outside the key's own home."""
    lines = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute)):
            if (n.func.id if isinstance(n.func, ast.Name) else n.func.attr) == "SampleKey":
                lines.append(n.lineno)
        if isinstance(n, ast.JoinedStr):
            parts = n.values
            for a, sep, b in zip(parts, parts[1:], parts[2:]):
                if (isinstance(a, ast.FormattedValue) and isinstance(b, ast.FormattedValue)
                        and isinstance(sep, ast.Constant) and sep.value == "/"
                        and "dataset" in ast.unparse(a.value) and "sample_id" in ast.unparse(b.value)):
                    lines.append(n.lineno)
    return lines


def test_no_sample_key_is_built_by_hand_in_lib():
    home = LIB / "core" / "reader.py"
    bad = {f"{p.relative_to(LIB)}:{ln}" for p in LIB.rglob("*.py") if p != home
           for ln in _hand_built_keys(p.read_text(encoding="utf-8"))}
    assert not bad, f"sample keys built by hand (use SampleKey.of(row)): {sorted(bad)}"


def test_the_hand_built_key_check_can_fail():
    assert _hand_built_keys("k = SampleKey('d', '1')\n") == [1]
    assert _hand_built_keys("t = f\"{rec['dataset']}/{rec['sample_id']}\"\n") == [1]
    assert _hand_built_keys("k = SampleKey.of(rec)\nt = f'{a}/{b}'\n") == []


def _words(paths) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in paths:
        for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", p.read_text(encoding="utf-8", errors="replace")):
            counts[w] = counts.get(w, 0) + 1
    return counts


def _unused_public_names() -> dict[str, str]:
    """Public top-level names of lib that nothing but tests uses (lib, notebooks, bench, docs' code)."""
    defined: dict[str, list[Path]] = {}
    for p in LIB.rglob("*.py"):
        for n in ast.parse(p.read_text(encoding="utf-8")).body:
            names = ([n.name] if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                     [t.id for t in n.targets if isinstance(t, ast.Name) and t.id.isupper()]
                     if isinstance(n, ast.Assign) else [])
            for name in names:
                if not name.startswith("_"):
                    defined.setdefault(name, []).append(p)
    lib = _words(LIB.rglob("*.py"))
    users = _words([*REPO.glob("notebooks/*.py"), *REPO.glob("bench/*.py")])
    return {name: str(ps[0].relative_to(LIB)) for name, ps in sorted(defined.items())
            if lib.get(name, 0) <= len(ps) and not users.get(name) and name not in PUBLIC_API}


def test_no_lib_name_is_used_only_by_tests():
    unused = _unused_public_names()
    assert not unused, f"names in lib that only tests (or nothing) use: move them to tests/ or delete them: {unused}"


def test_the_library_holds_no_test_only_code():
    for p in LIB.rglob("*.py"):
        text = p.read_text(encoding="utf-8")
        assert "SyntheticTokenizer" not in text and '"synthetic:' not in text, p


def _defined(mod_path: Path) -> set[str]:
    names: set[str] = set()
    for n in ast.parse(mod_path.read_text(encoding="utf-8")).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                names.update(e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name))
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
    return names


def _public_face(mod: str, path: Path) -> tuple[set[str], list[str]]:
    """A package's public face: the names its `__init__` lists in `__all__` and imports from the package's own
    modules (`eagle3data.core.params` names RunParams from `core/params/run.py`), and the imports of such an
    `__init__` that reach outside the package (a face shows its own modules' names, never another package's)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    listed = {e.value for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets) for e in n.value.elts}
    if path.name != "__init__.py" or not listed:
        return set(), []
    own, outside = set(), []
    for n in tree.body:
        if isinstance(n, ast.ImportFrom):
            if (n.module or "").startswith(mod + "."):
                own.update(a.asname or a.name for a in n.names)
            else:
                outside.append(f"{n.module}: {', '.join(a.name for a in n.names)}")
    return own & listed, outside


def test_a_package_face_shows_only_its_own_modules_names():
    """`__all__` in a package's `__init__` may name what the package's own modules define (users import the params
    from `eagle3data.core.params`, as before it was a package); a face never passes on another package's names."""
    bad = {m: out for m, p in _modules().items() if (out := _public_face(m, p)[1])}
    assert not bad, f"package faces importing from outside their package: {bad}"


def test_the_public_face_check_can_fail(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text("from eagle3data.core.params.run import RunParams\nfrom eagle3data.core.reader import SampleKey\n"
                    "__all__ = ['RunParams', 'SampleKey']\n")
    assert _public_face("eagle3data.core.params", init) == ({"RunParams"}, ["eagle3data.core.reader: SampleKey"])
    init.write_text("from eagle3data.core.params.run import RunParams\n")  # no __all__: no face, RunParams not its name
    assert _public_face("eagle3data.core.params", init) == (set(), [])


def test_every_name_is_imported_from_its_real_home():
    """`from eagle3data.X import n` names the module that defines n (or the submodule n), or the package whose public
    face (`__all__` in its `__init__`, from its own modules) names n: no other re-exports."""
    mods = _modules()
    defined = {m: _defined(p) | _public_face(m, p)[0] for m, p in mods.items()}
    files = [*LIB.rglob("*.py"), *REPO.glob("tests/*.py"), *REPO.glob("bench/*.py"), *REPO.glob("notebooks/*.py")]
    bad = []
    for f in files:
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom) and n.module in mods:
                bad += [f"{f.relative_to(REPO)}:{n.lineno}: {a.name} from {n.module}" for a in n.names
                        if a.name not in defined[n.module] and f"{n.module}.{a.name}" not in mods]
    assert not bad, "names imported through a module that does not define them: " + "; ".join(bad)


def test_the_librarys_own_imports_sit_at_the_top_of_each_module():
    """Only the CLI imports a stage inside the command that runs it (`eagle3data status` loads no model stack)."""
    late = []
    for p in LIB.rglob("*.py"):
        if p.name == "cli.py" and p.parent == LIB:
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        top = set(map(id, tree.body))
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and id(n) not in top and (n.level or (n.module or "").startswith("eagle3data")):
                late.append(f"{p.relative_to(LIB)}:{n.lineno}")
    assert not late, f"eagle3data imports inside functions (no cycle needs them): {late}"


def test_engine_side_modules_are_the_servers_alone():
    graph = _imports()
    for mod in ENGINE_SIDE:
        assert mod in graph, f"{mod} is listed in ENGINE_SIDE but does not exist"
        assert not graph[mod], f"{mod} runs in the engine venv: it may import no eagle3data ({graph[mod]})"
        users = sorted(m for m, deps in graph.items() if mod in deps)
        assert not users, f"{mod} is the server's (vllm only there): imported by {users}"
    engine_only = [m for m, p in _modules().items() if m not in ENGINE_SIDE and re.search(
        r"^\s*(from|import) vllm\b", p.read_text(encoding="utf-8"), re.M)]
    assert not engine_only, f"modules importing vllm outside ENGINE_SIDE: {engine_only}"
