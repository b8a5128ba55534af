"""uvicorn on a thread beside the EngineWorker. The worker runs on the thread that calls
`Server.run()` (the main thread of `spd serve`, rank 0's job under --distributed), so the
engine never changes threads; uvicorn serves HTTP from its own thread and event loop."""
from __future__ import annotations

import logging
import socket
import threading

from spd.errors import SPDError
from spd.serve.deps import require_serve_deps

log = logging.getLogger("spd.serve")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: a free port), or SPDError saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SPDError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (pass a free "
                       "--port, or 0 for any)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class Server:
    """The HTTP server and the worker of one backend. `run()` blocks until `stop()`, Ctrl-C, or a
    fatal backend error (then `fatal_error` says what failed)."""

    def __init__(self, backend, *, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 max_queue: int = 16, default_max_tokens: int = 256):
        require_serve_deps()
        import uvicorn

        from spd.serve.app import create_app
        from spd.serve.worker import EngineWorker

        self.model_name = model_name
        self.worker = EngineWorker(backend, max_queue, on_fatal=lambda _msg: self._stop_http())
        self.app = create_app(self.worker, model_name, default_max_tokens)
        self.sock = bind_socket(host, port)
        bound = self.sock.getsockname()
        self.host, self.port = host, bound[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}"
        # our own request log replaces uvicorn's access log; log_config=None: no dictConfig
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self.http = uvicorn.Server(config)
        self._http_thread = threading.Thread(target=self._serve_http, name="spd-http",
                                             daemon=True)

    @property
    def fatal_error(self) -> str | None:
        return self.worker.fatal_error

    def _serve_http(self) -> None:
        try:
            self.http.run(sockets=[self.sock])
        finally:
            self.worker.stop()  # HTTP is gone: nothing more to decode

    def _stop_http(self) -> None:
        self.http.should_exit = True

    def start_http(self, timeout: float = 30.0) -> None:
        """Start serving HTTP (the worker is started by run())."""
        import time
        self._http_thread.start()
        deadline = time.monotonic() + timeout
        while not self.http.started:
            if not self._http_thread.is_alive() or time.monotonic() > deadline:
                raise SPDError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        log.debug("serving on %s (backend: %s)", self.url, self.worker.backend.describe())

    def run(self) -> None:
        """Serve until stopped; the engine runs on this thread."""
        if not self._http_thread.is_alive():
            self.start_http()
        try:
            self.worker.run()
        finally:
            self.stop()

    def fail(self, message: str, wait_s: float = 3.0) -> None:
        """The backend died (called from any thread, e.g. a rank's exit hook): every request
        in flight or waiting gets its 5xx / 503, then HTTP stops (up to wait_s to send them)."""
        self.worker.fail_in_flight(message)
        self._stop_http()
        if self._http_thread.is_alive() and threading.current_thread() is not self._http_thread:
            self._http_thread.join(wait_s)

    def stop(self) -> None:
        self.worker.stop()
        self._stop_http()
        if self._http_thread.is_alive() and threading.current_thread() is not self._http_thread:
            self._http_thread.join(10)
        self.sock.close()


def start_background(backend, **kwargs) -> tuple[Server, threading.Thread]:
    """A server whose worker runs on a new thread (tests, benchmarks): returns it once HTTP
    answers, and the worker thread; `server.stop()` ends both."""
    server = Server(backend, **kwargs)
    server.start_http()
    thread = threading.Thread(target=server.run, name="spd-engine", daemon=True)
    thread.start()
    return server, thread
