"""The documentation stays true: the configuration page matches `Settings` and `serve --help`,
and every relative link of the README and docs/ reaches a file (and heading) of the repository."""

from __future__ import annotations

import re
from argparse import _SubParsersAction
from pathlib import Path
from types import ModuleType

import pytest
from script_loading import load_script

from noisy_temp_server.cli import build_parser
from noisy_temp_server.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
MARKDOWN_FILES = sorted(
    [
        REPO_ROOT / "README.md",
        REPO_ROOT / "CHANGELOG.md",
        REPO_ROOT / "experiments" / "README.md",
        *(REPO_ROOT / "docs").rglob("*.md"),
    ]
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _configuration_doc() -> ModuleType:
    return load_script(REPO_ROOT / "scripts" / "configuration_doc.py", "configuration_doc")


def _serve_help() -> str:
    subcommands = next(a for a in build_parser()._actions if isinstance(a, _SubParsersAction))
    return str(subcommands.choices["serve"].format_help())


def test_the_committed_configuration_page_is_current() -> None:
    committed = (REPO_ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == _configuration_doc().render(), (
        "docs/configuration.md is stale: run `python scripts/configuration_doc.py`"
    )


def test_the_configuration_page_names_every_setting_as_serve_help_does() -> None:
    page = _configuration_doc().render()
    help_text = _serve_help()
    for name in Settings.model_fields:
        flag, variable = "--" + name.replace("_", "-"), f"NTS_{name.upper()}"
        row = next((line for line in page.splitlines() if line.startswith(f"| `{name}` |")), "")
        assert f"`{flag}`" in row, name
        assert f"`{variable}`" in row, name
        assert flag in help_text, name
        assert variable in help_text, name


def test_check_mode_fails_on_a_stale_page_and_passes_on_a_current_one(tmp_path: Path) -> None:
    module = _configuration_doc()
    page = tmp_path / "configuration.md"
    page.write_text(module.render().replace("`NTS_PORT`", "`NTS_OLD_PORT`"), encoding="utf-8")
    assert module.main(["--check", "--out", str(page)]) == 1
    assert module.main(["--out", str(page)]) == 0
    assert module.main(["--check", "--out", str(page)]) == 0


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    text = FENCE.sub("", markdown.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)}


def _relative_links(markdown: Path) -> list[str]:
    text = FENCE.sub("", markdown.read_text(encoding="utf-8"))
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("markdown", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_reaches_a_file_and_heading_in_the_repository(
    markdown: Path,
) -> None:
    for target in _relative_links(markdown):
        path_part, _, anchor = target.partition("#")
        resolved = (markdown.parent / path_part).resolve() if path_part else markdown
        assert resolved.is_relative_to(REPO_ROOT), f"{markdown.name}: {target} leaves the repo"
        assert resolved.exists(), f"{markdown.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{markdown.name}: {target}: no such heading"


def test_the_link_checker_catches_a_broken_link_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n[x](page.md#a-title) [y](missing.md) [z](#nowhere)\n")
    assert _relative_links(page) == ["page.md#a-title", "missing.md", "#nowhere"]
    assert _anchors(page) == {"a-title"}
