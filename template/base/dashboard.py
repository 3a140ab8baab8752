"""A neuron's read-only live dashboard: ``GET /`` (one page) and ``GET /api/state`` (the same data as JSON).

Why: operators compare miners' scores and watch training in a browser instead of reading events files. What happens:
:func:`start_dashboard` (called by ``start_neuron`` when ``--dashboard.port`` is set) builds a
:class:`~template.base.dashboard_state.DashboardState` and serves it with aiohttp on a thread of its own with its own
event loop, so the neuron's training loop and its hivemind event loop are never blocked by a browser; the neuron's
``emit`` hands every event to :meth:`DashboardServer.record`; :meth:`DashboardServer.close` stops the server when the
neuron closes. The page (``dashboard.html`` beside this module, read once at start) carries its script and style
inline and draws its plots with SVG from ``/api/state``, refreshed every two seconds: it loads nothing else, from the
neuron or from the internet, and its Content-Security-Policy forbids it to (only the page's own script and style, by
hash, and fetches to the neuron itself).

What is served, and nothing else: exactly ``GET /`` and ``GET /api/state``. Other methods on those paths get 405,
every other path 404 (no file is ever read at request time, so no path can reach one), a request body is refused
(413), aiohttp's parser bounds the request line and headers (400/431), and keep-alive connections are closed after
``KEEPALIVE_S``. It binds 127.0.0.1 unless ``--dashboard.ip`` says otherwise.

On failure: a port that cannot be bound raises :class:`DashboardError` at start (the neuron stops with one line and
exit code 2, like any other setup error). Once running, an error in a handler is logged and answered with a plain
``500`` (never a traceback: the loop's debug mode, which would add one to aiohttp's error pages, is kept off), and
nothing a browser sends can reach the neuron. ``close`` gives the server ``CLOSE_TIMEOUT_S`` to stop.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import json
import logging
import re
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

import template
from template.base.config import DashboardConfig
from template.base.dashboard_state import DashboardState

log = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("dashboard.html")
START_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
KEEPALIVE_S = 15.0


class DashboardError(RuntimeError):
    """The dashboard could not start (port taken, address not on this machine, ...)."""


def _inline_hash(page: str, tag: str) -> str:
    """The CSP source (``'sha256-…'``) of the page's one inline ``<tag>`` element."""
    match = re.search(rf"<{tag}>(.*?)</{tag}>", page, re.S)
    if match is None:
        raise ValueError(f"{PAGE} has no inline <{tag}>")
    return "'sha256-" + base64.b64encode(hashlib.sha256(match.group(1).encode()).digest()).decode() + "'"


def security_headers(page: str) -> dict[str, str]:
    """Headers on every answer: the page may run only its own inline script and style and fetch only from here."""
    policy = (f"default-src 'none'; script-src {_inline_hash(page, 'script')}; "
              f"style-src {_inline_hash(page, 'style')}; connect-src 'self'; img-src 'self' data:; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
            "Server": "neuron-dashboard"}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


PATHS = ("/", "/api/state")  # all the dashboard serves


async def _ignore_expect(request: web.Request) -> None:
    """No ``100 Continue`` and no 417: the dashboard never reads a request body, it just answers."""
    return None


class DashboardServer:
    """The HTTP server of one :class:`DashboardState`, on its own thread and event loop."""

    def __init__(self, state: DashboardState, ip: str = "127.0.0.1", port: int = 0) -> None:
        """``port`` 0 takes any free port (tests); see :attr:`url` for the one bound."""
        self.state = state
        self.ip, self.port = ip, port
        self._page = PAGE.read_text()
        self._headers = security_headers(self._page)
        self._loop = asyncio.new_event_loop()
        self._loop.set_debug(False)  # in debug mode aiohttp would put tracebacks into its error pages
        self._thread = threading.Thread(target=self._loop.run_forever, name="dashboard", daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}/"

    def record(self, event: dict[str, Any]) -> None:
        self.state.record(event)

    def start(self) -> DashboardServer:
        self._thread.start()
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(START_TIMEOUT_S)
        except (OSError, TimeoutError, concurrent.futures.TimeoutError) as err:
            self._stop_loop()
            raise DashboardError(f"cannot serve the dashboard on {self.ip}:{self.port}: {err}") from None
        log.info("dashboard at %s", self.url)
        return self

    async def _start(self) -> int:
        app = web.Application(middlewares=[self._guard], client_max_size=1024, handler_args=dict(
            keepalive_timeout=KEEPALIVE_S, max_line_size=4096, max_field_size=4096))
        # Every request is routed to one of ours (the last one refuses), so that aiohttp's own handling of an
        # ``Expect`` header never runs: it answered "Expect: \x80" with a 500 (found by the fuzz test).
        app.router.add_get("/", self._index, allow_head=False, expect_handler=_ignore_expect)
        app.router.add_get("/api/state", self._api_state, allow_head=False, expect_handler=_ignore_expect)
        app.router.add_route("*", "/{anything:.*}", self._refuse, expect_handler=_ignore_expect)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.ip, self.port, backlog=32)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            raise
        return int(self._runner.addresses[0][1])

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Plain answers for every error (the router's 404/405 included), and the security headers on all."""
        try:
            response = await handler(request)
        except web.HTTPException as err:
            response = web.Response(status=err.status, text=f"{err.status} {err.reason}\n")
            if "Allow" in err.headers:
                response.headers["Allow"] = err.headers["Allow"]
        except Exception:  # a bug here must not show a traceback, nor reach the neuron
            log.exception("dashboard: %s %s failed", request.method, request.path)
            response = web.Response(status=500, text="500 Internal Server Error\n")
        response.headers.update(self._headers)
        return response

    async def _refuse(self, request: web.Request) -> web.Response:
        if request.path in PATHS:
            raise web.HTTPMethodNotAllowed(request.method, ["GET"])
        raise web.HTTPNotFound()

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(text=self._page, content_type="text/html", charset="utf-8")

    async def _api_state(self, request: web.Request) -> web.Response:
        body = json.dumps(self.state.snapshot(), allow_nan=False, separators=(",", ":"))
        return web.Response(text=body, content_type="application/json")

    def close(self) -> None:
        """Stop serving (bounded by ``CLOSE_TIMEOUT_S``); idempotent."""
        if self._runner is not None and self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(CLOSE_TIMEOUT_S)
            except (TimeoutError, concurrent.futures.TimeoutError, RuntimeError) as err:
                log.debug("dashboard: closing: %r", err)
        self._runner = None
        self._stop_loop()

    async def _shutdown(self) -> None:
        """Close the listener and every connection, and let their tasks finish before the loop stops."""
        await self._runner.cleanup()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=CLOSE_TIMEOUT_S)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()


def start_dashboard(config: DashboardConfig, role: str) -> DashboardServer | None:
    """The neuron's dashboard when ``--dashboard.port`` is set, serving; None otherwise. Raises DashboardError."""
    if not config.port:
        return None
    return DashboardServer(DashboardState(role, template.__version__), config.ip, config.port).start()
