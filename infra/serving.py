"""serving.py: the W vLLM servers of async_pipeline.py: launched on this node's GPUs (or the CPU) or started
elsewhere (--generator-urls), probed, asked over HTTP with a deadline on every request, their answers read and checked,
and stopped; a server's failure is a ServerError, a PipelineError that stops every rank (tools/check_servers.py probes
servers started elsewhere with the same requests)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import torch

from infra import generation, models, run_folder
from infra.run_folder import UserError


class PipelineError(RuntimeError):
    """A vLLM server failed (or rank 0 stopped the run because of one): exit 1 on every rank."""


# A generate request that gets no answer within its bound fails the run (a hung or stopped server): REQUEST_FACTOR times
# its server's reference answer (the longest of those asking the most tokens per sample so far: its warm-up's until a
# rollout request answers), scaled to the tokens per sample it asks for, at least REQUEST_FLOOR. Tokens per sample set
# a request's time: a request's samples decode together, one token each per engine step. A launched server's first
# request of each size (its warm-up, its first rollout request) has START_SECONDS; a server the run did not launch is up
# (probe), so its first requests have the bound of any other.
REQUEST_FACTOR = 10  # requests of one size vary by a few times on a busy machine; a hung server never answers


def env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable `name` (a positive number), else `default`; one line and exit 2 for
    another value."""
    text = os.environ.get(name)
    try:
        seconds = default if text is None else float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:  # read as this module loads, before main: the entry's one line and exit status here
        print(f"error: {name}={text!r}: not a positive number of seconds", file=sys.stderr)
        raise SystemExit(2)
    return seconds


# a busy 2-core machine's requests take seconds; a fast cluster may name a hung server sooner with a lower floor
REQUEST_FLOOR = env_seconds("REPLAY_GRPO_REQUEST_FLOOR", 60.0)
START_SECONDS = 1800.0  # a launched server may compile on its first requests, and its process is watched meanwhile
PROBE_PROMPTS = 4  # held-out prompts, with their gold solutions as completions, in the publish check's probe
# The publish check stops a run whose server serves other log-probs than the trainer's at the published version by
# more than this, per probe token on average. Measured on a CPU server (fp32, tiny model): the right weights 2.7e-7;
# another model's 0.25; the right model with every weight moved at random by 10%, 30%, 100% of its tensor's std
# 0.035, 0.095, 0.22. It sits above the sampler/trainer gap MISMATCH_WARN warns about (0.05), so bf16 serving does
# not trip it: it catches weights that are wrong, not a server a few small steps behind
PROBE_BOUND = 0.1
READY_SECONDS = 1800.0  # a launched server that is not healthy after this stops the run (its log's tail shown)
# /pause, /update_weight_version, /resume (no generation) may take CONTROL_FACTOR times the bound of the server's
# generate requests of the reference size: a hung server is then named by its generate request when one is in flight
CONTROL_FACTOR = 2
STARTING_LINE_SECONDS = 60.0  # while launched servers load, a line this often names those still starting
LOAD_BYTES_PER_SECOND = 20 * 2**20  # a reload reads the published weights: at least a slow shared filesystem's rate
PROBE_SECONDS = 5.0  # each probe of a server the run did not launch: one that is up answers within milliseconds
PROBE_BYTES = 2**20  # the most a probe's answer is read: vLLM's /version and /v1/models answer under 1 KB
SERVER_VERSION_FLOOR = (0, 32)  # the generate route's weight_versions spans, which date every rollout's tokens
SHOWN_BYTES = 200  # of an answer the run cannot read: enough to tell an error page, HTML or garbage
WARM_UP_TOKENS = 2  # a server's first request: two tokens, its answer the first reference of the bounds
GENERATE = "/inference/v1/generate"
# encoded by the run's tokenizer and by a server's (POST /tokenize): other token ids mean another model
MODEL_PROBE_TEXT = "Please reason step by step: 12+7=?"


class ServerError(PipelineError):
    """A vLLM server did not start, died, or answered an error: one line naming it."""


