"""The `hypic` command (also `python -m hypic`).

    hypic up [--model DIR] [--data-dir ./.hypic-data] [--scatter 2] [--port 50051] ...
             [--segcaches K] [--remote-tier | --remote-url mooncake://HOST:PORT]
        start segcache × K (with --remote-tier also a Mooncake Store master, the shared tier
        below every segcache's LMDB), scatter × N, combine, the router and the OpenAI-compatible front
        (http://127.0.0.1:8000/v1, --no-front to skip) on 127.0.0.1, wait until all are
        healthy, print the router address, run until Ctrl-C / SIGTERM, then stop everything.
    hypic generate --address HOST:PORT --segment TEXT [--segment-ids 1,2,3 ...] --query TEXT
        stream one generation to stdout (timings on stderr).
    hypic info --address HOST:PORT [--data-dir ./.hypic-data]
        the router's model (path, limits), the front's address, each segcache's size.
    hypic health HOST:PORT [--service NAME] [--http]
    hypic certs --out DIR
        a throwaway CA and one certificate per role (`hypic up --tls` makes its own).
generate, info and health take --tls-ca/--tls-cert/--tls-key (and --api-key) for a secured mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of token ids: {text!r}") from None


def _ports(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


MESH_FILE = "mesh.json"  # in DATA_DIR/run while `hypic up` runs


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def cmd_up(args: argparse.Namespace) -> int:
    from hypic.launcher import DEFAULT_MODEL

    model = Path(args.model) if args.model else DEFAULT_MODEL
    if not (model / "config.json").exists():
        print(f"hypic up: no model at {model} (config.json missing); pass --model DIR",
              file=sys.stderr)
        return 2
    if args.segcaches < 1 or (args.remote_tier and args.remote_url) or \
            ((args.remote_tier or args.remote_url) and args.no_segcache):
        print("hypic up: --segcaches must be >= 1; --remote-tier (start a master) and "
              "--remote-url (use one) exclude each other and need segcache", file=sys.stderr)
        return 2
    extra: dict[str, list[str]] = {}
    for kind in ("router", "segcache", "scatter", "combine", "front"):
        vals = getattr(args, f"{kind}_arg") or []
        if vals:
            extra[kind] = [a for v in vals for a in v.split()]
        # Metrics on by default: an ephemeral Prometheus port per gRPC service (the front serves
        # /metrics on its own port), unless the caller chose one or --no-metrics.
        if kind != "front" and not args.no_metrics and "--metrics-port" not in extra.get(kind, []):
            extra[kind] = ["--metrics-port", "0"] + extra.get(kind, [])
    try:
        mesh = _mesh(args, model, extra)
    except ValueError as e:  # a malformed --remote-url, a port list of the wrong length
        print(f"hypic up: {e}", file=sys.stderr)
        return 2
    return _run_up(args, mesh)


def _mesh(args: argparse.Namespace, model: Path, extra: dict[str, list[str]]) -> Any:
    from hypic.launcher import Mesh

    return Mesh(model, args.data_dir, args.scatter, n_combine=args.combine, host=args.host,
                router_port=args.port, segcache_port=args.segcache_port,
                n_segcache=args.segcaches, remote_tier=args.remote_tier,
                remote_url=args.remote_url, master_port=args.master_port,
                segcache_ports=_ports(args.segcache_ports) if args.segcache_ports else None,
                scatter_ports=_ports(args.scatter_ports) if args.scatter_ports else None,
                combine_ports=_ports(args.combine_ports) if args.combine_ports else None,
                segcache=not args.no_segcache, seam=args.seam, dtype=args.dtype,
                device=args.device, gpus=args.gpus.split(",") if args.gpus else None,
                threads=args.threads, extra_args=extra, start_timeout_s=args.start_timeout,
                front=not args.no_front, front_port=args.front_port,
                tls=args.tls, env={"HYPIC_ROUTER_API_KEY": args.api_key} if args.api_key else None,
                entry_key_file=args.entry_key_file, on_ready=_print_ready)


def _write_mesh_file(mesh: Any) -> None:
    """DATA_DIR/run/mesh.json: every address, the model and the front, for `hypic info`."""
    tmp = mesh.run_dir / f"{MESH_FILE}.tmp"
    tmp.write_text(json.dumps(mesh.describe(), indent=2))
    os.replace(tmp, mesh.run_dir / MESH_FILE)


def _print_ready(name: str, svc: Any, seconds: float) -> None:
    """`hypic up`'s progress: one line per service as it becomes ready."""
    print(f"  {name:<10} ready at {svc.address} (pid {svc.pid}) after {seconds:.1f} s",
          file=sys.stderr, flush=True)


