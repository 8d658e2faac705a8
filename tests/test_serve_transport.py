"""Serve's gRPC transport in the cluster pdserve starts (serving/ray_compat.py: `direct_stream`,
`SERVE_NODE_ENV`): a message past gRPC's 4 MiB default crosses both hops a token stream takes, a
replica's streamed item to the caller's handle and an HTTP response from the ingress through Serve's
proxy. With gRPC's default limit the second failed as a bare 500 (a non-streaming completion with
logprobs over 4 MiB did)."""

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from serving.ray_compat import direct_stream
from service_util import http

BIG = 5 * 2**20 + 17


@serve.deployment
class Inner:
    async def chunks(self, n: int):
        yield b"x" * n          # one streamed item over 4 MiB
        yield b"y"


@serve.deployment
class Outer:
    def __init__(self, inner):
        self.inner = direct_stream(inner.options(stream=True), BIG + 1024).chunks

    async def __call__(self, request: Request) -> Response:
        parts = [part async for part in self.inner.remote(BIG)]
        by_reference = self.inner.handle_options._by_reference
        return Response(b"".join(parts) + f"|by reference: {by_reference}".encode())


def test_messages_past_grpcs_default_limit_cross_both_hops(ray_serve):
    serve.run(Outer.bind(Inner.bind()), name="transport", route_prefix="/transport")
    try:
        status, body = http(ray_serve, "/transport")
    finally:
        serve.delete("transport")
    assert status == 200, body[:300]
    assert body.endswith("xy|by reference: False") and len(body) == BIG + 1 + len("|by reference: False")