def as_server_error(what: str, e: Exception) -> ServerError:
    """The error a thread hands to the dealer: a ServerError as it is, anything else as one line naming `what`."""
    return e if isinstance(e, ServerError) else ServerError(" ".join(f"{what}: {type(e).__name__}: {e}".split()))


def timed_out(e: BaseException) -> bool:
    """Whether a failed request got no answer within its timeout (urllib wraps a connect's timeout in a URLError)."""
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


def unreadable(text: bytes) -> str | None:
    """Why an answer is not JSON the run can read (not UTF-8, not JSON, beyond run_folder.read_json's bounds), or
    None."""
    try:
        run_folder.read_json(text.decode(), "it", max_chars=None)
    except UnicodeDecodeError as e:
        return f"not UTF-8 at byte {e.start}"
    except run_folder.JSONBoundError as e:
        return str(e)
    except ValueError as e:
        return f"not JSON: {getattr(e, 'msg', e)}"
    return None


class WrongAnswer(ValueError):
    """An answer that reads as JSON with every field, whose values the trainer cannot take (a token id outside its
    vocabulary, a log-prob that is not finite)."""


class TooLarge(http.client.HTTPException):
    """An answer longer than its request's max_bytes: read no further."""

    def __init__(self, max_bytes: int):
        super().__init__(f"an answer longer than {max_bytes} bytes, the most this request reads")


class Late(TimeoutError):
    """A request that had no whole answer by its deadline."""

    def __init__(self):
        super().__init__("timed out")