def _run_up(args: argparse.Namespace, mesh: Any) -> int:
    from hypic.launcher import MeshError
    from hypic.model_card import model_card

    old = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        note = model_card(mesh.model).get("description")
        if note:
            print(f"hypic up: model {mesh.model.name}: {note}", file=sys.stderr, flush=True)
        print(f"hypic up: starting {', '.join(mesh.names)} (logs in {mesh.log_dir})",
              file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            mesh.start()
        except MeshError as e:
            print(f"hypic up: {e}", file=sys.stderr)
            return 1
        metrics = {n: mesh[n].info.get("metrics_port") for n in mesh.services}
        if any(metrics.values()):
            print("hypic up: Prometheus metrics at " + ", ".join(
                f"{n} http://{mesh[n].host}:{p}/metrics" for n, p in metrics.items() if p),
                  file=sys.stderr)
        if "front" in mesh.services:
            print(f"hypic up: OpenAI-compatible API at {mesh.front_url}/v1 "
                  f"(model {mesh.model.name}); metrics at {mesh.front_url}/metrics",
                  file=sys.stderr)
        if mesh.certs is not None:
            print(f"  mutual TLS: --tls-ca {mesh.certs.ca} --tls-cert {mesh.certs.cert('client')} "
                  f"--tls-key {mesh.certs.key('client')}", file=sys.stderr)
        print(f"hypic up: ready in {time.monotonic() - t0:.1f} s; Ctrl-C to stop",
              file=sys.stderr, flush=True)
        _write_mesh_file(mesh)
        if args.json:
            print(json.dumps(mesh.describe()), flush=True)
        else:
            print(mesh.router_address, flush=True)
        restarts: dict[str, list[float]] = {}
        while True:
            time.sleep(0.5)
            for name in mesh.dead():
                code = mesh[name].proc.returncode
                recent = [t for t in restarts.get(name, []) if time.monotonic() - t < 60]
                if args.no_restart or len(recent) >= 5:
                    print(f"hypic up: {name} exited with status {code}; not restarting "
                          f"(log {mesh[name].log_path})", file=sys.stderr, flush=True)
                    mesh[name].proc = None  # report once
                    continue
                print(f"hypic up: {name} exited with status {code}; restarting",
                      file=sys.stderr, flush=True)
                restarts[name] = recent + [time.monotonic()]
                try:
                    mesh.restart(name)
                except MeshError as e:
                    print(f"hypic up: restart of {name} failed: {e}", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, _Stop):
        print("\nhypic up: stopping", file=sys.stderr, flush=True)
    finally:
        mesh.stop()
        (mesh.run_dir / MESH_FILE).unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, old)
    print("hypic up: stopped", file=sys.stderr, flush=True)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import hypic

    segments = args.segments or []
    query: Any = args.query if args.query is not None else args.query_ids
    if query is None:
        print("hypic generate: --query or --query-ids is needed", file=sys.stderr)
        return 2
    try:
        with hypic.Client(args.address, timeout=args.timeout, **_credentials(args)) as client:
            kw = dict(max_tokens=args.max_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed, mode=args.mode,
                      stop_at_eos=args.stop_at_eos)
            if args.json:
                r = client.generate(segments, query, stream=False, **kw)
                print(json.dumps({"request_id": r.request_id, "tokens": r.tokens, "text": r.text,
                                  "timings": asdict(r.timings) if r.timings else None,
                                  "served": asdict(r.served) if r.served else None}))
                return 0
            stream = client.generate(segments, query, stream=True, **kw)
            with stream:
                for tok in stream:
                    sys.stdout.write(tok.text if tok.text or not args.ids else f"[{tok.id}]")
                    sys.stdout.flush()
            print()
            t = stream.timings
            if t is not None:
                print(f"ttft {t.ttft_s * 1e3:.1f} ms, total {t.total_s * 1e3:.1f} ms, "
                      f"{t.segments} segments ({t.hits} cached {dict(t.hits_by_tier)}, "
                      f"{t.misses} built, {t.recomputed} recomputed), {t.served_mode} seam {t.seam}"
                      f"{' shadowed' if t.shadowed else ''}, {t.prompt_tokens} prompt tokens, "
                      f"request {stream.request_id}", file=sys.stderr)
    except hypic.HypicError as e:
        print(f"hypic generate: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    """The router's Info (model path included; `drift`: the shadow monitor's counts and rolling
    figures, docs/drift.md), the front's address when `hypic up` started this router from
    --data-dir, each segcache's size (bytes and budget per tier, bytes and entries per tier per
    entry format) and each worker's entry format (`entry_formats`)."""
    import hypic

    try:
        with hypic.Client(args.address, **_credentials(args)) as client:
            info = asdict(client.info(timeout=args.timeout))
            creds = client.credentials
    except hypic.HypicError as e:
        print(f"hypic info: {e}", file=sys.stderr)
        return 1
    mesh = _local_mesh(Path(args.data_dir), args.address)
    info["front"] = mesh.get("front")
    info["cache"] = {a: _cache_size(a, creds, args.timeout)
                     for a in info["segcache_address"].split(",") if a.strip()}
    info["entry_formats"] = _entry_formats(info, creds, args.timeout)
    print(json.dumps(info, indent=2))
    return 0


