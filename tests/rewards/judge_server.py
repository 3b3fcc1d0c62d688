"""A real OpenAI-compatible chat server on loopback that answers from a script: the stand-in
for an LLM judge in tests and benchmarks (test material, not library code)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedServer:
    """`POST /v1/chat/completions`. `script` is a list of replies used in order (the last one
    repeats), or a function request-body -> reply. A reply is a dict: `text` (the assistant's
    content), `raw` (a 200 whose body is these bytes), or `status` (an HTTP error), plus optional
    `delay`, `headers`, `usage`."""

    def __init__(self, script):
        self.script = script
        self.requests = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    counted = True
                    n = len(server.requests)
                try:
                    reply = server.script(body) if callable(server.script) else server.script[min(n, len(server.script)) - 1]
                    server.stop.wait(reply.get("delay", 0))
                    if "status" in reply:
                        self.send_response(reply["status"])
                        for k, v in reply.get("headers", {}).items():
                            self.send_header(k, v)
                        data = b'{"error": {"message": "scripted"}}'
                    elif "raw" in reply:
                        self.send_response(200)
                        data = reply["raw"]
                    else:
                        self.send_response(200)
                        usage = reply.get("usage", {"prompt_tokens": 100, "completion_tokens": 20})
                        data = json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                                           "choices": [{"index": 0, "finish_reason": "stop",
                                                        "message": {"role": "assistant", "content": reply["text"]}}],
                                           "usage": usage}).encode()
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    with server.lock:  # done before the client can read it (and send its next request)
                        server.in_flight -= 1
                        counted = False
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    if counted:
                        with server.lock:
                            server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
