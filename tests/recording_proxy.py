"""A recording HTTP proxy for the real-client tests (not a test module):
every request a client sends goes on to the server unchanged, its answer
back to the client as it arrives (streams chunk by chunk), and both are
written as one JSON line to the log: method, path, request headers and body,
status and the whole answer.

    python tests/recording_proxy.py --target http://127.0.0.1:8080 --port 8081 --log calls.jsonl
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade",
               "proxy-connection", "content-length", "host"}


class Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    target: str = ""
    log_path: str = ""
    lock = threading.Lock()

    def log_message(self, format, *args):  # (quiet: the log file says it all)
        pass

    def _forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        url = urlsplit(self.target)
        upstream = http.client.HTTPConnection(url.hostname, url.port, timeout=3600)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        upstream.request(self.command, self.path, body=body or None, headers=headers)
        answer = upstream.getresponse()
        self.send_response(answer.status, answer.reason)
        for k, v in answer.getheaders():
            if k.lower() not in HOP_HEADERS:
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        received = bytearray()
        while True:
            chunk = answer.read1(65536)
            if not chunk:
                break
            received += chunk
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        upstream.close()
        try:
            request_body = json.loads(body) if body else None
        except ValueError:
            request_body = body.decode(errors="replace")
        record = {"method": self.command, "path": self.path,
                  "headers": {k.lower(): v for k, v in self.headers.items()},
                  "body": request_body, "status": answer.status,
                  "response": received.decode(errors="replace")}
        with self.lock, open(self.log_path, "a") as f:  # (before the client has it all)
            f.write(json.dumps(record) + "\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward


def serve(target: str, port: int, log: str) -> ThreadingHTTPServer:
    handler = type("Handler", (Recorder,), {"target": target, "log_path": log})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server


def read_log(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", required=True)
    a = p.parse_args()
    serve(a.target, a.port, a.log).serve_forever()
