"""The model-serving resource kind: a reward model (or any scorer) behind an HTTP endpoint.

:class:`EndpointRunner` POSTs one JSON payload per action to ``url`` and returns the JSON
answer; a unit is one concurrent request slot, so the resource's ``max_units`` is the
endpoint's concurrency budget (e.g. the batch a reward-model server accepts at once).

:func:`serve_scorer` starts a real local HTTP endpoint in this process (stdlib
``ThreadingHTTPServer`` on 127.0.0.1, an ephemeral port) around any Python scorer. Tests and
the benchmark use it with a toy reward function; on a cluster the URL points at a vLLM or
other model server instead.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)


class EndpointError(RuntimeError):
    """The endpoint answered with an error status or not at all."""


class EndpointRunner:
    def __init__(self, url: str, timeout_s: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint url must start with http:// or https://, got {url!r}")
        self.url = url
        self.timeout_s = timeout_s

    def run(self, unit: int, payload: Any) -> Any:
        body = json.dumps(payload).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "X-Unit": str(unit)})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as err:
            raise EndpointError(f"{self.url} answered {err.code}: {err.read()[:200]!r}") from err
        except (urllib.error.URLError, TimeoutError) as err:
            raise EndpointError(f"{self.url} unreachable or too slow ({self.timeout_s} s): {err}") from err


class ScorerServer:
    """A running local endpoint; ``url`` to call it, ``close()`` to stop it."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread):
        self._server = server
        self._thread = thread
        host, port = server.server_address[:2]
        self.url = f"http://{host}:{port}/score"
        self.in_flight = 0
        self.peak_in_flight = 0

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_scorer(score: Callable[[Any], Any]) -> ScorerServer:
    """Serve ``score(payload) -> JSON-able`` at ``POST /score`` on 127.0.0.1; a scorer that
    raises gives HTTP 500 with the error text. Records the peak number of requests in flight."""
    lock = threading.Lock()
    holder: dict[str, ScorerServer] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            srv = holder["server"]
            with lock:
                srv.in_flight += 1
                srv.peak_in_flight = max(srv.peak_in_flight, srv.in_flight)
            try:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                try:
                    status, answer = 200, json.dumps(score(payload)).encode()
                except Exception as err:  # noqa: BLE001 - any scorer error goes back to the client as a 500 with the reason
                    status, answer = 500, f"scorer failed: {type(err).__name__}: {err}".encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
            finally:
                with lock:
                    srv.in_flight -= 1

        def log_message(self, fmt, *args):
            log.debug("scorer endpoint: " + fmt, *args)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="scorer-endpoint", daemon=True)
    holder["server"] = ScorerServer(server, thread)
    thread.start()
    return holder["server"]
