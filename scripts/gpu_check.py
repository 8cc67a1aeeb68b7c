"""`make gpu-check`: check and time the GPU path on a machine with NVIDIA GPUs, in one table.

    python scripts/gpu_check.py              install the wheels of .gpu-wheels/ (`make gpu-wheels`,
                                             requirements/gpu-wheels.txt: fla, lmdb, structlog, the
                                             front's fastapi/uvicorn, ...) with --no-index into
                                             .gpu-site/, then re-run with it on the path and this
                                             interpreter's own torch (the machine's CUDA build)
    python scripts/gpu_check.py --no-install run with this interpreter as it is
    python scripts/gpu_check.py --dry-run    no GPU, no install: the table's plumbing, every GPU
                                             row skipped with its reason (what CI tests)

Rows (each skips with a reason when a piece is missing, FAILs on a wrong number or an error):
  engine bf16 CUDA vs fp32 CPU logits, one tiny random checkpoint per linear family;
  fla path vs torch path per kernel family (prefill, summary T, decode step), with times;
  Triton compose vs torch; entry build + reuse prefill on CUDA vs CPU; segcache's device tier, and
  a hit in it read by another process on the same GPU by CUDA IPC, and the combine's whole fetch
  of an entry from a segcache process that way (scripts/gpu_tier.py);
  a NIXL VRAM->VRAM read between two processes (GB/s); the mesh with every service on one GPU
  answering the demo's request; on a mid-size random model of a real shape (scripts/gpu_mid.py):
  TTFT full/prefix/hypic for 8x512 and 32x1024, T build overhead, warm TTFT against its floor.
The whole run keeps within 8 minutes on one H200-class GPU: rows that would start after the
budget is spent are skipped, saying so. --json writes the rows for the docs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

# scripts/ is this file's directory: on sys.path when run as a script
from gpu_mid import mid_rows
from gpu_tier import row_combine_ipc, row_ipc, row_segcache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # also in the NIXL row's spawned server process
BUDGET_S = 8 * 60 - 30  # leave room for the table and the teardown
MiB = 1 << 20
DEV = "cuda"  # every row's device (a developer may point it at "cpu" to walk the rows' code)


@dataclass
class Row:
    check: str
    status: str  # ok | FAIL | skip
    value: str = ""
    detail: str = ""


# -- install -------------------------------------------------------------------------------------
# The GPU machines have no network: what they lack travels as wheels (requirements/gpu-wheels.txt,
# downloaded by `make gpu-wheels`) and is installed beside their own torch, never over it.
WHEELS = ROOT / ".gpu-wheels"
SITE = ROOT / ".gpu-site"
WHEEL_REQS = ROOT / "requirements" / "gpu-wheels.txt"
NIXL_NOT_SHIPPED = (" (nixl's CUDA wheels are not among .gpu-wheels: nixl-cu13 1.5.1 is 56 MiB, nixl-cu12 65.5 MiB, "
                    "beside the others' 10.5 MiB over the 64 MiB that travels)")


def pinned_wheels(reqs: Path = WHEEL_REQS) -> list[str]:
    """The `name==version` lines of the wheel list (every one must be pinned: the download and
    the install both run --no-deps, and a bare machine cannot resolve anything)."""
    out = []
    for line in reqs.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            if "==" not in line:
                raise ValueError(f"{reqs.name}: {line!r} is not pinned")
            out.append(line)
    return out


def install_wheels(wheels: Path = WHEELS, site: Path = SITE, reqs: Path = WHEEL_REQS) -> Path:
    """pip install --no-index --find-links `wheels` --no-deps --target `site` of every pinned wheel;
    where this interpreter has no pip, the wheels are unpacked there (a wheel is a zip of its
    import tree). Returns `site`, to put on sys.path."""
    if not wheels.is_dir() or not any(wheels.glob("*.whl")):
        raise FileNotFoundError(f"no wheels in {wheels}: run `make gpu-wheels` on a machine with network first")
    pins = pinned_wheels(reqs)
    site.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), "--no-deps",
           "--upgrade", "--target", str(site), *pins]
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        subprocess.run(cmd, check=True)
    else:
        unpack_wheels(wheels, site, pins)
    return site


def unpack_wheels(wheels: Path, site: Path, pins: list[str]) -> None:
    """Without pip: unzip the wheel of each pin into `site` (no scripts, no compiled bytecode)."""
    import zipfile

    for pin in pins:
        name, version = pin.split("==")
        stem = name.replace("-", "_").lower() + "-" + version + "-"
        found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem)]
        if not found:
            raise FileNotFoundError(f"no wheel for {pin} in {wheels}")
        with zipfile.ZipFile(found[0]) as z:
            z.extractall(site)


# -- what each row needs --------------------------------------------------------------------------
def probe(dry_run: bool) -> dict[str, str | None]:
    """Each piece -> None when usable, else why not."""
    if dry_run:
        why = "dry run: no GPU used"
        return {k: why for k in ("cuda", "fla", "triton", "nixl", "model")}
    out: dict[str, str | None] = {}
    try:
        import torch

        ok = torch.cuda.is_available()
        out["cuda"] = None if ok else f"no CUDA device (torch {torch.__version__}, cuda {torch.version.cuda})"
    except Exception as e:
        out["cuda"] = f"torch does not import: {e}"
    for name, mod in (("fla", "fla.ops"), ("triton", "triton")):
        try:
            __import__(mod)
            out[name] = None
        except Exception as e:
            out[name] = f"{mod} does not import: {type(e).__name__}: {e}"
    try:
        from common.mesh.nixl_util import load_nixl

        api, err = load_nixl()
        out["nixl"] = None if api is not None else err
    except Exception as e:
        out["nixl"] = f"nixl: {e}"
    if out["nixl"]:  # why it is not among the wheels: measured, it does not fit the 64 MiB
        out["nixl"] += NIXL_NOT_SHIPPED
    bundled = ROOT / "models" / "hypic-tiny-qwen35" / "config.json"
    out["model"] = None if bundled.exists() else f"no bundled model at {bundled.parent}"
    return out


# -- helpers -------------------------------------------------------------------------------------
def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeats=3, warmup=True):
    """(best seconds, last result), CUDA synchronised, after one warm-up call unless told not."""
    import torch

    out = fn() if warmup else None
    cuda = torch.cuda.is_available()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            _sync()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            _sync()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _rms(a, b) -> float:
    """Relative RMS error ||a - b|| / ||b|| (logits: what bf16 rounding moves)."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _bf16_ok(err: float, baseline: float) -> bool:
    """bf16 on CUDA within twice what bf16 on CPU (our torch path) is from fp32, plus 1e-2."""
    return err == err and err <= 2 * baseline + 1e-2


