"""What an installed wheel needs: the launch templates as package data, and one version."""
import fnmatch
import importlib.metadata
from pathlib import Path

import pytest

import ddp_kit
import ddp_kit.launch

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_launch_template_is_package_data():
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["ddp_kit.launch"]
    templates = Path(ddp_kit.launch.__file__).parent / "templates"
    files = sorted(str(p.relative_to(templates)) for p in templates.rglob("*") if p.is_file())
    assert files, templates
    missing = [f for f in files if not any(fnmatch.fnmatch(f"templates/{f}", g) for g in globs)]
    assert not missing, f"not shipped in the wheel: {missing} (add them to [tool.setuptools.package-data])"
    for layout in ddp_kit.launch.LAYOUTS:  # the launcher reads its templates from the package, not a checkout
        assert ddp_kit.launch.template_path(layout).parent == templates


def test_the_checkout_links_point_at_the_packaged_templates():
    for link in [*(ROOT / "slurm").iterdir(), ROOT / "launch" / "torchrun.sh"]:
        assert link.resolve().parent == (ROOT / "src/ddp_kit/launch/templates").resolve(), link


def test_the_version_is_kept_in_one_place():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ddp_kit.version.__version__"}
    assert importlib.metadata.version("ddp_kit") == ddp_kit.__version__
