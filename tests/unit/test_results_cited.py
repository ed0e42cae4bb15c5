"""The committed results and the documentation agree: every file kept under benchmarks/results/
or experiments/results/ is cited by a page of docs/, README.md or experiments/README.md, and
every result path such a page cites exists.

A page cites a file by naming its path from the repository's root (`benchmarks/results/x.md`,
in text or inside a link such as `../benchmarks/results/x.md`) or by a relative link that
resolves to it. Naming a folder cites no file in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULT_DIRS = ("benchmarks/results", "experiments/results")
RESULT_PATH = re.compile(r"(?:benchmarks|experiments)/results/[\w./-]*")
LINK_TARGET = re.compile(r"\]\(([^)\s#]+)")


def citing_pages(root: Path) -> list[Path]:
    """The markdown pages that may cite a result."""
    pages = [root / "README.md", root / "experiments" / "README.md"]
    return [p for p in pages if p.exists()] + sorted((root / "docs").rglob("*.md"))


def kept_results(root: Path) -> set[str]:
    """The files under the result folders, from the root: the tracked ones in a git checkout (a
    benchmark's own output there is ignored until someone commits it), else every file."""
    if (root / ".git").exists():
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--", *RESULT_DIRS],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return {name for name in listed.split("\0") if name}
    return {
        p.relative_to(root).as_posix()
        for folder in RESULT_DIRS
        for p in (root / folder).rglob("*")
        if p.is_file()
    }


def citations(root: Path, pages: list[Path]) -> set[str]:
    """The result paths (from the root) that the pages name or link to."""
    cited: set[str] = set()
    for page in pages:
        text = page.read_text(encoding="utf-8")
        cited.update(m.group(0).rstrip(".,;:") for m in RESULT_PATH.finditer(text))
        for target in LINK_TARGET.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            resolved = (page.parent / target).resolve()
            if resolved.is_relative_to(root.resolve()):
                relative = resolved.relative_to(root.resolve()).as_posix()
                if relative.startswith(tuple(f"{d}/" for d in RESULT_DIRS)):
                    cited.add(relative)
    return cited


def uncited(kept: set[str], cited: set[str]) -> list[str]:
    return sorted(kept - cited)


def missing(root: Path, cited: set[str]) -> list[str]:
    return sorted(c for c in cited if not (root / c).exists())


def test_every_kept_result_is_cited_by_the_docs() -> None:
    cited = citations(REPO_ROOT, citing_pages(REPO_ROOT))
    assert uncited(kept_results(REPO_ROOT), cited) == [], (
        "results no page of docs/, README.md or experiments/README.md cites: cite each one "
        "by its path, or delete it"
    )


def test_every_cited_result_exists() -> None:
    cited = citations(REPO_ROOT, citing_pages(REPO_ROOT))
    assert missing(REPO_ROOT, cited) == [], "result paths the docs cite that do not exist"


def test_the_check_catches_an_uncited_file_and_a_missing_citation(tmp_path: Path) -> None:
    results = tmp_path / "benchmarks" / "results"
    (results / "run").mkdir(parents=True)
    for name in ("cited.md", "linked.json", "run/in_folder.md", "uncited.json"):
        (results / name).write_text("{}")
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "experiments" / "results" / "found.md").write_text("x")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "Measured (`benchmarks/results/cited.md`), raw [json](../benchmarks/results/linked.json);"
        " every run in `benchmarks/results/run/`; lost: benchmarks/results/gone.md.\n"
    )
    (tmp_path / "experiments" / "README.md").write_text("[found](results/found.md)\n")
    cited = citations(tmp_path, citing_pages(tmp_path))
    kept = kept_results(tmp_path)
    assert uncited(kept, cited) == [
        "benchmarks/results/run/in_folder.md",
        "benchmarks/results/uncited.json",
    ]
    assert missing(tmp_path, cited) == ["benchmarks/results/gone.md"]
