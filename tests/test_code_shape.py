"""The house stays in small rooms (STYLE points 7 and 15), read from the source with `ast`:

- no module under src/ddp_kit is over 450 lines, and no function over 60 (def line to last line);
- no import circle among the modules of src/ddp_kit: every import statement counts, at module level, under
  `if TYPE_CHECKING:` or inside a function alike (a circle drawn only for the type checker, or only at run
  time, is still one). A registry that names a module by a string (importlib) draws no arrow: it is how
  strategies, services and trackers are plugged in, and the plug-in's own imports point down.

The linter's complexity gate (ruff C901, pyproject.toml) keeps each function's branching in check."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "ddp_kit"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _sources():
    return sorted(p for p in PKG.rglob("*.py") if "egg-info" not in str(p))


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
    path = SRC.joinpath(*module.split("."))
    return (path / "__init__.py").exists() or path.with_suffix(".py").exists()


def _arrows(path: Path) -> set[str]:
    """The modules of this package that `path` imports (a `from pkg import name` names pkg/name.py when it exists)."""
    here = _module_of(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ddp_kit")}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            if not module.startswith("ddp_kit"):
                continue
            subs = {f"{module}.{a.name}" for a in node.names if _exists(f"{module}.{a.name}")}
            out |= subs if len(subs) == len(node.names) else subs | {module}
    return {m for m in out if _exists(m) and m != here}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_is_over_450_lines_and_no_function_over_60():
    long_modules, long_functions = [], []
    for path in _sources():
        text = path.read_text()
        where = path.relative_to(SRC)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{where}:{node.lineno} {node.name}: {n} lines")
    assert not long_modules and not long_functions, (
        f"modules over {MAX_MODULE_LINES} lines: {long_modules}; functions over {MAX_FUNCTION_LINES}: {long_functions} "
        "(split by concern: STYLE point 7)")


def test_no_import_circle_among_the_packages_modules():
    graph = {_module_of(p): _arrows(p) for p in _sources()}
    circles = _circles(graph)
    assert not circles, "import circles (each a set of modules that reach each other):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle():
    """The check above can fail: a hand-made graph with one circle and one tail."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
