"""A round-robin router for the pair part: each conversation's turns alternate between the servers.

What users of several vLLM instances behind a router meet: a conversation's next turn lands on another
instance. Turn ``n`` of a conversation (``(messages + 1) // 2``: a turn adds an answer and a question)
goes to server ``(h + n) % len(servers)``, ``h`` a hash of the conversation's first message, so consecutive turns
always change server and first turns spread evenly. Chat completions stream through unchanged; any
other path (``/version``, ``/v1/models``) goes to the first server. ``GET /router_stats``: requests sent
to each server.

    python -m benchmarks.gpu_e2e.rr_proxy --port 8500 --server http://127.0.0.1:8001 --server http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import hashlib
import json

CHAT = "/v1/chat/completions"


def route(body: dict, servers: int) -> int:
    """The server of one chat request (see the module's docstring)."""
    msgs = body.get("messages") or []
    first = json.dumps(msgs[0].get("content", ""), sort_keys=True) if msgs else ""
    h = int(hashlib.sha256(first.encode()).hexdigest()[:8], 16)
    turn = (len(msgs) + 1) // 2
    return (h + turn) % servers


def make_app(servers: list[str]):
    from aiohttp import ClientSession, ClientTimeout, web

    counts = [0] * len(servers)

    async def session(app):
        app["http"] = ClientSession(timeout=ClientTimeout(total=None, sock_connect=30))
        yield
        await app["http"].close()

    async def forward(request: web.Request, base: str, data: bytes) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with request.app["http"].request(request.method, base + request.path_qs, data=data,
                                               headers=headers) as up:
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def chat(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        i = route(json.loads(data), len(servers))
        counts[i] += 1
        return await forward(request, servers[i], data)

    async def other(request: web.Request) -> web.StreamResponse:
        return await forward(request, servers[0], await request.read())

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response({"servers": servers, "requests": counts})

    app = web.Application(client_max_size=64 << 20)
    app.cleanup_ctx.append(session)
    app.router.add_post(CHAT, chat)
    app.router.add_get("/router_stats", stats)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_e2e.rr_proxy", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--server", action="append", required=True, help="a server's base URL (repeat: two or more)")
    a = ap.parse_args(argv)
    if len(a.server) < 2:
        ap.error(f"--server given {len(a.server)} time(s): the router alternates between two or more servers")
    from aiohttp import web

    web.run_app(make_app([s.rstrip("/") for s in a.server]), host="127.0.0.1", port=a.port, print=None,
                access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
