"""The README's fault matrix names the test behind each claim; names drift when tests are renamed
or moved, and a claim whose test is gone is a claim nothing checks."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def fault_matrix_refs(readme: str) -> list[tuple[str, str | None]]:
    """(test file relative to tests/, test function or None) for each reference in the fault
    matrix's last column. `::name` and `dir/...::name` continue the previous file (of that dir)."""
    section = readme.split("### The fault matrix", 1)[1].split("\n#", 1)[0]
    refs: list[tuple[str, str | None]] = []
    last: dict[str, str] = {}                 # the last file named, overall ("") and by directory
    for row in (line for line in section.splitlines() if line.startswith("| ") and "`" in line):
        cell = row.rstrip(" |").rsplit(" | ", 1)[-1]
        for token in re.findall(r"`([^`]+)`", cell):
            path, _, name = token.partition("::")
            if path.endswith("/...") or not path:
                d = path[:-len("/...")]
                if d not in last:
                    raise AssertionError(f"{token!r} continues a file of {d or 'any'} directory, but none was named")
                path = last[d]
            if not path.endswith(".py"):
                continue                      # a command or a config key, not a test
            last[""] = last[path.rpartition("/")[0]] = path
            refs.append((path, re.sub(r"\[.*\]$", "", name) or None))
    return refs


def test_every_test_the_fault_matrix_names_exists():
    refs = fault_matrix_refs((ROOT / "README.md").read_text())
    assert len(refs) >= 30, refs
    missing = []
    for path, name in refs:
        f = TESTS / path
        if not f.is_file():
            missing.append(f"tests/{path}")
        elif name and not re.search(rf"^(async )?def {re.escape(name)}\(", f.read_text(), re.M):
            missing.append(f"tests/{path}::{name}")
    assert not missing, f"the README's fault matrix names tests that do not exist: {missing}"


def test_the_reference_parser_sees_a_renamed_test():
    readme = ("### The fault matrix\n\n| fault | what | test |\n|---|---|---|\n"
              "| a | b | `procs/test_unplanned.py::test_no_such_test`, `::test_worker_killed_mid_step_last_stage` |\n")
    assert fault_matrix_refs(readme) == [("procs/test_unplanned.py", "test_no_such_test"),
                                         ("procs/test_unplanned.py", "test_worker_killed_mid_step_last_stage")]
