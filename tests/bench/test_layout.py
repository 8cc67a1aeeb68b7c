"""bench/ is laid out as a package with one driver: no import cycle (lazy imports inside functions
count too), the driver imports no benchmark, and bench/README.md documents every runnable module."""
from __future__ import annotations

import re

from tests.test_layering import ROOT, import_cycle, import_graph, python_files

# library modules of bench/ that the benchmarks share (a benchmark is anything else that runs)
SHARED = {"bench/__init__.py", "bench/driver.py", "bench/workloads.py", "bench/trace.py", "bench/quality/__init__.py",
          "bench/quality/tasks.py"}


def bench_graph() -> dict[str, list[str]]:
    return import_graph(python_files("bench"))


def test_bench_has_no_import_cycle() -> None:
    graph = bench_graph()
    assert "bench/driver.py" in graph["bench/serve.py"]  # the walker sees bench's imports
    assert import_cycle(graph) == []


def test_the_driver_imports_no_benchmark() -> None:
    imported = set(bench_graph()["bench/driver.py"])
    assert imported <= SHARED, sorted(imported - SHARED)


def test_the_readme_lists_every_runnable_module() -> None:
    """Every module with a __main__ block appears in bench/README.md by its command."""
    readme = (ROOT / "bench" / "README.md").read_text()
    runnable = [p for p in python_files("bench") if 'if __name__ == "__main__":' in p.read_text()]
    assert len(runnable) >= 15
    missing = []
    for path in runnable:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if not re.search(rf"python -m {re.escape(module)}\b", readme):
            missing.append(module)
    assert missing == []
