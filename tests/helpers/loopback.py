"""A real HTTP server on loopback, for the tests whose stand-ins play a vLLM server's routes."""

from __future__ import annotations

import http.server
import threading


def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> tuple[http.server.ThreadingHTTPServer, str]:
    """``handler`` served on threads of its own at a free port of 127.0.0.1: the server and its URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def stop(httpd: http.server.ThreadingHTTPServer) -> None:
    httpd.shutdown()
    httpd.server_close()
