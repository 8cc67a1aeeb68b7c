"""grpc.health.v1 probe of any Hypic service.

    python -m hypic.healthcheck 127.0.0.1:50051 [--service hypic.v1.Router] [--timeout 2]
    python -m hypic.healthcheck 127.0.0.1:8000 --http      # the OpenAI front: GET /health
    python -m hypic.healthcheck 127.0.0.1:8000 --http --https --tls-ca ca.pem   # an HTTPS front

Exit status 0 when the service answers SERVING, 1 otherwise (the docker-compose healthcheck).
`check(address)` is the same probe as a function (the launcher uses it). Against a TLS service pass
--tls-ca (and --tls-cert/--tls-key under mutual TLS), or set HYPIC_TLS_CA / HYPIC_TLS_CERT /
HYPIC_TLS_KEY: the variables the services themselves read, so a container's probe just works.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hypic.client import Credentials


def status(address: str, service: str = "", timeout: float = 2.0,
           credentials: Credentials | None = None) -> str:
    """'SERVING', 'NOT_SERVING', 'SERVICE_UNKNOWN', 'UNKNOWN', or the gRPC error code name."""
    with (credentials or Credentials()).open(address, [], aio=False) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            return code.name if code is not None else "ERROR"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def check(address: str, service: str = "", timeout: float = 2.0,
          credentials: Credentials | None = None) -> bool:
    return status(address, service, timeout, credentials) == "SERVING"


def https_context(credentials: Credentials) -> ssl.SSLContext:
    """An HTTPS client context from SDK credentials: the server verified against tls_ca (system
    roots without one), tls_cert/tls_key presented when the server asks (mutual TLS)."""
    ctx = ssl.create_default_context(cafile=None if credentials.tls_ca is None else str(credentials.tls_ca))
    if credentials.tls_cert is not None:
        ctx.load_cert_chain(str(credentials.tls_cert), None if credentials.tls_key is None
                            else str(credentials.tls_key))
    return ctx


def http_status(address: str, timeout: float = 2.0, credentials: Credentials | None = None) -> str:
    """'SERVING' when GET http://address/health answers 200 (https:// with secure credentials),
    else the status or error."""
    import urllib.error
    import urllib.request

    secure = credentials is not None and credentials.secure
    url = f"{'https' if secure else 'http'}://{address}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout,
                                    context=https_context(credentials) if secure else None) as r:
            return "SERVING" if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return type(e).__name__


def http_check(address: str, timeout: float = 2.0, credentials: Credentials | None = None) -> bool:
    return http_status(address, timeout, credentials) == "SERVING"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hypic.healthcheck", description=__doc__.split("\n")[0])
    ap.add_argument("address", help="host:port of the service")
    ap.add_argument("--service", default="", help="service name; empty = the whole server")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds")
    ap.add_argument("--http", action="store_true", help="an HTTP service: GET /health")
    ap.add_argument("--https", action="store_true", help="with --http: over TLS, verified against "
                    "--tls-ca, presenting --tls-cert/--tls-key when given")
    ap.add_argument("-q", "--quiet", action="store_true")
    for name in ("ca", "cert", "key"):
        ap.add_argument(f"--tls-{name}", default=os.environ.get(f"HYPIC_TLS_{name.upper()}") or None,
                        help=f"PEM file [env HYPIC_TLS_{name.upper()}]")
    args = ap.parse_args(argv)
    creds = Credentials(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
    st = http_status(args.address, args.timeout, creds if args.https else None) if args.http else \
        status(args.address, args.service, args.timeout, creds)
    if not args.quiet:
        print(f"{args.address} {args.service or '(server)'}: {st}")
    return 0 if st == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
