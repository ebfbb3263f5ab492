"""The coordinator's bearer-token check: a gRPC server interceptor."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import grpc


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse (UNAUTHENTICATED) every call without ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        handler = await continuation(details)
        if hmac.compare_digest(got, self._expected) or handler is None:
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            if handler.request_streaming:  # take the first message: refusing while it is in flight
                try:                       # sometimes reaches the client as INTERNAL instead
                    await asyncio.wait_for(context.read(), 5.0)
                except asyncio.TimeoutError:
                    pass
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        kind = (handler.request_streaming, handler.response_streaming)
        make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}[kind]
        return make(deny, handler.request_deserializer, handler.response_serializer)
