"""The repository stands alone: no test and no product module reads anything from beside the clone.

Our own machines and CI have a ``shared/`` folder next to the repository (benchmark data, design notes); a newcomer's
clone does not, so a test or module that reads ``../shared`` passes in CI and fails for everyone else. Real text for
tests comes from the ``stdlib`` data source (Python's own documentation prose), generated text from ``builtin``.
Benchmarks may take a ``--data`` path, but their default must work on a fresh clone (they fall back to ``stdlib``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKED = ("template", "neurons", "scripts", "tests")
# "../shared", "shared/data", or a path built as `<something>.parent / "shared"` (also with parents[N])
SIBLING = re.compile(r"\.\./shared|shared/data|parents?(\[\d+\])?\s*/\s*[\"']shared[\"']")


def offenders(root: Path) -> list[str]:
    found = []
    for folder in CHECKED:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".py", ".sh", ".md", ".txt", ".ini", ".toml") or path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                if SIBLING.search(line):
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_test_or_product_module_reads_beside_the_clone():
    assert not offenders(REPO), "\n".join(offenders(REPO))


def test_the_guard_catches_each_spelling(tmp_path):
    spellings = ['DATA = REPO.parent / "shared" / "data" / "x.txt"', "open('../shared/notes.md')",
                 'Path(__file__).parents[2] / "shared"', 'data = "shared/data/tiny.txt"']
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "bad.py").write_text("\n".join(spellings) + "\nfine = 'shared_state'\n")
    assert len(offenders(tmp_path)) == len(spellings)
