"""The repository stands alone: no test and no product module reads anything from beside the clone.

Our own machines and CI have a sibling folder next to the repository (benchmark data, design notes); a newcomer's
clone does not, so a test or module that reads it passes in CI and fails for everyone else. This guard reads nothing
there: it only searches the repository's own files for references to it (the folder's name is assembled below, so
that this file does not match its own patterns). Real text for
tests comes from the ``stdlib`` data source (Python's own documentation prose), generated text from ``builtin``.
Benchmarks may take a ``--data`` path, but their default must work on a fresh clone (they fall back to ``stdlib``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKED = ("template", "neurons", "scripts", "tests")
NAME = "sha" + "red"  # the sibling folder
# "../NAME", "NAME/data", or a path built as `<something>.parent / "NAME"` (also with parents[N])
SIBLING = re.compile(rf"\.\./{NAME}|{NAME}/data|parents?(\[\d+\])?\s*/\s*[\"']{NAME}[\"']")


def offenders(root: Path) -> list[str]:
    found = []
    for folder in CHECKED:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".py", ".sh", ".md", ".txt", ".ini", ".toml"):
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                if SIBLING.search(line):
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_test_or_product_module_reads_beside_the_clone():
    assert not offenders(REPO), "\n".join(offenders(REPO))


def test_the_guard_catches_each_spelling(tmp_path):
    spellings = [f'DATA = REPO.parent / "{NAME}" / "data" / "x.txt"', f"open('../{NAME}/notes.md')",
                 f'Path(__file__).parents[2] / "{NAME}"', f'data = "{NAME}/data/tiny.txt"']
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "bad.py").write_text("\n".join(spellings) + f"\nfine = '{NAME}_state'\n")
    assert len(offenders(tmp_path)) == len(spellings)
