import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The repository root, so that tests import our packages and tests.support.* by their full names
# (never tests/ itself: tests/kernels would shadow kernels/).
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One thread: the tiny test models gain nothing from two, and the mesh tests run service
# processes beside this one; oversubscribed cores made torch's parallel regions stall for
# milliseconds each (measured 10-100x slowdowns on a busy 2-core machine).
torch.set_num_threads(1)


@pytest.fixture
def fresh_seed(request) -> int:
    """A seed that differs per test and per run (printed so a failure can be replayed), unless
    HYPIC_TEST_SEED pins it."""
    seed = int(os.environ.get("HYPIC_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    print(f"[seed] {request.node.nodeid}: HYPIC_TEST_SEED={seed}")
    return seed



class ProcessStartedUnmarked(RuntimeError):
    pass


def _refuse_processes(item):
    """Make starting an OS process fail in a test without the `processes` marker (setup, call and
    teardown, so a module fixture that starts a mesh counts too): `make test-fast` selects
    `-m "not processes"` and must start none."""
    if item.get_closest_marker("processes") is not None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    real_init, real_fork = subprocess.Popen.__init__, os.fork

    def refuse(*args, **kwargs):
        raise ProcessStartedUnmarked(f"{item.nodeid} starts an OS process: mark it "
                                     "@pytest.mark.processes (see pyproject's markers)")
    stack.callback(setattr, subprocess.Popen, "__init__", real_init)
    stack.callback(setattr, os, "fork", real_fork)
    subprocess.Popen.__init__ = refuse
    os.fork = refuse
    return stack


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _refuse_processes(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _refuse_processes(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with _refuse_processes(item):
        yield