def _entry_formats(info: dict[str, Any], creds: Any, timeout: float) -> dict[str, Any]:
    """The storage format of T and S each worker uses (--entry-format): what every scatter builds
    (its Load) and every combine composes (its Info), as each says now ("error: CODE" when one
    does not answer), and `mixed` when they differ (a combine rebuilds entries of another compact
    format itself: slower, never lossier)."""
    import grpc

    from protos.hypic.v1 import combine_pb2 as combine_pb, combine_pb2_grpc as combine_grpc
    from protos.hypic.v1 import scatter_pb2 as scatter_pb, scatter_pb2_grpc as scatter_grpc

    def ask(address: str, call: Any) -> str:
        try:
            with creds.open(address, [], aio=False) as ch:
                return call(ch).entry_format or "fp32"  # a worker from before formats: fp32
        except grpc.RpcError as e:
            return f"error: {e.code().name if hasattr(e, 'code') else e}"
        except ValueError as e:  # an address the channel cannot open (a dns:/// target)
            return f"error: {e}"

    md = creds.metadata()
    out: dict[str, Any] = {
        "scatter": {a: ask(a, lambda ch: scatter_grpc.ScatterStub(ch).Load(
            scatter_pb.LoadRequest(), timeout=timeout, metadata=md)) for a in info["scatter_addresses"]},
        "combine": {a: ask(a, lambda ch: combine_grpc.CombineStub(ch).Info(
            combine_pb.CombineInfoRequest(), timeout=timeout, metadata=md)) for a in info["combine_addresses"]},
    }
    seen = {f for side in ("scatter", "combine") for f in out[side].values() if not f.startswith("error")}
    out["mixed"] = len(seen) > 1
    return out


