"""The soak of `dspo-serve` (bench/retrieval.py --mode server): start the server, load it with concurrent loopback
clients that mix in bad requests, sample its memory.

A 503 (the server's back-pressure, `limits.max_pending`) is counted apart from errors: it is the server refusing load
it cannot take in time, as configured, not a failure; the client that got it waits the 503's `Retry-After`, as dspo's
RemoteRetriever does, before its next request.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path


def start_server(index: Path, port: int, workers: int = 1, overrides: tuple[str, ...] = ()) -> subprocess.Popen:
    """`dspo-serve index=... port=... workers=... [overrides]` as a subprocess (loopback: serve.yaml's default host)."""
    code = "from dspo.search.cli import serve_main; serve_main()"
    command = [sys.executable, "-c", code, f"index={index}", f"port={port}", f"workers={workers}", *overrides]
    return subprocess.Popen(command)


def server_rss_mib(pid: int) -> tuple[float, int]:
    """(RSS in MiB summed over the server and its worker processes, number of processes). Pages the workers share
    (the memory-mapped index, copy-on-write passages) count once per process, so with workers > 1 this overstates
    the memory used; with one process it is that process's RSS."""
    import psutil

    server = psutil.Process(pid)
    total, count = 0, 0
    for process in [server, *server.children()]:
        try:
            total += process.memory_info().rss
            count += 1
        except psutil.NoSuchProcess:  # a worker that exited between the listing and the reading
            pass
    return total / 2**20, count


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Bad requests mixed into the soak, with the status the server must answer (conf/serve.yaml's default limits).
BAD_REQUESTS: dict[str, tuple[bytes, int]] = {
    "malformed_json": (b'{"queries": ["paris", ', 400),
    "huge_query": (json.dumps({"queries": ["x" * 5000], "topk": 3}).encode(), 413),
    "too_many_queries": (json.dumps({"queries": ["paris"] * 513, "topk": 3}).encode(), 413),
    "topk_zero": (json.dumps({"queries": ["paris"], "topk": 0}).encode(), 422),
    "topk_too_large": (json.dumps({"queries": ["paris"], "topk": 101}).encode(), 422),
}


def parse_batch_mix(text: str) -> dict[int, float]:
    """`--batch-mix "1:0.6,8:0.25,512:0.15"` -> {queries per request: share of good requests}."""
    try:
        mix = {int(size): float(share) for size, share in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise SystemExit(f"--batch-mix: expected SIZE:SHARE,SIZE:SHARE,..., got {text!r}") from None
    if not mix or any(size < 1 or size > 512 or share <= 0 for size, share in mix.items()):
        raise SystemExit(f"--batch-mix: sizes must be in 1..512 (serve.yaml's max_queries), shares > 0: {text!r}")
    return mix


async def load_clients(
    url: str, queries: list[str], clients: int, duration_s: float, batch_mix: dict[int, float], bad_share: float
) -> dict:
    """`clients` concurrent loops posting to `url` (loopback only) until `duration_s` has passed. A share `bad_share`
    of the requests are bad ones (BAD_REQUESTS) that must get their 4xx; the rest draw their size from `batch_mix`.
    A 503 is counted in `rejected_503`, not in `errors`, and its client waits its Retry-After (module docstring)."""
    import httpx

    if not url.startswith("http://127.0.0.1:"):
        raise ValueError(f"the load generator only targets loopback, got {url}")
    latencies: dict[int, list[float]] = {size: [] for size in batch_mix}
    bad_answered: dict[str, int] = dict.fromkeys(BAD_REQUESTS, 0)
    errors: list[str] = []
    rejected = [0]  # 503s (back-pressure)
    sizes, weights = list(batch_mix), list(batch_mix.values())
    deadline = time.perf_counter() + duration_s

    async def busy(response: httpx.Response) -> bool:
        """True for a 503, after waiting its Retry-After (at most until the deadline)."""
        if response.status_code != 503:
            return False
        rejected[0] += 1
        try:
            wait = float(response.headers.get("retry-after", "1"))
        except ValueError:
            wait = 1.0
        await asyncio.sleep(max(0.0, min(wait, deadline - time.perf_counter())))
        return True

    async def client(seed: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            if rng.random() < bad_share:
                kind = rng.choice(list(BAD_REQUESTS))
                body, status = BAD_REQUESTS[kind]
                try:
                    response = await http.post(url, content=body, headers={"content-type": "application/json"})
                    if await busy(response):
                        continue
                    if response.status_code == status and "error" in response.json():
                        bad_answered[kind] += 1
                    else:
                        errors.append(f"{kind}: HTTP {response.status_code} (expected {status})")
                except Exception as err:  # noqa: BLE001 - every failure counts as an error here
                    errors.append(f"{kind}: {type(err).__name__}")
                continue
            size = rng.choices(sizes, weights)[0]
            body = {"queries": rng.choices(queries, k=size), "topk": 5, "return_scores": True}
            start = time.perf_counter()
            try:
                response = await http.post(url, json=body)
                if await busy(response):
                    continue
                if response.status_code != 200 or len(response.json()["result"]) != size:
                    errors.append(f"HTTP {response.status_code}")
                    continue
            except Exception as err:  # noqa: BLE001 - every failure counts as an error here
                errors.append(type(err).__name__)
                continue
            latencies[size].append(time.perf_counter() - start)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:
        # the loops stop at the deadline; the guard ends requests stuck past it (a hung server)
        await asyncio.wait_for(asyncio.gather(*(client(i, http) for i in range(clients))), duration_s + 120)
    elapsed = time.perf_counter() - start

    def pct(values: list[float], p: float) -> float:
        values = sorted(values)
        return round(1000 * values[min(len(values) - 1, int(p * len(values)))], 1) if values else -1.0

    every = [x for values in latencies.values() for x in values]
    return {
        "clients": clients,
        "duration_s": round(elapsed, 1),
        "batch_mix": batch_mix,
        "requests": len(every),
        "requests_per_s": round(len(every) / elapsed, 1),
        "queries_per_s": round(sum(size * len(v) for size, v in latencies.items()) / elapsed, 1),
        "p50_ms": pct(every, 0.50),
        "p99_ms": pct(every, 0.99),
        "by_batch_size": {
            size: {"requests": len(v), "p50_ms": pct(v, 0.50), "p99_ms": pct(v, 0.99)} for size, v in latencies.items()
        },
        "bad_requests_answered_4xx": bad_answered,
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "rejected_503": rejected[0],
    }


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dspo-serve exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"dspo-serve not healthy at {url} after {timeout_s}s")
