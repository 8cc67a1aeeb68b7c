import os
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

