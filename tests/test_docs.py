"""The README and docs/ hold together: every relative link and #anchor in README.md and docs/*.md
resolves (GitHub's heading slugs), and every documented `python -m ddp_kit.<module>` answers --help."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cmd

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
ENTRY = re.compile(r"-m (ddp_kit(?:\.[A-Za-z_]\w*)+)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked (links in code are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        out.append("" if fenced else INLINE_CODE.sub("", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (a link's text, no markup), lowercased,
    punctuation other than '-' and '_' dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page has: one per heading outside code blocks, duplicates numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link, also one whose text wraps onto the next line."""
    text = "\n".join(prose_lines(path.read_text()))
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def test_slug_follows_github():
    assert slug("What did the failures cost: `python -m ddp_kit.status`") == "what-did-the-failures-cost-python--m-ddp_kitstatus"
    assert slug("Experiment trackers: TensorBoard, MLflow, W&B, one tracker run") == "experiment-trackers-tensorboard-mlflow-wb-one-tracker-run"
    assert slug("Tiered checkpoints: node memory, a peer node's copy") == "tiered-checkpoints-node-memory-a-peer-nodes-copy"


def test_links_wrapped_and_in_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("See [one\n  two](#x) and `[not](#code)`.\n```\n[nor](#fence)\n```\n")
    assert links(page) == [(1, "#x")]


def test_anchors_number_duplicates_and_skip_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n## Tests\n```bash\n# not a heading\n```\n## Tests\n")
    assert anchors(page) == {"a", "tests", "tests-1"}


def test_every_relative_link_and_anchor_resolves():
    assert (ROOT / "docs").is_dir() and len(PAGES) > 1
    broken = []
    for page in PAGES:
        for no, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not ours to check
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}:{no}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def documented_entry_points() -> list[str]:
    return sorted({m.group(1) for page in PAGES for m in ENTRY.finditer(page.read_text())})


def test_entry_points_are_found():
    found = documented_entry_points()
    assert {"ddp_kit.train", "ddp_kit.status", "ddp_kit.checkpoint"} <= set(found), found


@pytest.mark.integration
@pytest.mark.parametrize("module", [
    m for m in documented_entry_points()])
def test_documented_entry_point_answers_help(module):
    res = run_cmd([sys.executable, "-m", module, "--help"], timeout=60,
                  env={"PAGER": "cat", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))})
    assert res.returncode == 0, f"python -m {module} --help exited {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    assert (res.stdout + res.stderr).strip(), f"python -m {module} --help printed nothing"
