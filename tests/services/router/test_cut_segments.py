"""The router cuts a segment longer than --cut-tokens into cache pieces (common/engine/cut.py) on a
real mesh: the answer is the engine's on the cut pieces, each piece is its own entry (a second
request hits every piece, and a piece of one document is reused by another request holding the
same document), and keep_whole sends the segments as they came (the engine's answer on them)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import hypic
from common.engine.cut import cut_segments
from common.engine.hybrid_engine import HybridEngine
from hypic.launcher import Mesh
from tests.support.tiny import PIC_CONFIGS, save_tiny
from tests.support.worker_mesh import FP32_ENTRIES_ENV

SEAM = 4
CUT = 16

pytestmark = [pytest.mark.timeout(600), pytest.mark.processes]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=3, **PIC_CONFIGS["qwen3_5_text"])


def test_long_segments_are_cut_into_reused_pieces_unless_kept_whole(model, tmp_path, fresh_seed):
    g = random.Random(fresh_seed)
    long_doc, short_doc = [[g.randrange(1, 500) for _ in range(n)] for n in (50, 12)]
    segs, query = [long_doc, short_doc], [4, 5, 6]
    pieces, origin = cut_segments(segs, CUT)
    assert len(pieces) == 5 and origin == [0, 0, 0, 0, 1]
    engine = HybridEngine.from_pretrained(model)
    cut_ref = engine.prefill_segments(pieces, query, mode="hypic", seam=SEAM)
    whole_ref = engine.prefill_segments(segs, query, mode="hypic", seam=SEAM)
    # The cut changes the answer's logits (else this test could not tell cut from whole).
    assert (cut_ref.logits - whole_ref.logits).abs().max() > 1e-3

    with Mesh(model, tmp_path / "data", n_scatter=2, threads=1, seam=SEAM, env=FP32_ENTRIES_ENV,
              extra_args={"router": ["--cut-tokens", str(CUT)]}) as mesh, \
            hypic.Client(mesh.router_address, timeout=120) as c:
        def ask(segments, **kw):
            return c.generate(segments=segments, query=query, max_tokens=4, stream=False,
                              return_logits=True, **kw)

        first = ask(segs)
        assert first.timings.segments == len(pieces) and first.timings.misses == len(pieces)
        assert (torch.tensor(first.logits) - cut_ref.logits).abs().max() < 1e-4
        assert first.tokens == engine.generate(cut_ref, max_new_tokens=4)
        again = ask(segs)
        assert again.timings.hits == len(pieces) and again.tokens == first.tokens
        # the long document's pieces are entries of their own: another request reuses them
        other = ask([[7, 8, 9, 10, 11], long_doc])
        assert other.timings.segments == 5 and other.timings.hits == 4 and other.timings.misses == 1
        whole = ask(segs, keep_whole=True)
        assert whole.timings.segments == len(segs)
        assert (torch.tensor(whole.logits) - whole_ref.logits).abs().max() < 1e-4
        full = ask(segs, mode="full")   # the baselines see the segments as sent
        assert full.timings.segments == len(segs)
