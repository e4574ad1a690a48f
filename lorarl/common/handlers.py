"""Wrapping gRPC method handlers of any arity, so interceptors can act around every call.

grpc.aio hands interceptors an `RpcMethodHandler` whose behaviour may be a coroutine function,
an async generator function (server streaming), or a plain function (the generated
UNIMPLEMENTED stubs). `wrap_method_handler` returns an equivalent handler whose behaviour runs
inside an async context manager built per call, whatever the handler's shape.

Plain functions are called inline on the event loop, which suits the generated stubs only:
real handlers must be `async def` (or async generators) and await anything slow.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

#: Builds the context manager that runs around one call, given the call's servicer context.
Around = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]

_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}

#: Call types as named by the usual gRPC Prometheus conventions.
RPC_TYPES = {
    "unary_unary": "unary",
    "unary_stream": "server_stream",
    "stream_unary": "client_stream",
    "stream_stream": "bidi_stream",
}


def handler_kind(handler: grpc.RpcMethodHandler) -> str:
    """'unary_unary', 'unary_stream', 'stream_unary' or 'stream_stream'."""
    return _FACTORIES[(bool(handler.request_streaming), bool(handler.response_streaming))][0]


def split_method(method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    service, _, name = method.lstrip("/").rpartition("/")
    return service or "unknown", name or method


def wrap_method_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """The same RPC, with each call's behaviour running inside `around(context)`."""
    kind, factory = _FACTORIES[(bool(handler.request_streaming), bool(handler.response_streaming))]
    behaviour = getattr(handler, kind)
    wrapped = _wrap_streaming(behaviour, around) if handler.response_streaming else _wrap_unary(behaviour, around)
    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def rpc_method_handler(kind: str, behaviour: Callable[..., Any], like: grpc.RpcMethodHandler | None,
                       parse: bool = True) -> Any:
    """A handler of the given kind, with the (de)serializers of `like` when given (``parse=False``: the
    behaviour gets the request bodies as bytes)."""
    factory = dict(_FACTORIES.values())[kind]
    return factory(
        behaviour,
        request_deserializer=like.request_deserializer if like and parse else None,
        response_serializer=like.response_serializer if like else None,
    )


def _wrap_unary(behaviour: Callable[..., Any], around: Around) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with around(context):
            result = behaviour(request, context)
            return await result if inspect.isawaitable(result) else result

    return call


def _wrap_streaming(behaviour: Callable[..., Any], around: Around) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with around(context):
                async for response in behaviour(request, context):
                    yield response

        return stream

    async def write(request: Any, context: grpc.aio.ServicerContext) -> None:
        # Coroutines that call context.write(), and plain functions returning an iterator.
        async with around(context):
            result = behaviour(request, context)
            if inspect.isawaitable(result):
                result = await result
            if result is None:
                return
            if hasattr(result, "__aiter__"):
                async for response in result:
                    await context.write(response)
            else:
                for response in result:
                    await context.write(response)

    return write


def parsing_in_call(handler: grpc.RpcMethodHandler, refuse: Callable[[str, Exception], Exception]
                    ) -> grpc.RpcMethodHandler:
    """The same RPC with its request bodies parsed inside the behaviour instead of by grpc beforehand.

    grpc answers a body its deserializer cannot parse with UNKNOWN, before any interceptor's code runs;
    parsed here, a bad body raises ``refuse(type name, error)`` where the caller's error translation sees
    it (INVALID_ARGUMENT). Interceptors further out receive unparsed bytes, so nothing is parsed before
    they have authenticated the call."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    owner = getattr(parse, "__self__", None)
    type_name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request message")

    def parsed(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # protobuf's DecodeError, or any deserializer's own error
            raise refuse(type_name, exc) from None

    kind, factory = _FACTORIES[(bool(handler.request_streaming), bool(handler.response_streaming))]
    behaviour = getattr(handler, kind)
    if handler.request_streaming:

        async def messages(raw_iterator: AsyncIterator[bytes]) -> AsyncIterator[Any]:
            async for raw in raw_iterator:
                yield parsed(raw)

        def with_parsed(raw_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            return behaviour(messages(raw_iterator), context)
    else:

        def with_parsed(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            return behaviour(parsed(raw), context)

    if inspect.isasyncgenfunction(behaviour):
        inner = with_parsed

        async def with_parsed_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in inner(request, context):
                yield response

        with_parsed = with_parsed_stream  # type: ignore[assignment]
    return factory(with_parsed, request_deserializer=None, response_serializer=handler.response_serializer)
