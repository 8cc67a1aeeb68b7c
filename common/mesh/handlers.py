"""Rewrapping a grpc RpcMethodHandler: the interceptors (auth, guard, metrics) each replace a
handler's behaviour with a wrapped one and must rebuild it with the factory of its streaming kind."""
from __future__ import annotations

from typing import Callable

import grpc

# (request_streaming, response_streaming) -> the handler factory and the behaviour's attribute
_KINDS = {
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
}


def rewrap_handler(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable], Callable],
                   request_deserializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """The same kind of handler with behaviour wrap(its behaviour), and request_deserializer in
    place of the handler's own when one is given."""
    factory, attr = _KINDS[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return factory(wrap(getattr(handler, attr)),
                   request_deserializer=request_deserializer or handler.request_deserializer,
                   response_serializer=handler.response_serializer)
