"""The reference job is a user of the library (STYLE point 11), read from the source with `ast`:

- src/ddp_kit/train/ imports from ddp_kit only package faces (ddp_kit, ddp_kit.env, ddp_kit.data,
  ...), ddp_kit.api and ddp_kit.errors, plus its own modules; where a face declares `__all__`,
  only names in it;
- nothing else under src/ddp_kit imports ddp_kit.train: the library never imports the reference job.
"""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "ddp_kit"
TRAIN = PKG / "train"

# What a user's own script may import from: the package faces, plus the API module and the errors.
FACES = {"ddp_kit", "ddp_kit.env", "ddp_kit.dist", "ddp_kit.data", "ddp_kit.parallel", "ddp_kit.checkpoint",
         "ddp_kit.reliability", "ddp_kit.doctor", "ddp_kit.errors", "ddp_kit.models", "ddp_kit.datasets",
         "ddp_kit.losses", "ddp_kit.api", "ddp_kit.trackers"}
# `python -m ddp_kit` is the reference job's command under a shorter name: a command, not the library.
RUNS_THE_JOB = {PKG / "__main__.py"}


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(line, imported module, names) for every import in the file, relative ones resolved."""
    here = _module_of(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            names = tuple(a.name for a in node.names)
            submodules = [n for n in names if _exists(f"{module}.{n}")]  # `from .. import models`
            for name in submodules:
                yield node.lineno, f"{module}.{name}", ()
            if len(submodules) < len(names):
                yield node.lineno, module, tuple(n for n in names if n not in submodules)


def _exists(module: str) -> bool:
    path = SRC.joinpath(*module.split("."))
    return (path / "__init__.py").exists() or path.with_suffix(".py").exists()


def _public(face: str) -> set[str] | None:
    """The face's `__all__` as its source declares it (a list or tuple of strings, or sorted() of a
    dict literal's keys); None where it declares none."""
    parts = face.split(".")
    path = SRC.joinpath(*parts, "__init__.py")
    path = path if path.exists() else SRC.joinpath(*parts).with_suffix(".py")
    tree = ast.parse(path.read_text())
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    value = assigned.get("__all__")
    if value is None:
        return None
    if isinstance(value, ast.Call) and isinstance(value.args[0], ast.Name):  # sorted(_PUBLIC)
        value = assigned[value.args[0].id]
    if isinstance(value, ast.Dict):
        return {k.value for k in value.keys}
    return {e.value for e in value.elts}


def test_the_reference_job_imports_only_package_faces():
    wrong = []
    for path in sorted(TRAIN.rglob("*.py")):
        for line, module, names in _imports(path):
            if module.split(".")[0] != "ddp_kit" or module == "ddp_kit.train" or module.startswith("ddp_kit.train."):
                continue
            where = f"{path.relative_to(SRC)}:{line}"
            if module not in FACES:
                wrong.append(f"{where}: imports {module}, which is not a package face")
                continue
            public = _public(module)
            if module in ("ddp_kit", "ddp_kit.api"):  # the face of init/Run; __version__ is a dunder
                continue
            hidden = [n for n in names if public is not None and n not in public]
            if hidden:
                wrong.append(f"{where}: imports {', '.join(hidden)} from {module}, not in its __all__")
    assert not wrong, "the reference job reaches past the public API:\n" + "\n".join(wrong)


def test_the_library_never_imports_the_reference_job():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        if TRAIN in path.parents or path in RUNS_THE_JOB:
            continue
        for line, module, _ in _imports(path):
            if module == "ddp_kit.train" or module.startswith("ddp_kit.train."):
                wrong.append(f"{path.relative_to(SRC)}:{line}: imports {module}")
    assert not wrong, "library modules import the reference job:\n" + "\n".join(wrong)


def test_every_face_declares_what_it_exports():
    """A face the reference job imports from says what is public there, so the check above has a list."""
    used = {module for path in TRAIN.rglob("*.py") for _, module, _ in _imports(path)} & FACES
    silent = sorted(m for m in used - {"ddp_kit", "ddp_kit.api", "ddp_kit.errors"} if _public(m) is None)
    assert not silent, f"faces without __all__: {', '.join(silent)}"


def _room(module: str) -> str:
    """The package a module belongs to (ddp_kit.checkpoint for ddp_kit.checkpoint.store), or the module
    itself for one directly under ddp_kit (ddp_kit.hooks)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and (PKG / parts[1]).is_dir() else module


def test_no_two_packages_import_each_other():
    """Imports for the type checker count too: a cycle drawn only under TYPE_CHECKING is still one."""
    arrows: dict[tuple[str, str], str] = {}
    for path in sorted(PKG.rglob("*.py")):
        here = _room(_module_of(path))
        for line, module, _ in _imports(path):
            there = _room(module)
            if module.split(".")[0] == "ddp_kit" and there not in (here, "ddp_kit"):
                arrows.setdefault((here, there), f"{path.relative_to(SRC)}:{line}")
    both = [f"{a} <-> {b} ({arrows[(a, b)]}, {arrows[(b, a)]})" for (a, b) in arrows if (b, a) in arrows and a < b]
    assert not both, "packages that import each other:\n" + "\n".join(both)
