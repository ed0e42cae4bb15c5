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


ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
PACKAGE = REPO_ROOT / "noisy_temp_server"
MAX_ARCHITECTURE_LINES = 300
"""architecture.md is a map a newcomer reads in a minute; detail goes to the page it belongs to."""
_NAMED_MODULES = re.compile(r"^([\w/]+\.py(?:, [\w/]+\.py)*)(?:\s|$)")
_MODULE_PATH = re.compile(r"(?<![\w./-])((?:[a-z_]+/)+[a-z_0-9]+\.py)\b")


def _module_tree(markdown: str) -> str:
    """The fenced block of the section "## The module tree"."""
    section = markdown.split("\n## The module tree\n", 1)[1].split("\n## ", 1)[0]
    fenced = re.search(r"^```\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert fenced is not None, "the module tree is not a fenced block"
    return fenced.group(1)


def _tree_modules(tree: str) -> list[str]:
    """The modules a tree line names at its start, as paths under noisy_temp_server/:
    ``step/capture.py`` or ``server/models.py, status.py`` (the later names in the first's
    folder); continuation lines (indented) name none."""
    modules = []
    for line in tree.splitlines():
        named = _NAMED_MODULES.match(line.removeprefix("noisy_temp_server/"))
        if named is None:
            continue
        first, *rest = named.group(1).split(", ")
        folder = first.rpartition("/")[0]
        modules += [first, *(f"{folder}/{name}" if folder else name for name in rest)]
    return modules


def _missing_modules(markdown: str) -> list[str]:
    """What the page names that is not a file: its module tree's modules (under
    noisy_temp_server/), and every ``folder/module.py`` path in its text (under
    noisy_temp_server/, else from the repository root, e.g. tests/unit/...)."""
    missing = [m for m in _tree_modules(_module_tree(markdown)) if not (PACKAGE / m).is_file()]
    for path in dict.fromkeys(_MODULE_PATH.findall(FENCE.sub("", markdown))):
        relative = path.removeprefix("noisy_temp_server/")
        if not (PACKAGE / relative).is_file() and not (REPO_ROOT / path).is_file():
            missing.append(path)
    return missing


def test_the_architecture_page_is_a_map_of_at_most_300_lines() -> None:
    lines = ARCHITECTURE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_ARCHITECTURE_LINES, (
        f"docs/architecture.md has {len(lines)} lines: move detail to the page it belongs to"
    )


def test_every_module_the_architecture_page_names_exists() -> None:
    markdown = ARCHITECTURE.read_text(encoding="utf-8")
    assert len(_tree_modules(_module_tree(markdown))) >= 100
    assert _missing_modules(markdown) == []


def test_the_module_check_catches_a_missing_module() -> None:
    page = (
        "# A map\n\nSee `server/launch.py` and `server/gone.py`.\n\n## The module tree\n\n```\n"
        "cli.py             the command\n"
        "step/capture.py    rows\n"
        "server/models.py, status.py, nowhere.py  routes\n"
        "                   a continuation naming server/also_gone.py\n"
        "noisy_temp_server/online/shadow.py  the shadow scorer\n"
        "vllm_plugin/ghost.py  not a module\n```\n\n## Next\n"
    )
    assert _tree_modules(_module_tree(page)) == [
        "cli.py", "step/capture.py", "server/models.py", "server/status.py",
        "server/nowhere.py", "online/shadow.py", "vllm_plugin/ghost.py",
    ]  # fmt: skip
    assert _missing_modules(page) == ["server/nowhere.py", "vllm_plugin/ghost.py", "server/gone.py"]
