"""docs/architecture.md's package map names every module of the package, and nothing that
is not there: the map is how a newcomer finds the code, so it must stay true."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hicache_l3"
SOURCES = (".py", ".c", ".h")


def mapped_paths(text: str) -> set[str]:
    """Paths (relative to ``hicache_l3/``) the package map names: the first code block
    after "## Package map", one entry per name in a line's first column (names separated
    by single spaces, the description after two or more), each under the directory of the
    nearest less indented ``name/`` line above it."""
    block = text.split("## Package map", 1)[1].split("```", 2)[1]
    dirs: list[tuple[int, str]] = []  # (indent, path) of the open directories
    found: set[str] = set()
    for line in block.splitlines()[1:]:
        if not line.strip() or line.strip() == "hicache_l3/":
            continue
        indent = len(line) - len(line.lstrip())
        column = re.split(r"\s{2,}", line.strip())[0]
        names = [n for n in column.split(" ") if n.endswith(("/", *SOURCES))]
        if not names or indent < 2 or indent > 12:
            continue  # a description's continuation line
        while dirs and dirs[-1][0] >= indent:
            dirs.pop()
        parent = dirs[-1][1] if dirs else ""
        for name in names:
            path = parent + name
            if name.endswith("/"):
                if len(names) == 1:
                    dirs.append((indent, path))
            else:
                found.add(path)
    return found


def package_sources() -> set[str]:
    """Every source file of the package (relative to ``hicache_l3/``) but the packages'
    ``__init__.py`` (a package's line on the map stands for it)."""
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*")
            if p.suffix in SOURCES and "__pycache__" not in p.parts and p.name != "__init__.py"}


def test_every_module_is_on_the_map() -> None:
    mapped = mapped_paths((REPO / "docs" / "architecture.md").read_text())
    missing = sorted(package_sources() - mapped)
    assert not missing, f"modules missing from docs/architecture.md's package map: {missing}"


def test_the_map_names_no_module_that_is_gone() -> None:
    mapped = mapped_paths((REPO / "docs" / "architecture.md").read_text())
    gone = sorted(mapped - package_sources() - {p for p in mapped if p.endswith("__init__.py")})
    assert not gone, f"docs/architecture.md's package map names modules that do not exist: {gone}"


def test_the_map_parser_sees_nesting() -> None:
    text = "## Package map\n\n```\nhicache_l3/\n  a.py  one\n  sub/  a dir\n    b.py c.py  two\n" \
           "                 more words\n  d/e.c  three\n```\n"
    assert mapped_paths(text) == {"a.py", "sub/b.py", "sub/c.py", "d/e.c"}
