"""compose_segment(without_t=True), the fault combine's --fault compose-without-t injects: the seam is
recomputed as planned and only T is left out (and the conv warm-up patch with it, as the ablation
does): every segment moves the answer while the positions (seams included) stay hypic's. With
entries of seam 0 it is the additive ablation itself."""

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic import compose_segment
from tests.support.tiny import PIC_CONFIGS, save_tiny

SEAM = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HybridEngine:
    path = save_tiny("qwen3_5_text", tmp_path_factory.mktemp("m"), seed=21, **PIC_CONFIGS["qwen3_5_text"])
    return HybridEngine.from_pretrained(path)


def query_logits(engine: HybridEngine, state, query: list[int]) -> torch.Tensor:
    _, logits, _ = engine.forward(query, state)
    return logits[-1]


def test_without_t_keeps_the_seams_and_drops_only_t(engine, fresh_seed) -> None:
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, engine.vocab_size, (n,), generator=g).tolist() for n in (64, 64, 64)]
    query = torch.randint(0, engine.vocab_size, (5,), generator=g).tolist()
    entries = [engine.build_entry(s, SEAM) for s in segs]
    hypic = faulty = engine.new_state()
    gaps = []
    for i, e in enumerate(entries):
        hypic = compose_segment(engine, hypic, e)
        faulty = compose_segment(engine, faulty, e, without_t=True)
        assert faulty.seq_len == hypic.seq_len == sum(map(len, segs[: i + 1]))
        gaps.append(float((query_logits(engine, faulty, query) - query_logits(engine, hypic, query)).abs().max()))
    # T acts on the state the seam left, from the first segment on
    assert min(gaps) > 1e-3, gaps
    reference = engine.prefill_segments(segs, query, mode="hypic", seam=SEAM).logits
    assert (query_logits(engine, hypic, query) - reference).abs().max() < 1e-4
    # With no seams it is the ablation: the additive mode's answer.
    state = engine.new_state()
    for s in segs:
        state = compose_segment(engine, state, engine.build_entry(s, 0), without_t=True)
    additive = engine.prefill_segments(segs, query, mode="additive").logits
    assert (query_logits(engine, state, query) - additive).abs().max() < 1e-4
