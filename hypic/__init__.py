"""Hypic client SDK and command line.

    import hypic
    client = hypic.Client("127.0.0.1:50051")
    result = client.generate(segments=["doc ..."], query="question?", max_tokens=16, stream=False)

hypic.Client / hypic.AsyncClient (hypic.client), typed errors (hypic.errors), the local mesh
launcher (hypic.launcher.Mesh; `hypic up`) and a grpc.health.v1 probe (hypic.healthcheck).
TLS and API keys: hypic.Credentials / Client(..., tls_ca=, tls_cert=, tls_key=, api_key=).
"""

from hypic import errors
from hypic.client import (AsyncClient, AsyncTokenStream, Client, Credentials, GenerateResult, Info,
                          Served, Timings, Token, TokenStream)
from hypic.errors import HypicError

__all__ = ["AsyncClient", "AsyncTokenStream", "Client", "Credentials", "GenerateResult", "HypicError", "Info",
           "Served", "Timings", "Token", "TokenStream", "errors"]