def http_request(
    url: str, method: str = "GET", data: bytes | None = None, timeout: float = PROBE_SECONDS, max_bytes=None
):
    """(status, body) of one HTTP request to `url` that ends within `timeout` seconds in all: connecting, the headers
    and the body together (a socket timeout bounds each read alone, so a server answering a byte at a time would hold
    the run for ever). A timer shuts the socket down at the deadline, which ends any read under way; past it, Late.
    A body longer than `max_bytes` (None: no bound) is read no further: TooLarge. Other failures raise as urllib's do
    (OSError, http.client.HTTPException)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = connection(parts.hostname, parts.port, timeout=timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    t0, late = time.monotonic(), threading.Event()

    def cut() -> None:
        late.set()
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    timer.start()
    try:
        headers = {"Content-Type": "application/json", "Connection": "close"}
        conn.request(method, target, body=data, headers=headers)
        answer = conn.getresponse()
        body = answer.read() if max_bytes is None else answer.read(max_bytes + 1)
        if max_bytes is not None and len(body) > max_bytes:
            raise TooLarge(max_bytes)
        return answer.status, body
    except (OSError, http.client.HTTPException):
        if late.is_set() or time.monotonic() - t0 >= timeout:
            raise Late from None
        raise
    finally:
        timer.cancel()
        conn.close()


@dataclasses.dataclass
class Server:
    """One OpenAI-compatible vLLM server: its URL and, when this run launched it, its process and log; and the reference
    answer of its generate requests' bounds (tokens per sample, seconds)."""

    url: str
    proc: subprocess.Popen | None = None
    log: Path | None = None
    reference: tuple[int, float] = (0, 0.0)
    vocab: int = 0  # the trainer's vocabulary: every sampled token id must be below it (0: not known yet)

    def post(self, path: str, body: dict | None = None, timeout: float | None = None, parse=None, method="POST"):
        """POST JSON (GET: no body); the answer as JSON ({} when empty), through `parse` when given. Any failure is a
        ServerError in one line naming the server and the endpoint: no connection, no answer within `timeout` (default:
        a control request's, control_bound; the request's age said), an HTTP error, an answer that is not JSON or that
        `parse` cannot read (a missing field, a wrong value: KeyError, IndexError, TypeError or ValueError), with its
        first SHOWN_BYTES bytes."""
        timeout = self.control_bound() if timeout is None else timeout
        data = json.dumps(body or {}).encode() if method == "POST" else None
        t0 = time.monotonic()
        try:
            status, text = http_request(self.url + path, method, data, timeout)
        except (OSError, http.client.HTTPException) as e:  # refused, reset, no whole answer by the deadline
            if self.proc is not None:  # a launched server whose connection dropped may be dying: say so if it is
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(2.0)
            age = f": no answer in {time.monotonic() - t0:.0f} s, this request's bound" if timed_out(e) else ""
            raise ServerError(f"vLLM server {self.url}: {path} failed ({e}){age}{self.died() or ''}") from None
        if not 200 <= status < 300:
            raise ServerError(f"vLLM server {self.url}: {path} answered {status}: {text[:SHOWN_BYTES]!r}")
        why = unreadable(text) if text.strip() else None
        if why:
            raise ServerError(
                f"vLLM server {self.url}: {path} answered what the run cannot read as JSON ({why}): "
                f"{text[:SHOWN_BYTES]!r}"
            )
        value = json.loads(text) if text.strip() else {}
        try:
            return parse(value) if parse else value
        except WrongAnswer as e:
            raise ServerError(
                f"vLLM server {self.url}: {path} answered what the trainer cannot take ({e}): {text[:SHOWN_BYTES]!r}"
            ) from None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ServerError(
                f"vLLM server {self.url}: {path} answered without what the run reads ({what}): {text[:SHOWN_BYTES]!r}"
            ) from None

    def health(self) -> str | None:
        """None when GET /health answers 200 within PROBE_SECONDS, else what happened."""
        try:
            status, text = http_request(self.url + "/health", timeout=PROBE_SECONDS, max_bytes=PROBE_BYTES)
        except (OSError, http.client.HTTPException) as e:
            return f"failed ({e})"
        if status == 200:
            return None
        return f"answered HTTP {status}: {text[:SHOWN_BYTES]!r}" if status >= 400 else f"answered {status}"

    def bound(self, tokens: int) -> float:
        """Seconds a generate request of `tokens` per sample may take (REQUEST_FACTOR and the others above)."""
        ref_tokens, ref_seconds = self.reference
        if self.proc is not None and ref_tokens < tokens:
            return START_SECONDS
        if not ref_tokens:
            return REQUEST_FLOOR
        return max(REQUEST_FLOOR, REQUEST_FACTOR * ref_seconds * max(1.0, tokens / ref_tokens))

    def control_bound(self) -> float:
        """Seconds a request that generates nothing may take (CONTROL_FACTOR above)."""
        return CONTROL_FACTOR * self.bound(self.reference[0])

    def answered(self, tokens: int, seconds: float) -> None:
        """Keep the reference of the bounds: the longest answer among those of the most tokens per sample so far."""
        ref_tokens, ref_seconds = self.reference
        if tokens > ref_tokens:
            self.reference = (tokens, seconds)
        elif tokens == ref_tokens:
            self.reference = (tokens, max(seconds, ref_seconds))

    def died(self) -> str | None:
        """Launched here and exited: how, with the last lines of its log; else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"; the server exited with code {self.proc.returncode}; the end of {self.log}: {self.log_tail()}"

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text[-lines:])


def resolve(host: str | None, where: str, timeout: float) -> None:
    """Refuse a host name that does not resolve within `timeout` (the resolver has no bound of its own: it runs on a
    daemon thread)."""
    if not host:
        raise UserError(f"{where}: no host in the URL")
    found = []

    def look() -> None:
        try:
            found.append(socket.getaddrinfo(host, None))
        except (OSError, UnicodeError) as e:  # gaierror; a label the IDNA codec refuses (over 63 characters)
            found.append(e)

    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    thread.join(timeout)
    if not found:
        raise UserError(f"{where}: the host {host} was not resolved within {timeout:.0f} s")
    if isinstance(found[0], Exception):
        reason = getattr(found[0], "strerror", None) or str(found[0])
        raise UserError(f"{where}: the host {host} cannot be resolved ({reason}): is the name right?")


def failure(e: BaseException, timeout: float) -> str:
    """What a request that got no answer met, for a line naming the server: refused, silent, or the reason."""
    reason = getattr(e, "reason", e)
    if isinstance(reason, ConnectionRefusedError):
        return (
            "was refused: nothing listens at that address and port (a vLLM server listens once its model is loaded: "
            "start the run once its /health answers)"
        )
    if timed_out(e):
        return (
            f"got no answer within {timeout:.0f} s (something there takes connections and answers nothing, or too "
            "slowly to finish, or the host drops them)"
        )
    return f"failed ({reason})"


def server_address(url: str) -> tuple[str, urllib.parse.SplitResult]:
    """The flag's words for `url` and its parts, or UserError: a port that is not one, or a path, query or fragment
    (an OpenAI client's base URL ends in /v1: the run and the preflight call vLLM's routes themselves)."""
    where, parts = f"--generator-urls {url}", urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"{where}: not a server's URL: give http://HOST:PORT (or https://), the scheme included")
    try:
        _ = parts.port  # urlsplit checks the port when it is read
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise UserError(
            f"{where}: a URL with a path ({url.split(parts.netloc, 1)[1]}); give the server's address alone, "
            f"{parts.scheme}://{parts.netloc} (the run calls vLLM's routes, /v1/models among them, itself)"
        )
    return where, parts


def reach(url: str, timeout: float = PROBE_SECONDS) -> dict:
    """Refuse in one line (UserError, naming the URL) a server the run did not launch that it cannot use: a URL that
    is not a server's address, a host that does not resolve, no answer within `timeout`, no vLLM at least
    SERVER_VERSION_FLOOR (GET /version: the weight versions of every token), /health failing. What else a server
    needs (its weight and token routes, its model and context) tools/check_servers.py diagnoses: the docs tell a
    --generator-urls user to run it first; the run meets those faults at its first publish or request."""
    where, parts = server_address(url)
    more = f" (python tools/check_servers.py {url} diagnoses it)"
    resolve(parts.hostname, where, timeout)
    try:
        status, text = http_request(url + "/version", "GET", None, timeout, PROBE_BYTES)
    except (OSError, http.client.HTTPException) as e:
        raise UserError(f"{where}: GET /version {failure(e, timeout)}") from None
    try:
        if status != 200 or unreadable(text):
            raise ValueError
        version = str(json.loads(text)["version"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: GET /version answered HTTP {status}: {text[:SHOWN_BYTES]!r}{more}") from None
    if tuple(int(x) for x in re.findall(r"\d+", version)[:2]) < SERVER_VERSION_FLOOR:
        floor = ".".join(map(str, SERVER_VERSION_FLOOR))
        raise UserError(
            f"{where}: vLLM {version} (GET /version); the run needs vLLM {floor} or later on its servers (the weight "
            "versions of every generated token): upgrade it"
        )
    why = Server(url).health()
    if why:
        raise UserError(f"{where}: GET /health {why}")
    return {"url": url, "version": version}


def check_model(url: str, tok, model: str) -> None:
    """Refuse a server the run did not launch that serves another model than the run's: its tokenizer reads
    MODEL_PROBE_TEXT as other token ids (the ids sent to it would be other text)."""
    where = f"--generator-urls {url}"
    ids = list(tok.encode(MODEL_PROBE_TEXT, add_special_tokens=False))
    body = {"prompt": MODEL_PROBE_TEXT, "add_special_tokens": False}
    try:
        served = Server(url).post("/tokenize", body, PROBE_SECONDS, parse=lambda a: [int(t) for t in a["tokens"]])
    except ServerError as e:
        raise UserError(f"{where}: {e}") from None
    if served != ids:
        raise UserError(
            f"{where}: serves another model than the run's --model {model}: its tokenizer reads {MODEL_PROBE_TEXT!r} "
            f"as token ids {served[:8]}..., where the run's gives {ids[:8]}...; the run publishes its weights to it, "
            "but the token ids it sends would be other text"
        )


def server_gpus(W: int, T: int, n_gpus: int) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES entry of each launched server: the GPUs after the T trainers' (W + T <= n_gpus), else
    shared round-robin (one GPU: the trainer's); None without GPUs. Mapped through an inherited CUDA_VISIBLE_DEVICES
    (SLURM, containers; ordinals, UUIDs or MIG names alike): a child reads its value as physical devices."""
    if not n_gpus:
        return [None] * W
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in inherited.split(",")] if inherited else [str(i) for i in range(n_gpus)]
    return [visible[(T + i) % n_gpus] for i in range(W)]


LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded here: never in a forked child
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process `sig` once the thread of `parent` that started it ends (Linux's
    PR_SET_PDEATHSIG; a no-op elsewhere), as a child's preexec_fn or in a process itself: a parent killed by SIGKILL
    (kill -9, the OOM killer) runs no cleanup, and a server it launched would go on holding its GPU and port. Sent at
    once when `parent` is already gone (it died before the call)."""
    if LIBC is None:
        return
    LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def check_generator_host(host: str) -> None:
    """Refuse in one line a --generator-host that does not resolve, or is not an address of this machine (the servers
    launched here listen on it): the address is bound as free_port binds it."""
    where = f"--generator-host {host}"
    resolve(host, where, PROBE_SECONDS)
    try:
        free_port(host)
    except OSError as e:
        raise UserError(
            f"{where}: not an address of this machine ({e.strerror or e}): the servers launched here listen on it; "
            "give one of this machine's addresses (127.0.0.1, or its own on the network)"
        ) from None


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_servers(
    cfg, folder: Path, max_model_len: int, gpus: list, log_dir: Path, memory: float = 0.9
) -> list[Server]:
    """W `python -m vllm.entrypoints.openai.api_server` processes on this node (the module entry point: the CPU
    wheel's `vllm serve` script fails), one per entry of `gpus`, on free ports of --generator-host; each in its own
    session so that Ctrl-C reaches the trainer first and stop_servers ends them, and sent SIGTERM by the kernel when
    the thread that launched it ends (die_with_parent: a trainer killed by SIGKILL leaves none behind). The caller's
    thread must live as long as the servers: the main thread, in the run and in the test suite's fixture."""
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    try:
        for i, gpu in enumerate(gpus):
            port = free_port(cfg.generator_host)
            env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # /pause, /collective_rpc, /update_weight_version
            if gpu is None:  # vLLM's CPU default ("auto") would take most of the RAM for its KV cache
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            else:
                env["CUDA_VISIBLE_DEVICES"] = gpu
            log = log_dir / f"server{i}.log"
            with open(log, "w") as out:  # the server writes to its own copy of the file descriptor
                proc = subprocess.Popen(
                    server_command(cfg, folder, max_model_len, port, cpu=gpu is None, memory=memory),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=functools.partial(die_with_parent, os.getpid()),
                )
            servers.append(Server(f"http://{cfg.generator_host}:{port}", proc, log))
    except BaseException:  # a failed launch or Ctrl-C: the ones started live in their own sessions, so end them here
        stop_servers(servers)
        raise
    return servers


def server_command(cfg, folder, max_model_len: int, port, cpu: bool, memory: float = 0.9) -> list[str]:
    """The launch line of one server (docs/async.md gives it for other nodes); `memory`: its share of its GPU."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    cmd += ["--host", cfg.generator_host, "--port", str(port), "--dtype", "float32" if cpu else "bfloat16"]
    cmd += ["--max-model-len", str(max_model_len), "--seed", str(cfg.seed), "--generation-config", "vllm"]
    cmd += ["--logprobs-mode", "processed_logprobs", "--enable-scale-out"]  # log_softmax(logits / T); token ids in/out
    cmd += ["--no-enable-prefix-caching"]  # a cached prompt's KV would be the older weights' after a publish
    if cpu:  # whole prefills: the CPU runner fails on a seeded request cut in two ("CPU Generator does not use offset")
        cmd += ["--enforce-eager", "--no-enable-chunked-prefill"]  # vLLM then fits a step's tokens to max_model_len
    else:
        cmd += ["--gpu-memory-utilization", str(memory), "--weight-transfer-config", '{"backend": "nccl"}']
    return cmd


def wait_ready(servers: list[Server], timeout: float = READY_SECONDS) -> float:
    """Wait until every server answers /health (a line every STARTING_LINE_SECONDS names the launched ones still
    starting and for how long), then warm each up with a WARM_UP_TOKENS request, the first reference of its bounds;
    seconds waited. A launched server that exits, or that is not healthy after `timeout`, is a ServerError with its
    log's last lines; a server the run did not launch is up (probe): one whose /health fails is named at once, and its
    warm-up has the bound of any request (Server.bound: REQUEST_FLOOR), a launched server's START_SECONDS."""
    t0 = said = time.monotonic()
    starting = list(servers)
    while starting:
        for s in list(starting):
            why = s.health()
            if why is None:
                starting.remove(s)
            elif s.died():
                raise ServerError(f"vLLM server {s.url} did not start{s.died()}")
            elif s.proc is None:
                raise ServerError(f"vLLM server {s.url}: /health {why}")
        now = time.monotonic()
        if starting and now - t0 > timeout:
            s = starting[0]
            raise ServerError(
                f"vLLM server {s.url} not healthy after {timeout:.0f} s"
                + (f"; the end of {s.log}: {s.log_tail()}" if s.log else "")
            )
        if starting and now - said >= STARTING_LINE_SECONDS:
            print(
                f"vLLM servers still starting after {now - t0:.0f} s: {', '.join(s.url for s in starting)}", flush=True
            )
            said = now
        if starting:
            time.sleep(1.0)
    for s in servers:
        t1 = time.monotonic()
        s.post(GENERATE, {"token_ids": [0], "sampling_params": {"max_tokens": WARM_UP_TOKENS}}, s.bound(WARM_UP_TOKENS))
        s.answered(WARM_UP_TOKENS, time.monotonic() - t1)
    return time.monotonic() - t0


def stop_servers(servers: list[Server], timeout: float = 20.0) -> None:
    """End the servers this run launched (their whole process groups: vLLM starts an engine process)."""
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGTERM)
                os.killpg(s.proc.pid, signal.SIGCONT)  # a stopped server must see the SIGTERM
    deadline = time.monotonic() + timeout
    for s in servers:
        if s.proc is None:
            continue
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # the engine process, if it outlived the server
            os.killpg(s.proc.pid, signal.SIGKILL)


