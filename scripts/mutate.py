"""Targeted mutation check: does the suite notice when a property that matters breaks?

    python scripts/mutate.py                 # every mutant (`make mutate`)
    python scripts/mutate.py -k rope -k lpt  # mutants whose name contains one of these
    python scripts/mutate.py --list
    python scripts/mutate.py --baseline      # first check that the selections pass unmutated

Each mutant is one small text patch (file, exact old snippet, new snippet) applied to a scratch
copy of the working tree (tracked and untracked, not ignored, files), then only the tests that
cover it run there. KILLED: the tests failed (what we want); SURVIVED: they passed; ERROR: the
old snippet is not found exactly once (code moved: fix the patch) or the test selection ran no
test. Exit status 0 only when every mutant is killed.

Not part of `make test`: it runs the covering tests once per mutant (minutes). The mutants are
in scripts/mutant_table.py; an issue that adds a property worth protecting adds its mutant there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PER_MUTANT_TIMEOUT_S = 900

# the table lives beside this runner (scripts/ is not a package; loaded by path in the tests too)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_table import MUTANTS, Mutant  # noqa: E402


def scratch_copy(dest: Path) -> None:
    """The working tree as it is (tracked + untracked, not ignored) under dest."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = REPO / os.fsdecode(f)
        if src.is_file() and not src.is_symlink():
            (dest / os.fsdecode(f)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(f))


def run_tests(tests: tuple[str, ...], root: Path, python: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          cwd=root, env=env, capture_output=True, text=True,
                          timeout=PER_MUTANT_TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr


def baseline(chosen: list[Mutant], root: Path, python: str) -> bool:
    """Every test selection passes on the unmutated tree (else a kill would prove nothing)."""
    ok = True
    for tests in dict.fromkeys(m.tests for m in chosen):
        rc, out = run_tests(tests, root, python)
        last = out.strip().splitlines()[-1] if out.strip() else ""
        print(f"{'BASE-OK' if rc == 0 else 'BASE-RED':8s} {' '.join(tests)}  {last}", flush=True)
        if rc != 0:
            print("\n".join(line for line in out.splitlines() if line.startswith(("E ", "FAILED")))[:4000])
        ok = ok and rc == 0
    return ok


def run_one(m: Mutant, root: Path, python: str) -> tuple[str, float, str]:
    """(KILLED | SURVIVED | ERROR, seconds, note)."""
    target = root / m.path
    if not target.exists():
        return "ERROR", 0.0, f"{m.path} does not exist"
    original = target.read_text()
    n = original.count(m.old)
    if n != 1:
        return "ERROR", 0.0, f"old snippet found {n} times in {m.path}"
    target.write_text(original.replace(m.old, m.new))
    t0 = time.monotonic()
    try:
        rc, out = run_tests(m.tests, root, python)
    except subprocess.TimeoutExpired:
        return "KILLED", time.monotonic() - t0, f"timed out after {PER_MUTANT_TIMEOUT_S}s"
    finally:
        target.write_text(original)
    took = time.monotonic() - t0
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if rc == 0:
        return "SURVIVED", took, last
    if rc in (4, 5):  # usage error / no tests collected: the selection is wrong, not the code
        return "ERROR", took, f"pytest exit {rc}: {last}"
    failed = next((line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), last)
    return "KILLED", took, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", action="append", default=[], help="only mutants whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the tests")
    ap.add_argument("--baseline", action="store_true",
                    help="first run every test selection on the unmutated tree (must pass)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m.name:36s} {m.path}  tests: {' '.join(m.tests)}")
        return 0
    t0 = time.monotonic()
    results: dict[str, int] = {"KILLED": 0, "SURVIVED": 0, "ERROR": 0}
    with tempfile.TemporaryDirectory(prefix="hypic-mutate-") as tmp:
        root = Path(tmp)
        scratch_copy(root)
        if args.baseline and not baseline(chosen, root, args.python):
            print("baseline red: fix the tests before judging mutants")
            return 1
        for m in chosen:
            status, took, note = run_one(m, root, args.python)
            results[status] += 1
            print(f"{status:8s} {m.name:36s} {took:6.1f}s  {note}", flush=True)
    judged = results["KILLED"] + results["SURVIVED"]
    score = results["KILLED"] / judged if judged else 0.0
    print(f"\nmutation score {results['KILLED']}/{judged} = {score:.0%}; errors {results['ERROR']}; "
          f"{len(chosen)} mutants in {time.monotonic() - t0:.0f}s")
    return 0 if results["SURVIVED"] == 0 and results["ERROR"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
