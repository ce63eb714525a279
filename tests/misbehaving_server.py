"""Stand-in HTTP servers for the fault tests of async runs. Each binds a loopback address of this machine (127.0.0.x)
on a free port, serves on a thread of its own, and stops by itself after MAX_REQUESTS requests or LIFETIME seconds, or
when closed. A "vllm" stand-in answers the routes the run uses as vLLM 0.32's API server does (the samples: a fixed
completion, log-probs of -1, the weight version last published) until its `fault` takes over; "500" answers HTTP 500
to everything; "static" is a plain `http.server` serving a folder. Also a script (python misbehaving_server.py HOST
PORT DELAY): a "vllm" stand-in that starts listening after DELAY seconds, as a launched server that loads."""

import functools
import http.server
import json
import socket
import sys
import tempfile
import threading
import time

HOST = "127.0.0.3"  # not the session's vLLM servers' 127.0.0.2, nor the trainers' 127.0.0.1
MAX_REQUESTS = 20000  # a run against a stand-in answering every 0.2 s makes fewer in LIFETIME
LIFETIME = 600.0  # seconds: longer than any test that uses one
GENERATE = "/inference/v1/generate"
HUGE_BYTES = 2**30  # a `huge` route's answer


class StandIn:
    """A stand-in server (module docstring) at `self.url`, as a context manager. A "vllm" stand-in's generate route
    answers `fault` once `fault_when()` is true: "garbage" (bytes that are not UTF-8), "{}" (JSON without a field),
    "never" (the connection held open, no answer, until the stand-in stops), "nan" (log-probs NaN), "vocab" (token ids
    beyond any vocabulary), "short" (one log-prob fewer than token ids); a path in `hang` gets no answer at all once
    `fault_when()` is true, and one in `drip` its answer a byte every `drip_seconds`. `version`, `max_model_len` and
    `tokens` (what /tokenize gives: `encode(text)` by default) shape what it says of itself, a path in `missing`
    answers 404, one in `huge` HUGE_BYTES of zeros (sent until the client stops reading), and samples come after
    `delay` seconds."""

    def __init__(
        self,
        kind: str = "vllm",
        encode=None,
        fault: str | None = None,
        fault_when=lambda: True,
        hang: tuple[str, ...] = (),
        drip: tuple[str, ...] = (),
        drip_seconds: float = 2.0,
        missing: tuple[str, ...] = (),
        version: str = "0.32.0",
        max_model_len: int = 512,
        tokens: list[int] | None = None,
        completion: tuple[int, ...] = (49, 50),
        delay: float = 0.0,
        huge: tuple[str, ...] = (),
    ):
        self.kind, self.encode, self.fault, self.fault_when, self.hang = kind, encode, fault, fault_when, hang
        self.drip, self.drip_seconds = drip, drip_seconds
        self.missing, self.version, self.max_model_len, self.tokens = missing, version, max_model_len, tokens
        self.completion, self.weight_version, self.delay, self.huge = completion, "0", delay, huge
        self.world_size = 1  # its workers, as GET /get_world_size says (tensor x pipeline x data parallel)
        self.stop, self.requests, self.faulted_at = threading.Event(), 0, None
        self.generated = 0  # generate requests answered with samples
        if kind == "static":  # the plain http.server of the standard library, on a folder of one file
            self.folder = tempfile.TemporaryDirectory()
            with open(f"{self.folder.name}/index.html", "w") as f:
                f.write("<html>a static site</html>")
            handler = functools.partial(QuietStatic, directory=self.folder.name)
        else:
            handler = functools.partial(Handler, self)
        self.httpd = http.server.ThreadingHTTPServer((HOST, 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.timeout = 0.2  # handle_request's wait, so that the loop sees `stop`
        self.url = f"http://{HOST}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.serve, daemon=True)

    def __enter__(self) -> "StandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)

    def serve(self) -> None:
        deadline = time.monotonic() + LIFETIME
        while not self.stop.is_set() and self.requests < MAX_REQUESTS and time.monotonic() < deadline:
            self.httpd.handle_request()
        self.stop.set()  # handlers holding a connection open let go
        self.httpd.server_close()

    def faulty(self) -> bool:
        """Whether the fault has taken over (the moment it first did is kept)."""
        if self.fault_when():
            self.faulted_at = self.faulted_at or time.time()
            return True
        return False

    def answer(self, method: str, path: str, body: dict) -> tuple[int, bytes] | None:
        """The status and body for one request; None to answer nothing (until the stand-in stops)."""
        if self.kind == "500":
            return 500, b'{"detail": "Internal Server Error"}'
        route = path.split("?")[0]
        if route in self.missing:
            return 404, b'{"detail":"Not Found"}'
        if route in self.hang and self.faulty():
            return None
        if route == "/version":
            return 200, json.dumps({"version": self.version}).encode()
        if route == "/v1/models":
            model = {"id": "/models/stand-in", "object": "model", "root": "/models/stand-in"}
            return 200, json.dumps(
                {"object": "list", "data": [{**model, "max_model_len": self.max_model_len}]}
            ).encode()
        if route == "/health":
            return 200, b""
        if route == "/get_world_size":
            return 200, json.dumps({"world_size": self.world_size}).encode()
        if route == "/is_paused":
            return 200, b'{"is_paused": false}'
        if route == "/tokenize":
            tokens = self.tokens if self.tokens is not None else self.encode(body["prompt"])
            return 200, json.dumps(
                {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
            ).encode()
        if route == "/update_weight_version":
            self.weight_version = str(body["new_version"])
            return 200, json.dumps({"success": True, "new_version": self.weight_version}).encode()
        if route in ("/pause", "/resume", "/collective_rpc"):
            return 200, b'{"results": []}'
        if route == GENERATE:
            if "token_ids" not in body:
                return 400, b'{"error": {"message": "Field required: token_ids", "code": 400}}'
            fault = self.fault if self.fault and self.faulty() else None
            if fault in ("garbage", "{}", "never"):
                return {"garbage": (200, b"\xff\xfe\x00 not JSON \x81"), "{}": (200, b"{}"), "never": None}[fault]
            self.stop.wait(self.delay)
            self.generated += 1
            return 200, json.dumps(self.samples(body, fault)).encode()
        return 404, b'{"detail":"Not Found"}'

    def samples(self, body: dict, fault: str | None = None) -> dict:
        """The samples of a generate request; with `fault` "nan", "vocab" or "short", wrong as it says."""
        params = body["sampling_params"]
        ids = [self.completion[i % len(self.completion)] for i in range(params.get("max_tokens", 16))]
        if fault == "vocab":
            ids = [10**7 + t for t in ids]
        logprob = float("nan") if fault == "nan" else -1.0  # json.dumps writes NaN, as Python's json reads it
        content = [{"token_id": t, "logprob": logprob, "rank": 1} for t in ids]
        choices = [
            {
                "index": i,
                "finish_reason": "length",
                "token_ids": ids,
                "weight_versions": [{"version": self.weight_version, "start": 0, "end": len(ids)}],
                "logprobs": {"content": content[:-1] if fault == "short" else content},
            }
            for i in range(params.get("n", 1))
        ]
        return {"request_id": "stand-in", "choices": choices}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def __init__(self, stand_in: StandIn, *args, **kwargs):
        self.stand_in = stand_in
        super().__init__(*args, **kwargs)

    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, method: str) -> None:
        self.stand_in.requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            body = {}
        answer = self.stand_in.answer(method, self.path, body)
        if answer is None:  # hold the connection, answer nothing
            self.stand_in.stop.wait(LIFETIME)
            self.close_connection = True
            return
        status, data = answer
        if self.path.split("?")[0] in self.stand_in.huge:
            self.send_huge()
            return
        if self.path.split("?")[0] in self.stand_in.drip and self.stand_in.faulty():
            self.drip(status, data)
            return
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_huge(self) -> None:
        """An answer of HUGE_BYTES zeros, a MiB at a time, until it is whole or the client stops reading."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(HUGE_BYTES))
        self.end_headers()
        chunk = bytes(2**20)
        for _ in range(HUGE_BYTES // len(chunk)):
            try:
                self.wfile.write(chunk)
            except OSError:  # the client read what it wanted and closed
                return

    def drip(self, status: int, data: bytes) -> None:
        """The whole answer, status line first, a byte every drip_seconds (until the stand-in stops)."""
        head = f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.close_connection = True
        for i, byte in enumerate(head.encode() + data):
            if i and self.stand_in.stop.wait(self.stand_in.drip_seconds):
                return
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:  # the client gave up
                return

    def do_GET(self) -> None:
        self.reply("GET")

    def do_POST(self) -> None:
        self.reply("POST")


class QuietStatic(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class Silent:
    """A listening socket that never answers: the kernel takes connections, requests get nothing back."""

    def __enter__(self) -> "Silent":
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(64)
        self.url = f"http://{HOST}:{self.sock.getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()


def closed_port() -> str:
    """The URL of a port of HOST that nothing listens on: connections are refused."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return f"http://{HOST}:{s.getsockname()[1]}"


if __name__ == "__main__":  # a launched server that loads for DELAY seconds, then answers as vLLM until stopped
    host, port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    time.sleep(delay)
    server = StandIn(encode=lambda text: list(text.encode()))
    server.httpd.server_close()
    server.httpd = http.server.ThreadingHTTPServer((host, port), functools.partial(Handler, server))
    server.httpd.daemon_threads, server.httpd.timeout = True, 0.2
    server.serve()