def _local_mesh(data_dir: Path, router_address: str) -> dict[str, Any]:
    """What `hypic up` wrote to DATA_DIR/run/mesh.json ({} unless that mesh's router is this one)."""
    try:
        mesh = json.loads((data_dir / "run" / MESH_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return mesh if isinstance(mesh, dict) and mesh.get("router") == router_address else {}


def _cache_size(address: str, creds: Any, timeout: float) -> dict[str, Any]:
    """One segcache's entries and bytes / budget per enabled tier ({"error": ...} if it does
    not answer)."""
    import grpc

    from protos.hypic.v1 import segcache_pb2 as segcache_pb, segcache_pb2_grpc as segcache_grpc

    try:
        with creds.open(address, [], aio=False) as ch:
            r = segcache_grpc.SegcacheStub(ch).Stats(segcache_pb.StatsRequest(), timeout=timeout,
                                                     metadata=creds.metadata())
    except grpc.RpcError as e:
        return {"error": e.code().name if hasattr(e, "code") else str(e)}
    except ValueError as e:  # an address the channel cannot open (a dns:/// target)
        return {"error": str(e)}
    tiers = {segcache_pb.Tier.Name(t.tier).removeprefix("TIER_").lower():
             {"bytes": t.bytes, "budget_bytes": t.budget_bytes, "entries": t.entries,
              "formats": {f.format: {"bytes": f.bytes, "entries": f.entries} for f in t.formats}}
             for t in r.tiers if t.enabled}
    return {"entries": r.entries, "tiers": tiers}


def cmd_health(args: argparse.Namespace) -> int:
    from hypic.healthcheck import main as health_main

    tls = [a for name in ("ca", "cert", "key") if getattr(args, f"tls_{name}")
           for a in (f"--tls-{name}", getattr(args, f"tls_{name}"))]
    http = ["--http"] if args.http else []
    return health_main([args.address, "--service", args.service, "--timeout", str(args.timeout),
                        *http, *tls])


def cmd_certs(args: argparse.Namespace) -> int:
    from hypic.certs import ROLES, generate_mesh_certs

    certs = generate_mesh_certs(args.out, args.names.split(",") if args.names else ROLES,
                                extra_hosts=args.extra_host or (), days=args.days)
    print(f"hypic certs: CA {certs.ca}; certificates and keys in {certs.dir}", file=sys.stderr)
    return 0


def _credentials(args: argparse.Namespace) -> dict[str, Any]:
    return {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
            "api_key": args.api_key}


def _add_credential_flags(p: argparse.ArgumentParser, *, api_key: bool = True) -> None:
    """--tls-ca/--tls-cert/--tls-key (and --api-key), defaulting to HYPIC_TLS_* / HYPIC_API_KEY."""
    for name in ("ca", "cert", "key"):
        p.add_argument(f"--tls-{name}", default=os.environ.get(f"HYPIC_TLS_{name.upper()}") or None,
                       help=f"PEM file for TLS to the router [env HYPIC_TLS_{name.upper()}]")
    if api_key:
        p.add_argument("--api-key", default=os.environ.get("HYPIC_API_KEY") or None,
                       help="sent as 'authorization: Bearer KEY' [env HYPIC_API_KEY]")


def _add_up_parser(sub: Any) -> None:
    """`hypic up`: the flags of hypic.launcher.Mesh."""
    up = sub.add_parser("up", help="run the whole mesh locally")
    up.add_argument("--model", default=None, help="checkpoint directory "
                    "(default: the bundled models/hypic-tiny-qwen35)")
    up.add_argument("--data-dir", default=".hypic-data", help="segcache LMDB, logs, port files")
    up.add_argument("--scatter", type=int, default=2, help="scatter workers")
    up.add_argument("--combine", type=int, default=1, help="combine workers")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=50051, help="router port; 0 = ephemeral")
    up.add_argument("--segcache-port", type=int, default=0, help="0 = ephemeral")
    up.add_argument("--scatter-ports", default="", help="comma list, one per worker")
    up.add_argument("--combine-ports", default="", help="comma list, one per worker")
    up.add_argument("--no-segcache", action="store_true", help="run without the cache service")
    up.add_argument("--segcaches", type=int, default=1, metavar="K",
                    help="segcache instances (keys placed by rendezvous hashing over them)")
    up.add_argument("--segcache-ports", default="", help="comma list, one per segcache instance")
    up.add_argument("--remote-tier", action="store_true", help="start a Mooncake Store master "
                    "(mooncake_master from the mooncake wheel) as the shared tier of every segcache")
    up.add_argument("--remote-url", default="", metavar="mooncake://HOST:PORT",
                    help="use this running master as the shared tier (e.g. another box's)")
    up.add_argument("--master-port", type=int, default=0,
                    help="RPC port of the master --remote-tier starts; 0 = a free one")
    up.add_argument("--seam", type=int, default=8)
    up.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    up.add_argument("--device", default="cpu", help="torch device of scatter and combine")
    up.add_argument("--gpus", default="", help="CUDA ids, one per scatter then combine: 0,1,2")
    up.add_argument("--threads", type=int, default=None,
                    help="torch threads per scatter/combine process (default: the cores divided "
                         "among them, at least 1; 0 = torch's default, one per core each)")
    up.add_argument("--front-port", type=int, default=8000,
                    help="port of the OpenAI-compatible HTTP front; 0 = ephemeral")
    up.add_argument("--no-front", action="store_true", help="do not start the HTTP front")
    up.add_argument("--no-metrics", action="store_true",
                    help="no Prometheus ports for the gRPC services (on by default, ephemeral)")
    for kind in ("router", "segcache", "scatter", "combine", "front"):
        up.add_argument(f"--{kind}-arg", action="append", metavar="FLAGS",
                        help=f"extra flags for {kind} (repeatable), e.g. '--log-level debug'")
    up.add_argument("--no-restart", action="store_true", help="do not restart crashed services")
    up.add_argument("--start-timeout", type=float, default=180.0, help="seconds")
    up.add_argument("--json", action="store_true", help="print every address as JSON")
    up.add_argument("--tls", action="store_true", help="mutual TLS everywhere with a throwaway "
                    "CA made in DATA_DIR/tls, the front on HTTPS (the client certificate is printed)")
    up.add_argument("--api-key", default=None,
                    help="the router and the front then require this bearer key")
    up.add_argument("--entry-key-file", default=None,
                    help="the mesh's entry seal key (common/engine/pic/seal.py); default: one made once "
                    "in DATA_DIR/entry.key and shared by every service of the mesh")
    up.set_defaults(func=cmd_up)


def _add_generate_parser(sub: Any) -> None:
    """`hypic generate`: one request's segments, query and sampling."""
    from hypic.client import MODE_NAMES, MODES

    gen = sub.add_parser("generate", help="one generation against a router")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--segment", dest="segments", action="append", metavar="TEXT",
                     help="a text segment (repeatable; order kept)")
    gen.add_argument("--segment-ids", dest="segments", action="append", type=_ids, metavar="IDS",
                     help="a token-id segment: '1,2,3' (repeatable)")
    gen.add_argument("--query", default=None, metavar="TEXT")
    gen.add_argument("--query-ids", type=_ids, default=None, metavar="IDS")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--mode", default="hypic", type=str.lower, choices=sorted(MODES),
                     help=f"one of {', '.join(MODE_NAMES)} (naive: additive's old name)")
    gen.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True,
                     help="stop at the model's EOS token (default; --no-stop-at-eos runs on)")
    gen.add_argument("--timeout", type=float, default=120.0, help="seconds")
    gen.add_argument("--ids", action="store_true", help="print token ids when there is no text")
    gen.add_argument("--json", action="store_true", help="wait and print the result as JSON")
    _add_credential_flags(gen)
    gen.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hypic", description="Hypic: position-independent caching "
                                 "for hybrid-attention LLMs")
    sub = ap.add_subparsers(dest="command", required=True)

    _add_up_parser(sub)
    _add_generate_parser(sub)

    info = sub.add_parser("info", help="the router's model and mesh")
    info.add_argument("--address", default="127.0.0.1:50051")
    info.add_argument("--timeout", type=float, default=10.0)
    info.add_argument("--data-dir", default=".hypic-data",
                      help="hypic up's data directory: the front's address is read from it")
    _add_credential_flags(info)
    info.set_defaults(func=cmd_info)

    health = sub.add_parser("health", help="grpc.health.v1 probe of any service")
    health.add_argument("address")
    health.add_argument("--service", default="")
    health.add_argument("--timeout", type=float, default=2.0)
    health.add_argument("--http", action="store_true",
                        help="an HTTP service (the OpenAI front): GET /health")
    _add_credential_flags(health, api_key=False)
    health.set_defaults(func=cmd_health)

    certs = sub.add_parser("certs", help="a throwaway CA and one certificate per mesh role")
    certs.add_argument("--out", required=True, help="directory for ca.pem, NAME.pem, NAME.key")
    certs.add_argument("--names", default="", help="comma list (default: "
                       "segcache,scatter,combine,router,client)")
    certs.add_argument("--extra-host", action="append", metavar="HOST",
                       help="another host name every certificate is valid for (repeatable)")
    certs.add_argument("--days", type=int, default=30)
    certs.set_defaults(func=cmd_certs)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