def _tiny(tmp: Path, family: str) -> Path:
    """A tiny random checkpoint of the model that uses `family` (configs as in tests/support/tiny.py)."""
    from tests.support.tiny import save_tiny

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, initializer_range=0.1)
    if family == "gated_deltanet":
        return save_tiny("qwen3_5_text", tmp / family, seed=11, **base, num_key_value_heads=2, head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16)
    if family == "kda":
        return save_tiny("kimi_linear", tmp / family, seed=11, **base, num_key_value_heads=4, kv_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=4,
                         linear_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         layer_types=["linear_attention", "full_attention"] * 2, mlp_layer_types=["dense"] * 4)
    base.pop("num_hidden_layers")
    return save_tiny("nemotron_h", tmp / family, seed=0, **base, num_key_value_heads=2, head_dim=16,
                     mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, chunk_size=64, n_groups=2,
                     layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"])


# -- rows ----------------------------------------------------------------------------------------
def row_engine(tmp: Path, family: str):
    import torch

    from common.engine.hybrid_engine import HybridEngine
    from kernels.linear_attn import kernel_path

    path = _tiny(tmp, family)
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = HybridEngine.from_pretrained(path).prefill(ids, return_all_logits=True).all_logits
    cpu16 = HybridEngine.from_pretrained(path, dtype=torch.bfloat16).prefill(ids, return_all_logits=True).all_logits
    eng = HybridEngine.from_pretrained(path, dtype=torch.bfloat16, device=DEV)
    secs, out = _timed(lambda: eng.prefill(ids, return_all_logits=True))
    got = out.all_logits.float().cpu()
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    err, base = _rms(got, ref), _rms(cpu16, ref)
    ok = _bf16_ok(err, base) and top1 > 0.85
    return ("ok" if ok else "FAIL", f"rms {err:.1e}, top-1 {top1:.0%}",
            f"CPU bf16 rms {base:.1e}; path {kernel_path(DEV, torch.bfloat16)}; 300-token prefill {secs * 1e3:.1f} ms")


def row_fla(family: str):
    import torch
    import torch.nn.functional as F

    from kernels.linear_attn import DELTA_FAMILIES, FAMILY_GATE, linear_attention, prefill_with_summary, recurrent_step

    B, T, H, K, V = 1, 4096, 8, 128, 128
    gen = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(B, T, H, d, device=DEV, generator=gen) for d in (K, K, V))
    if family in DELTA_FAMILIES:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    shape = {"head": (H,), "token": (B, T, H), "channel": (B, T, H, K), None: None}[FAMILY_GATE[family]]
    g = None if shape is None else F.logsigmoid(torch.randn(*shape, device=DEV, generator=gen) + 4.0)
    beta = torch.rand(B, T, H, device=DEV, generator=gen) if family in DELTA_FAMILIES else None
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    # the reference: our torch path in fp32 on the same bf16-rounded operands
    t_torch, (o_ref, S_ref) = _timed(lambda: linear_attention(family, qb.float(), kb.float(), vb.float(), g=g,
                                                               beta=beta, backend="torch"), repeats=1)
    t_fla, (o, S) = _timed(lambda: linear_attention(family, qb, kb, vb, g=g, beta=beta, backend="fla"))
    _, _, summ = prefill_with_summary(family, qb, kb, vb, g=g, beta=beta)
    _, _, summ_ref = prefill_with_summary(family, qb.float(), kb.float(), vb.float(), g=g, beta=beta)
    gs = g if g is None or g.dim() == 1 else g[:, 0]
    bs = None if beta is None else beta[:, 0]
    o1, S1 = recurrent_step(family, qb[:, 0], kb[:, 0], vb[:, 0], gs, bs, S_ref)
    o1r, S1r = recurrent_step(family, qb[:, 0].float(), kb[:, 0].float(), vb[:, 0].float(), gs, bs, S_ref)
    errs = dict(o=_rel(o, o_ref), S=_rel(S, S_ref), T=float((summ.T - summ_ref.T).abs().max()),
                step=_rel(o1, o1r))
    ok = max(errs.values()) < 3e-2
    return ("ok" if ok else "FAIL", " ".join(f"{k} {v:.1e}" for k, v in errs.items()),
            f"T={T} H={H} K=V={K}: fla {t_fla * 1e3:.2f} ms, torch fp32 {t_torch * 1e3:.1f} ms")


