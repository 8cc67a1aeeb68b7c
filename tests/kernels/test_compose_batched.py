"""The run kernel (kernels.compose.triton_run): a run of segments, seam then body summary each,
composed in one launch, against its torch reference and against composing summary by summary,
with dense body transitions and with factored ones (kernels.linear_attn.lowrank) of mixed ranks;
under the Triton interpreter on CPU (a subprocess: TRITON_INTERPRET must be set before triton
is imported), small odd sizes, fresh seeds, relative error."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.compose import compose_batched_torch, compose_run_states, compose_run_states_torch
from kernels.linear_attn.lowrank import LowRankT, stack_transitions

ROOT = Path(__file__).resolve().parents[2]


def _summaries(form, n, G, K, V, g):
    T = lambda: {"scalar": torch.rand((n,) + G, generator=g),  # noqa: E731
                 "vector": torch.rand((n,) + G + (K,), generator=g),
                 "matrix": torch.randn((n,) + G + (K, K), generator=g) / K ** 0.5}[form]
    S = lambda: torch.randn((n,) + G + (K, V), generator=g)  # noqa: E731
    return T(), S(), T(), S()


@pytest.mark.parametrize("form", ["scalar", "vector", "matrix"])
def test_run_reference_equals_summary_by_summary(form, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    n, G, K, V = 4, (3,), 5, 7
    Ta, Sa, Tb, Sb = _summaries(form, n, G, K, V, g)
    S_in = torch.randn(G + (K, V), generator=g)
    entering, out = compose_run_states(Ta, Sa, Tb, Sb, S_in, form=form)
    # interleaved 2n summaries through the one-chain composition, all boundary states kept
    T = torch.stack([Ta, Tb], 1).flatten(0, 1)
    S = torch.stack([Sa, Sb], 1).flatten(0, 1)
    ref_out, states = compose_batched_torch(T, S, S_in, form=form, return_all=True)
    assert torch.allclose(out, ref_out, rtol=1e-6, atol=1e-6)
    assert torch.allclose(entering, states[0:-1:2], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        compose_run_states(Ta, Sa, Tb[:-1], Sb, S_in, form=form)


def _lowrank_bodies(n, G, K, ranks, g):
    """n factored body transitions (each [1, *G, ...], ranks cycling through `ranks`), stacked."""
    Ts = [LowRankT(torch.rand((1,) + G + (K,), generator=g),
                   torch.randn((1,) + G + (ranks[i % len(ranks)], K), generator=g) / K,
                   torch.randn((1,) + G + (ranks[i % len(ranks)], K), generator=g)) for i in range(n)]
    return stack_transitions(Ts)


def test_run_reference_with_factored_bodies_equals_the_formed_ones(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    n, G, K, V = 5, (2, 3), 9, 6
    Ta, Sa, _, Sb = _summaries("matrix", n, G, K, V, g)
    Tb = _lowrank_bodies(n, G, K, (1, 4, 2), g)
    S_in = torch.randn(G + (K, V), generator=g)
    entering, out = compose_run_states(Ta, Sa, Tb, Sb, S_in, form="matrix")
    ref_entering, ref_out = compose_run_states_torch(Ta, Sa, Tb.dense(), Sb, S_in, form="matrix")
    assert rel(out, ref_out) < 1e-5 and rel(entering[1:], ref_entering[1:]) < 1e-5
    lost = compose_run_states(Ta, Sa, torch.zeros_like(Ta), Sb, S_in, form="matrix")[1]
    assert rel(lost, ref_out) > 1e-2  # the factors matter: the comparison above could fail
    with pytest.raises(ValueError):  # factors need the matrix form, and their shapes must fit
        compose_run_states(Ta[..., 0, 0], Sa, Tb, Sb, S_in, form="scalar")
    with pytest.raises(ValueError):
        compose_run_states(Ta, Sa, Tb.map(lambda t: t[:-1]), Sb, S_in, form="matrix")


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


_SCRIPT = textwrap.dedent(
    """
    import os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, {root!r})
    import torch
    from kernels.compose.torch_ref import compose_run_states_torch
    from kernels.compose.triton_run import compose_run_states_triton
    g = torch.Generator().manual_seed({seed})
    worst = 0.0
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    for form in ("scalar", "vector", "matrix"):
        for n, G, K, V, sin, dt in ((3, (2, 3), 5, 7, True, torch.float32), (1, (3,), 17, 9, False, torch.float32),
                                    (5, (1, 2), 16, 33, True, torch.bfloat16)):
            T = lambda: {{"scalar": torch.rand((n,) + G, generator=g),
                         "vector": torch.rand((n,) + G + (K,), generator=g),
                         "matrix": torch.randn((n,) + G + (K, K), generator=g) / K ** 0.5}}[form]
            Ta, Tb = T(), T()
            Sa, Sb = (torch.randn((n,) + G + (K, V), generator=g).to(dt) for _ in range(2))
            S_in = torch.randn(G + (K, V), generator=g) if sin else None
            ea, oa = compose_run_states_triton(Ta, Sa, Tb, Sb, S_in, form=form)
            eb, ob = compose_run_states_torch(Ta, Sa, Tb, Sb, S_in, form=form)
            assert ea.dtype == oa.dtype == torch.float32 and torch.isfinite(ea).all()
            e = max(rel(oa, ob), rel(ea[1:], eb[1:]) if n > 1 else 0.0)
            worst = max(worst, e)
            assert e <= 1e-5, (form, n, G, K, V, e)
            if sin:
                assert torch.equal(ea[0], S_in)
    from kernels.linear_attn.lowrank import LowRankT, stack_transitions
    for n, G, K, V, ranks, sin in ((4, (2, 3), 17, 9, (1, 5, 3), True), (3, (1, 2), 32, 33, (20,), False)):
        Ta = torch.randn((n,) + G + (K, K), generator=g) / K ** 0.5
        Sa, Sb = (torch.randn((n,) + G + (K, V), generator=g) for _ in range(2))
        Tb = stack_transitions([LowRankT(torch.rand((1,) + G + (K,), generator=g),
                                         torch.randn((1,) + G + (ranks[i % len(ranks)], K), generator=g) / K,
                                         torch.randn((1,) + G + (ranks[i % len(ranks)], K), generator=g))
                                for i in range(n)])
        S_in = torch.randn(G + (K, V), generator=g) if sin else None
        ea, oa = compose_run_states_triton(Ta, Sa, Tb, Sb, S_in, form="matrix")
        eb, ob = compose_run_states_torch(Ta, Sa, Tb.dense(), Sb, S_in, form="matrix")
        e = max(rel(oa, ob), rel(ea[1:], eb[1:]))
        worst = max(worst, e)
        assert e <= 1e-5, ("lowrank", n, G, K, V, ranks, e)
    print("run kernel under the interpreter: worst rel err", worst)
    """
)


@pytest.mark.processes  # the interpreter runs in a child process (TRITON_INTERPRET is read at import)
def test_run_kernel_in_interpreter(fresh_seed):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = _SCRIPT.format(root=str(ROOT), seed=fresh_seed % 100000)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout[-2000:], r.stderr[-4000:])
    assert r.returncode == 0, r.stderr[-4000:]
    assert "worst rel err" in r.stdout
