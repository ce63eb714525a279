"""check_servers.py: the preflight of vLLM servers started elsewhere, run before `async_pipeline.py --generator-urls`.

    python tools/check_servers.py http://node1:8000 http://node2:8000 [--context 1536]

For each URL, a few requests of PROBE_SECONDS and PROBE_BYTES each: its vLLM version (GET /version, at least the run's
SERVER_VERSION_FLOOR), its model and context (GET /v1/models; at least --context tokens, the run's longest prompt and
--max-new-tokens, when given), its weight routes (GET /is_paused, there with VLLM_SERVER_DEV_MODE=1), its token route
(POST /inference/v1/generate without a body: 400 there, 404 without --enable-scale-out) and /health. One line a
server: what it serves, or what is wrong (refused, unresolvable, silent, an HTTP error with its status, not a vLLM
server, a version below the floor, a route or context missing); exit 2 if any is wrong. A run checks less by itself
(infra/serving.py's reach and check_model: the address, the version, /health, its tokenizer's ids) and meets the other
faults at its first publish or request.
"""

import argparse
import http.client
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the method's modules live at the root

from infra import serving
from infra.run_folder import UserError


def diagnose(url: str, context: int = 0, timeout: float = serving.PROBE_SECONDS) -> dict:
    """What the server at `url` is ({"url", "version", "model", "max_model_len"}), or UserError: one line naming the
    URL and what was found."""
    where, parts = serving.server_address(url)
    serving.resolve(parts.hostname, where, timeout)

    def ask(path: str, method: str = "GET") -> tuple[int, bytes]:
        try:
            return serving.http_request(
                url + path, method, b"{}" if method == "POST" else None, timeout, serving.PROBE_BYTES
            )
        except (OSError, http.client.HTTPException) as e:
            raise UserError(f"{where}: {method} {path} {serving.failure(e, timeout)}") from None

    def read(path: str, fields):
        """`fields` of the JSON answer to GET `path`; one line when it is missing, an HTTP error or another answer."""
        status, text = ask(path)
        if status == 404:
            raise UserError(f"{where}: not a vLLM server: GET {path} answered 404 (vLLM's API server has that route)")
        if status != 200:
            raise UserError(f"{where}: GET {path} answered HTTP {status}: {text[: serving.SHOWN_BYTES]!r}")
        try:
            if serving.unreadable(text):
                raise ValueError
            return fields(json.loads(text))
        except (KeyError, IndexError, TypeError, ValueError):
            raise UserError(
                f"{where}: not a vLLM server: GET {path} answered {text[: serving.SHOWN_BYTES]!r}, not what vLLM "
                "answers there"
            ) from None

    version = read("/version", lambda a: str(a["version"]))
    model, served_context = read("/v1/models", lambda a: (str(a["data"][0]["id"]), int(a["data"][0]["max_model_len"])))
    if tuple(int(x) for x in re.findall(r"\d+", version)[:2]) < serving.SERVER_VERSION_FLOOR:
        floor = ".".join(map(str, serving.SERVER_VERSION_FLOOR))
        raise UserError(
            f"{where}: vLLM {version} (GET /version); the run needs vLLM {floor} or later on its servers (the weight "
            "versions of every generated token): upgrade it"
        )
    if ask("/is_paused")[0] == 404:
        raise UserError(
            f"{where}: vLLM {version} serving {model} without its weight routes (GET /is_paused answered 404): start "
            "it with VLLM_SERVER_DEV_MODE=1 (docs/async.md)"
        )
    if ask(serving.GENERATE, "POST")[0] == 404:
        raise UserError(
            f"{where}: vLLM {version} serving {model} without its token route (POST {serving.GENERATE} answered 404): "
            "start it with --enable-scale-out (docs/async.md)"
        )
    if served_context < context:
        raise UserError(
            f"{where}: its context, {served_context} tokens, is below the run's longest prompt and --max-new-tokens "
            f"(--context {context}): start it with --max-model-len {context} or more"
        )
    why = serving.Server(url).health()
    if why:
        raise UserError(f"{where}: GET /health {why}")
    return {"url": url, "version": version, "model": model, "max_model_len": served_context}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("urls", nargs="+", help="the servers, as --generator-urls takes them")
    p.add_argument("--context", type=int, default=0, help="the tokens a run needs: its longest prompt + max new tokens")
    args = p.parse_args(argv)
    wrong = 0
    for url in args.urls:
        try:
            info = diagnose(url.rstrip("/"), args.context)
            print(f"{url}: vLLM {info['version']} serving {info['model']}, context {info['max_model_len']}: ok")
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            wrong += 1
    return 2 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
