"""Our fla call path (kernels.linear_attn.fla_path) through fla's real Triton code on CPU tensors.

Run by tests/kernels/test_fla_interpreter.py with the fla virtualenv's python (`make fla-venv`), under
TRITON_INTERPRET=1, as `python fla_interpreter_child.py SEED`; prints one JSON object: per case
the relative max error of fla's result against our torch chunk path on the same inputs.

Two patches make Triton's interpreter run fla 0.6 (measured; applied here at import time, never
in site-packages):
* fla's autotuned kernels need a driver to benchmark configs ("0 active drivers"): with one
  config the autotuner never benchmarks, so every @triton.autotune keeps its first config only;
* the interpreter hands kernels Python ints as loop variables, and fla calls `i_t.to(tl.int64)`
  on them: every `for X in ...` body first rebinds X as a tensor.
bf16 is not tested here: the interpreter multiplies raw bf16 bit patterns (a known limitation).
"""
from __future__ import annotations

import ast
import json
import os
import sys
import time
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def patch_interpreter() -> None:
    from triton.runtime import autotuner, interpreter

    init = autotuner.Autotuner.__init__

    def first_config_only(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, list(configs)[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config_only

    def visit_For(self, node):
        node = self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                      ctx=ast.Load())
            value = ast.Call(func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(False)],
                             keywords=[])
            node.body.insert(0, ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())], value=value))
        return node

    interpreter.ASTTransformer.visit_For = visit_For


patch_interpreter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.linear_attn import chunk_linear_attn, chunk_with_transition, recurrent_step  # noqa: E402
from kernels.linear_attn.fla_path import (  # noqa: E402
    fla_chunk,
    fla_chunk_with_transition,
    fla_recurrent_step,
)
from kernels.linear_attn.naive import DELTA_FAMILIES  # noqa: E402

# family -> gate kind (as kernels.linear_attn.FAMILY_GATE)
GATES = {"retnet": "head", "mamba2": "token", "gla": "channel", "deltanet": None,
         "gated_deltanet": "token", "kda": "channel"}
# fla 0.6's chunk_delta_rule refuses fp32 inputs (an assert); the fla path never sends it fp32.
SKIP = {("deltanet", torch.float32): "fla 0.6 chunk_delta_rule refuses fp32 (assert in fla)"}
B, T, K, V = 1, 80, 32, 32  # two chunks of 64 (the second partial): boundaries exercised


def make_inputs(family, H, HV, gen):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    if family in DELTA_FAMILIES:  # delta rule as models run it: unit keys
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    kind = GATES[family]
    g = None
    if kind == "head":
        g = F.logsigmoid(rnd(HV) + 3.0)
    elif kind == "token":
        g = F.logsigmoid(rnd(B, T, HV) + 2.0)
    elif kind == "channel":
        g = F.logsigmoid(rnd(B, T, HV, K) + 2.0)
    beta = torch.rand(B, T, HV, generator=gen) if family in DELTA_FAMILIES else None
    S0 = rnd(B, HV, K, V) * 0.1
    return q, k, v, g, beta, S0


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def run_case(family, dtype, H, HV, gen, scale):
    q, k, v, g, beta, S0 = make_inputs(family, H, HV, gen)
    # both paths see the same (dtype-rounded) operands; ours computes in fp32
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if beta is not None:
        beta = beta.to(dtype)
    qf, kf, vf = q.float(), k.float(), v.float()
    bf = None if beta is None else beta.float()
    delta = family in DELTA_FAMILIES
    out = {}
    o, S = fla_chunk(family, q, k, v, g, beta, S0, scale)
    o_ref, S_ref = chunk_linear_attn(qf, kf, vf, g=g, beta=bf, initial_state=S0, scale=scale, delta=delta)
    out["chunk_o"], out["chunk_S"] = rel(o, o_ref), rel(S, S_ref)
    if H == HV:  # the summary and the decode step as models call them (equal heads)
        _, S_t, T_t = fla_chunk_with_transition(family, None, k, v, g, beta, None, scale)
        _, S_tr, T_tr = chunk_with_transition(None, kf, vf, g=g, beta=bf, delta=delta)
        out["summary_S"], out["summary_T"] = rel(S_t, S_tr), rel(T_t, T_tr)
        # T starts at the identity: its absolute error is the error per unit of incoming state
        out["summary_T_abs"] = float((T_t.float() - T_tr).abs().max())
        gs = g if g is None or g.dim() == 1 else g[:, 0]
        b0 = None if beta is None else beta[:, 0]
        S0_before = S0.clone()
        o1, S1 = fla_recurrent_step(family, q[:, 0], k[:, 0], v[:, 0], gs, b0, S0, scale)
        out["step_input_state_changed"] = float((S0 - S0_before).abs().max())  # must stay 0
        o1_ref, S1_ref = recurrent_step(family, qf[:, 0], kf[:, 0], vf[:, 0], gs, None if b0 is None else b0.float(),
                                        S0, scale)
        out["step_o"], out["step_S"] = rel(o1, o1_ref), rel(S1, S1_ref)
    return out


def main(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    results, skipped = {}, {}
    cases = [(f, d, 2, 2) for f in GATES for d in (torch.float32, torch.float16)]
    cases += [(f, torch.float32, 1, 2) for f in ("gated_deltanet", "kda")]  # grouped value heads (GVA)
    for family, dtype, H, HV in cases:
        name = f"{family}/{str(dtype).split('.')[-1]}/H{H}xHV{HV}"
        if (family, dtype) in SKIP:
            skipped[name] = SKIP[(family, dtype)]
            continue
        t0 = time.perf_counter()
        scale = 1.0 if family == "mamba2" else K**-0.5
        results[name] = run_case(family, dtype, H, HV, gen, scale)
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps({"results": results, "skipped": skipped}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
