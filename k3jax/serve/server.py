"""The HTTP server: the standard library's ``ThreadingHTTPServer`` in front of one engine thread.

Each HTTP request runs on its own thread: it parses the body (``openai_api``), submits to the
engine, and reads the request's event queue, either to the end (one JSON response) or streaming
each delta as a server-sent event (``data: {...}\\n\\n``, ending ``data: [DONE]``). The engine
thread alone touches the device and the cache. A client that goes away mid-stream shows up as a
failed write: the request is cancelled and the engine frees its slot and pages at its next step
while the others keep going. Errors are OpenAI's error object with a 4xx/5xx status.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from k3jax.serve import openai_api
from k3jax.serve.engine import Engine
from k3jax.serve.request import State

MAX_BODY = 64 << 20
log = logging.getLogger("k3jax.serve")


def engine_loop(engine: Engine, stop: threading.Event) -> None:
    """Step the engine while it has work; a failing step fails the requests it held, not the server."""
    while not stop.is_set():
        with engine.wake:
            if not engine.busy:
                engine.wake.wait(0.05)
        if not engine.busy:
            continue
        try:
            engine.step()
        except Exception as err:  # a device error must not leave clients waiting forever
            log.warning(f"engine step failed: {type(err).__name__}: {err}")
            engine.fail_all(f"{type(err).__name__}: {err}")


class Server:
    """A running server: ``Server(engine, tokenizer, model_name, host, port).start()``, ``.url``, ``.stop()``."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 0):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        handler = type("Handler", (_Handler,), {"server_state": self})
        self.http = ThreadingHTTPServer((host, port), handler)
        self.http.daemon_threads = True
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=engine_loop, args=(engine, self._stop), daemon=True, name="engine"),
                         threading.Thread(target=self.http.serve_forever, daemon=True, name="http")]

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "Server":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self.http.shutdown()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self.http.server_close()


class _Handler(BaseHTTPRequestHandler):
    server_state: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # one line per request on the k3jax logger, not raw stderr
        log.debug(fmt % args)

    def do_GET(self):
        s = self.server_state
        if self.path in ("/health", "/v1/health"):
            return self._json(HTTPStatus.OK, {"status": "ok", **s.engine.metrics()})
        if self.path == "/v1/models":
            return self._json(HTTPStatus.OK, {"object": "list", "data": [
                {"id": s.model_name, "object": "model", "created": 0, "owned_by": "k3jax"}]})
        self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found_error")

    def do_POST(self):
        routes = {"/v1/completions": (openai_api.parse_completion, False),
                  "/v1/chat/completions": (openai_api.parse_chat, True)}
        if self.path not in routes:
            return self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found_error")
        parse, chat = routes[self.path]
        s = self.server_state
        try:
            body = self._body()
            prompt, params, stream = parse(body, s.tokenizer)
            req = s.engine.submit(prompt, params)
        except ValueError as err:
            return self._error(HTTPStatus.BAD_REQUEST, str(err))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.id}"
        if stream:
            self._stream(req, rid, chat)
        else:
            self._whole(req, rid, chat)

    def _body(self):
        try:
            size = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ValueError("a Content-Length header is required") from None
        if not 0 <= size <= MAX_BODY:
            raise ValueError(f"the request body must be at most {MAX_BODY} bytes")
        raw = self.rfile.read(size)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"malformed JSON in the request body: {err}") from None

    def _usage(self, req) -> dict:
        return openai_api.usage(len(req.prompt), len(req.generated), req.hit)

    def _whole(self, req, rid: str, chat: bool) -> None:
        s = self.server_state
        while (delta := req.events.get()).finish_reason is None:
            pass
        if req.state is State.DONE and delta.finish_reason.startswith("error"):
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, delta.finish_reason, "server_error")
        self._json(HTTPStatus.OK, openai_api.completion_body(rid, s.model_name, req.text, delta.finish_reason,
                                                             self._usage(req), chat=chat, chunk=False))

    def _stream(self, req, rid: str, chat: bool) -> None:
        s = self.server_state
        try:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            first = True
            while True:
                d = req.events.get()
                if d.text or d.finish_reason or first:
                    usage = self._usage(req) if d.finish_reason else None
                    self._event(openai_api.completion_body(rid, s.model_name, d.text, d.finish_reason, usage,
                                                           chat=chat, chunk=True, first=first))
                    first = False
                if d.finish_reason is not None:
                    break
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            s.engine.cancel(req)  # the client went away: free its slot and pages, keep serving others

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: HTTPStatus, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error") -> None:
        self.close_connection = True  # the body may be unread: do not reuse the connection
        self._json(status, openai_api.error_body(message, kind))