def row_compose(n: int = 16, G: tuple = (8, 8), K: int = 128, V: int = 128):
    """Triton vs torch composition on DEV: batched, a run of seams and bodies, a run of factored
    bodies (n a multiple of 4); a test walks it on CPU under the Triton interpreter at a tiny size."""
    import torch

    from kernels.compose import compose_batched, compose_run_states
    from kernels.linear_attn.lowrank import LowRankT, stack_transitions

    out, worst = [], 0.0
    for form, tshape in (("scalar", ()), ("vector", (K,)), ("matrix", (K, K))):
        T = torch.rand(n, *G, *tshape, device=DEV)
        if form == "matrix":
            T = T / K
        S = torch.randn(n, *G, K, V, device=DEV)
        t_tri, a = _timed(lambda: compose_batched(T, S, form=form, backend="triton"))
        t_ref, b = _timed(lambda: compose_batched(T, S, form=form, backend="torch"))
        # the run kernel (one launch per layer for a run of seams and bodies) vs its reference
        t_run, (e1, o1) = _timed(lambda: compose_run_states(T, S, T, S, S[0], form=form, backend="triton"))
        t_run_ref, (e2, o2) = _timed(lambda: compose_run_states(T, S, T, S, S[0], form=form, backend="torch"))
        worst = max(worst, _rel(a, b), _rel(o1, o2), _rel(e1, e2))
        out.append(f"{form} {t_tri * 1e3:.2f}/{t_ref * 1e3:.2f} ms, run {t_run * 1e3:.2f}/{t_run_ref * 1e3:.2f} ms")
    # a run whose bodies hold T as factors of ranks 8..63 (short segments: rank < K / 2), one launch
    gen = torch.Generator(device=DEV).manual_seed(5)
    Tl = stack_transitions([LowRankT(torch.rand(1, *G, K, device=DEV, generator=gen),
                                     torch.randn(1, *G, L, K, device=DEV, generator=gen) / K,
                                     torch.randn(1, *G, L, K, device=DEV, generator=gen))
                            for L in (8, 63, 31, 16) * (n // 4)])
    Ta = torch.rand(n, *G, K, K, device=DEV) / K
    t_low, (e1, o1) = _timed(lambda: compose_run_states(Ta, S, Tl, S, S[0], form="matrix", backend="triton"))
    t_low_ref, (e2, o2) = _timed(lambda: compose_run_states(Ta, S, Tl, S, S[0], form="matrix", backend="torch"))
    worst = max(worst, _rel(o1, o2), _rel(e1, e2))
    out.append(f"factored run {t_low * 1e3:.2f}/{t_low_ref * 1e3:.2f} ms")
    return ("ok" if worst < 1e-4 else "FAIL", f"rel {worst:.1e}",
            f"n={n}, {math.prod(G)} slices, K={K} V={V}, triton/torch (batched; run of n seams + n bodies): " + ", ".join(out))


def row_reuse(tmp: Path):
    import torch

    from common.engine.hybrid_engine import HybridEngine

    path = _tiny(tmp, "gated_deltanet") if not (tmp / "gated_deltanet").exists() else tmp / "gated_deltanet"
    gen = torch.Generator().manual_seed(2)
    segs = [torch.randint(3, 512, (120,), generator=gen).tolist() for _ in range(4)]
    query = torch.randint(3, 512, (12,), generator=gen).tolist()
    cpu = HybridEngine.from_pretrained(path)
    cpu16 = HybridEngine.from_pretrained(path, dtype=torch.bfloat16)
    gpu = HybridEngine.from_pretrained(path, dtype=torch.bfloat16, device=DEV)
    ref = cpu.prefill_segments(segs, query, mode="hypic")
    base = _rms(cpu16.prefill_segments(segs, query, mode="hypic").logits, ref.logits)
    entries = gpu.prefill_segments(segs, query, mode="hypic").extra["entries"]  # built on the GPU
    secs, got = _timed(lambda: gpu.prefill_segments(segs, query, entries=entries, mode="hypic"))
    full = gpu.prefill_segments(segs, query, mode="full")
    err, err_full = _rms(got.logits, ref.logits), _rms(got.logits, full.logits)
    return ("ok" if _bf16_ok(err, base) else "FAIL", f"rms vs CPU fp32 {err:.1e}",
            f"CPU bf16 rms {base:.1e}; vs full on the GPU {err_full:.1e}; warm reuse {secs * 1e3:.1f} ms")


def _nixl_server(conn, nbytes, dev):  # runs in its own process (spawned: DEV is its default there)
    import torch

    from common.mesh.nixl_util import NixlAgent

    agent = NixlAgent("gpu-check-server")
    buf = torch.arange(nbytes, dtype=torch.int64, device=dev).remainder_(251).to(torch.uint8)
    agent.register(buf)
    conn.send((agent.metadata(), agent.descriptors(buf)))
    conn.recv()  # the reader is done


def row_nixl(nbytes: int = 256 * MiB):
    """A NIXL READ of `nbytes` on DEV from a spawned process's buffer on DEV: ok when both ends
    are VRAM and the bytes read equal the bytes written (GB/s)."""
    import multiprocessing as mp

    import torch

    from common.mesh.nixl_util import NixlAgent

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_server, args=(child, nbytes, DEV), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            return "FAIL", "", "server process sent nothing in 120 s"
        meta, (mem, descs) = parent.recv()
        agent = NixlAgent("gpu-check-reader")
        peer = agent.add_remote(meta)
        local = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
        agent.read_into(local, descs, peer, mem_type=mem)  # warm-up (registration, connection)
        local.zero_()
        _sync()
        t0 = time.perf_counter()
        agent.read_into(local, descs, peer, mem_type=mem)
        secs = time.perf_counter() - t0
        want = torch.arange(nbytes, dtype=torch.int64, device=DEV).remainder_(251).to(torch.uint8)
        equal = torch.equal(local, want)
        return ("ok" if mem == "VRAM" and equal else "FAIL", f"{nbytes / secs / 1e9:.1f} GB/s",
                f"{nbytes / MiB:g} MiB READ, remote mem {mem}, {'bytes equal' if equal else 'BYTES DIFFER'}")
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def row_mesh(tmp: Path):
    """The demo's session (bench/demo.py: 8 documents, ~4.2k tokens) through a mesh with every
    service on DEV: the first question cold, the second warm; ok when both answers are the
    expected ones (the demo's world: every answer's top-1/top-2 logit margin >= 4, far past what
    bf16 moves)."""
    import hypic
    from bench.demo import MESH_ARGS, session
    from hypic.launcher import DEFAULT_MODEL, Mesh

    docs, questions = session(2)
    extra = dict(MESH_ARGS, segcache=["--device-bytes", str(512 * MiB)])
    with Mesh(DEFAULT_MODEL, tmp / "mesh", n_scatter=1, dtype="bfloat16", device=DEV, gpus=["0"],
              extra_args=extra) as mesh:
        with hypic.Client(mesh.router_address, timeout=300) as client:
            ttft, answers = [], []
            for question, _expected in questions:
                r = client.generate(segments=docs, query=question, max_tokens=1, stream=False)
                ttft.append(r.timings.ttft_s * 1e3)
                answers.append(r.text.strip())
            full = client.generate(segments=docs, query=questions[-1][0], max_tokens=1, stream=False, mode="full")
    expected = [e for _, e in questions]
    return ("ok" if answers == expected else "FAIL", f"TTFT cold {ttft[0]:.0f} ms, warm {ttft[-1]:.0f} ms",
            f"answers {answers}, expected {expected}; full recompute {full.text.strip()!r}")


FAMILIES = ("retnet", "mamba2", "gla", "deltanet", "gated_deltanet", "kda")


def plan(tmp: Path):
    """(check name, pieces it needs, function) in run order."""
    rows = [(f"engine bf16 CUDA vs fp32 CPU: {f}", ("cuda",), lambda f=f: row_engine(tmp, f))
            for f in ("gated_deltanet", "kda", "mamba2")]
    rows += [
        ("entry build + reuse prefill: CUDA vs CPU", ("cuda",), lambda: row_reuse(tmp)),
        ("segcache device tier", ("cuda",), lambda: row_segcache(tmp)),
        ("device tier -> reader by CUDA IPC, two processes", ("cuda",), lambda: row_ipc(tmp, DEV)),
        ("combine fetch over CUDA IPC from a segcache process", ("cuda",), lambda: row_combine_ipc(tmp, DEV)),
        ("NIXL VRAM->VRAM, two processes", ("cuda", "nixl"), row_nixl),
        ("Triton compose (batched, run) vs torch", ("cuda", "triton"), row_compose),
        ("mesh on one GPU: demo request", ("cuda", "model"), lambda: row_mesh(tmp)),
    ]
    rows += mid_rows(tmp, DEV)  # the mid-size random model (scripts/gpu_mid.py)
    # last: every family JIT-compiles fla's kernels at these shapes (the budget may end here)
    rows += [(f"fla path vs torch path: {f}", ("cuda", "fla"), lambda f=f: row_fla(f)) for f in FAMILIES]
    return rows


def run_rows(dry_run: bool, budget_s: float = BUDGET_S) -> list[Row]:
    pieces = probe(dry_run)
    start = time.monotonic()
    out = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as d:
        for name, needs, fn in plan(Path(d)):
            missing = [f"{p}: {pieces[p]}" for p in needs if pieces.get(p)]
            if missing:
                out.append(Row(name, "skip", detail="; ".join(dict.fromkeys(missing))))
                continue
            if time.monotonic() - start > budget_s:
                out.append(Row(name, "skip", detail=f"time budget ({budget_s:.0f} s) spent"))
                continue
            t0 = time.monotonic()
            try:
                status, value, detail = fn()
            except Exception as e:
                status, value, detail = "FAIL", "", f"{type(e).__name__}: {e} | {traceback.format_exc(limit=-2)!r}"
            out.append(Row(name, status, value, f"{detail} [{time.monotonic() - t0:.1f} s]"))
            print(f"  {status:<4} {name}: {value}", flush=True)
    return out


def table(rows: list[Row]) -> str:
    w = max(len(r.check) for r in rows)
    v = max([len(r.value) for r in rows] + [5])
    lines = [f"{'check':<{w}}  {'status':<6}  {'value':<{v}}  detail", "-" * (w + v + 26)]
    lines += [f"{r.check:<{w}}  {r.status:<6}  {r.value:<{v}}  {r.detail}" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU, no install: every GPU row skipped")
    ap.add_argument("--no-install", action="store_true", help="use this interpreter as it is")
    ap.add_argument("--wheels", default=str(WHEELS), help="folder of the wheels to install (make gpu-wheels)")
    ap.add_argument("--site", default=str(SITE), help="where they are installed (--target)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if not (args.dry_run or args.no_install):
        try:
            site = install_wheels(Path(args.wheels), Path(args.site))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
            rest = ["--no-install"] + (["--json", args.json] if args.json else [])
            return subprocess.run([sys.executable, __file__, *rest], cwd=ROOT, env=env).returncode
        except Exception as e:  # no wheels here, a wheel missing: check what is here, rows say what is not
            print(f"install of {args.wheels} into {args.site} failed ({e}); checking with {sys.executable} as it is",
                  flush=True)
    t0 = time.monotonic()
    rows = run_rows(args.dry_run)
    gpu = ""
    if not args.dry_run:
        try:
            import torch

            gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        except Exception:
            gpu = "no torch"
    print(f"\ngpu-check on {gpu or 'dry run'} ({time.strftime('%Y-%m-%d')}), {time.monotonic() - t0:.0f} s\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, date=time.strftime("%Y-%m-%d"),
                                                   rows=[asdict(r) for r in rows]), indent=1))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
