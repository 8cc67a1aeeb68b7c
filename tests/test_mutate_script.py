"""scripts/mutate.py stays usable: every mutant's old snippet is still in its file exactly once
(a refactor that moves code must move the mutant too), and a patch that no longer applies is
reported as ERROR, never as killed or survived."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_mutate():
    spec = importlib.util.spec_from_file_location("hypic_mutate", REPO / "scripts" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hypic_mutate"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_mutant_applies_exactly_once() -> None:
    mutate = load_mutate()
    assert len({m.name for m in mutate.MUTANTS}) == len(mutate.MUTANTS)
    for m in mutate.MUTANTS:
        text = (REPO / m.path).read_text()
        assert text.count(m.old) == 1, (m.name, m.path, text.count(m.old))
        assert m.old != m.new and m.tests
        for t in m.tests:
            if t.startswith("tests/"):
                assert (REPO / t.split("::")[0]).exists(), (m.name, t)


@pytest.mark.processes  # runs scripts/mutate.py on a scratch tree, pytest included
def test_a_patch_that_does_not_apply_is_an_error(tmp_path: Path) -> None:
    mutate = load_mutate()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "c.py").write_text("x = 1\nx = 1\n")
    gone = mutate.Mutant("gone", "a.py", "x = 2", "x = 3", ("tests/none.py",))
    missing = mutate.Mutant("missing", "b.py", "x = 1", "x = 3", ("tests/none.py",))
    twice = mutate.Mutant("twice", "c.py", "x = 1", "x = 3", ("tests/none.py",))
    no_tests = mutate.Mutant("no-tests", "a.py", "x = 1", "x = 3", ("tests/none.py",))  # pytest exit 4
    for m in (gone, missing, twice, no_tests):
        status, _, note = mutate.run_one(m, tmp_path, "python")
        assert status == "ERROR", (m.name, status, note)
    assert (tmp_path / "a.py").read_text() == "x = 1\n"  # untouched