def on_daemons(fn, n: int) -> list:
    """[fn(0), ..., fn(n - 1)] run together on daemon threads, raising the first error: a thread blocked on a hung
    server must not hold the process at its exit (an executor's threads are joined then)."""
    results, errors = [None] * n, []

    def call(i: int) -> None:
        try:
            results[i] = fn(i)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def on_servers(servers: list[Server], fn) -> list:
    """[fn(server, i) for each server], all together (on_daemons)."""
    return on_daemons(lambda i: fn(servers[i], i), len(servers))


def start_generators(cfg, run_dir: Path, model, tok, T: int, device: torch.device, probed=()) -> list[Server]:
    """--generator-urls (`probed`: what reach found of each), refused if one serves another model (check_model), or W
    servers launched on this node from a plain folder of the current policy (`model`: rank 0's host copy) under the
    run folder; not yet waited for."""
    if cfg.generator_urls:
        for info in probed:
            check_model(info["url"], tok, cfg.model)
        return [Server(url.rstrip("/")) for url in cfg.generator_urls]
    try:
        generation.import_vllm()
    except generation.VLLMUnavailable as e:
        raise UserError(f"async_pipeline.py launches vLLM servers: {e}") from None
    folder = models.export_plain_folder(model, tok, str(run_dir / "served"))
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    gpus = server_gpus(cfg.num_generators, T, n_gpus)
    own = cfg.num_generators + T <= n_gpus  # else a server shares its GPU: --vllm-gpu-memory-utilization of it
    memory = 0.9 if own else cfg.vllm_gpu_memory_utilization
    return launch_servers(cfg, Path(folder), models.context_length(model), gpus, run_dir / "servers", memory=memory)
