"""Retrieval benchmark: BM25 backends (build time, peak memory, queries/s, recall) and the HTTP service under load.

    python bench/retrieval.py                       # index mode on the HotpotQA dev corpus + 1M passages
    python bench/retrieval.py --synthetic-size 0    # HotpotQA dev corpus only
    python bench/retrieval.py --mode server --clients 50 --duration-s 300   # soak of dspo-serve on loopback
    python bench/retrieval.py --mode server --workers 4 --index indexes/wiki18   # 4 workers over an existing index
    python bench/retrieval.py --scale 1000000 5000000 21015324   # wiki-18-shaped corpora (bench/_scale.py)

Queries/s is the best of `--repeats` passes over the 500 queries (the machine may be shared). Each (corpus, backend)
measurement runs in a fresh child process so its peak RSS is its own; a child that exceeds
`--time-cap-s` is killed and reported as skipped. rank-bm25 scores one query at a time in pure Python, so on large
corpora it answers only as many of the 500 queries as fit in `--query-budget-s` (the count is printed).
The synthetic corpus: Zipf-distributed pseudo-words (100k vocabulary, 30-70 words per passage, fixed seed);
its queries are 6 content words (not among the 100 most frequent) drawn from 500 random passages, and "recall" is
the share whose source passage is in the top 5.
The soak (bench/_soak.py) serves the HotpotQA dev index it builds, or `--index DIR`, from `--workers` processes; its
queries are the HotpotQA dev questions whatever the index. 503s (back-pressure) are counted apart from errors.
Results are printed as a table and written as JSON: `outputs/bench/retrieval.json` in the working directory, or `--out`;
`--update-shipped` writes the tracked `bench/results/retrieval.json` that bench/README.md quotes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance
from _soak import free_port, load_clients, parse_batch_mix, server_rss_mib, start_server, wait_healthy

REPO = Path(__file__).resolve().parents[1]
HOTPOTQA = REPO / "data" / "hotpotqa_dev500"  # carried by the repository (data/README.md)


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def shared_workload() -> tuple[list, list[str], list[list[str]]]:
    from dspo.search.corpus import load_corpus

    rows = [json.loads(line) for line in (HOTPOTQA / "questions.jsonl").read_text().splitlines() if line.strip()]
    gold = [row["metadata"]["supporting_titles"] for row in rows]
    return load_corpus(HOTPOTQA / "corpus.jsonl.gz"), [row["question"] for row in rows], gold


def synthetic_workload(size: int, num_queries: int = 500, seed: int = 0) -> tuple[list, list[str], list[list[str]]]:
    import numpy as np

    from dspo.types import Passage

    rng = np.random.default_rng(seed)
    vocab_size = 100_000
    letters = rng.integers(ord("a"), ord("z") + 1, size=(vocab_size, 10), dtype=np.uint8)
    vocab = [bytes(row[:n]).decode() for row, n in zip(letters, rng.integers(3, 11, size=vocab_size))]
    probs = 1.0 / np.arange(1, vocab_size + 1) ** 1.07
    lengths = rng.integers(30, 71, size=size)
    words = rng.choice(vocab_size, size=int(lengths.sum()), p=probs / probs.sum()).tolist()
    passages, start = [], 0
    for i, n in enumerate(lengths.tolist()):
        passages.append(
            Passage(id=f"s{i}", title=f"doc {i}", text=" ".join([vocab[j] for j in words[start : start + n]]))
        )
        start += n
    # queries: 6 content words of a random passage (the 100 most frequent pseudo-words play the stop words)
    rank = {word: r for r, word in enumerate(vocab)}
    queries, gold = [], []
    for i in rng.choice(size, size=num_queries, replace=False).tolist():
        content = [w for w in dict.fromkeys(passages[i].text.split()) if rank[w] >= 100]
        picked = rng.choice(len(content), size=min(6, len(content)), replace=False)
        queries.append(" ".join(content[j] for j in sorted(picked)))
        gold.append([passages[i].title])
    return passages, queries, gold


def run_child(spec: dict) -> dict:
    """One measurement (called in a fresh process): load/generate the corpus, build, search, score recall."""
    from dspo.search.bm25 import BM25Index, recall_at_k

    base = rss_mib()
    if spec["corpus"] == "shared":
        passages, queries, gold = shared_workload()
    else:
        passages, queries, gold = synthetic_workload(spec["size"])
    corpus_rss = rss_mib()
    start = time.perf_counter()
    index = BM25Index.build(passages, backend=spec["backend"], show_progress=False)
    build_s = time.perf_counter() - start
    index.search(queries[:5], 5)  # warm-up (page faults, caches)
    results, search_s = timed_search(index, queries, spec["repeats"], spec["query_budget_s"])
    return {
        **spec,
        "passages": len(passages),
        "build_s": round(build_s, 2),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "index_mib": round(max(peak_rss_mib() - corpus_rss, 0.0), 1),
        "corpus_mib": round(corpus_rss - base, 1),
        "queries": len(results),
        "qps": round(len(results) / search_s, 1),
        "recall_at_5": round(recall_at_k(results, gold[: len(results)]), 4),
    }


def timed_search(index, queries: list[str], repeats: int, budget_s: float) -> tuple[list, float]:
    """Best of `repeats` timed passes over the queries (the machine is shared, so the best pass is the least
    disturbed one). bm25s gets the 500 queries as one batch; rank-bm25 one query at a time, stopping a pass at
    the budget, and starting no new pass once the budget is spent."""
    best_results: list = []
    best_s = float("inf")
    spent = 0.0
    for _ in range(repeats):
        results, start = [], time.perf_counter()
        if index.backend == "bm25s":
            results = index.search(queries, 5)
        else:
            for query in queries:
                results += index.search([query], 5)
                if time.perf_counter() - start > budget_s:
                    break
        elapsed = time.perf_counter() - start
        spent += elapsed
        if len(results) / elapsed > len(best_results) / best_s:
            best_results, best_s = results, elapsed
        if spent > budget_s:
            break
    return best_results, best_s


def measure(spec: dict, time_cap_s: float) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=time_cap_s)
    except subprocess.TimeoutExpired:
        return {**spec, "skipped": f"exceeded the {time_cap_s:.0f}s time cap"}
    if done.returncode != 0:
        reason = "out of memory (killed)" if done.returncode in (-9, 137) else done.stderr.strip()[-300:]
        return {**spec, "skipped": reason}
    return json.loads(done.stdout.strip().splitlines()[-1])


def index_mode(args: argparse.Namespace) -> list[dict]:
    corpora = [("shared", 0)] + ([("synthetic", args.synthetic_size)] if args.synthetic_size > 0 else [])
    rows = []
    for corpus, size in corpora:
        for backend in ("bm25s", "rank_bm25"):
            spec = {
                "corpus": corpus,
                "size": size,
                "backend": backend,
                "query_budget_s": args.query_budget_s,
                "repeats": args.repeats,
            }
            print(f"... {corpus} {size or ''} {backend}", file=sys.stderr, flush=True)
            rows.append(measure(spec, args.time_cap_s))
    header = f"{'corpus':<10}{'passages':>10} {'backend':<10}{'build s':>9}{'peak MiB':>10}{'index MiB':>10}"
    print(f"\n{header}{'queries':>9}{'q/s':>10}{'R@5':>8}")
    for row in rows:
        lead = f"{row['corpus']:<10}{row.get('passages', row['size']):>10} {row['backend']:<10}"
        if "skipped" in row:
            print(f"{lead}skipped: {row['skipped']}")
            continue
        print(
            f"{lead}{row['build_s']:>9.1f}{row['peak_rss_mib']:>10.0f}{row['index_mib']:>10.0f}"
            f"{row['queries']:>9}{row['qps']:>10.1f}{row['recall_at_5']:>8.3f}"
        )
    for corpus, _ in corpora:
        fast = next((r for r in rows if r["corpus"] == corpus and r["backend"] == "bm25s" and "qps" in r), None)
        ref = next((r for r in rows if r["corpus"] == corpus and r["backend"] == "rank_bm25" and "qps" in r), None)
        if fast and ref:
            print(f"{corpus}: bm25s / rank_bm25 queries/s = {fast['qps'] / ref['qps']:.0f}x")
    return rows


def server_mode(args: argparse.Namespace) -> dict:
    """Soak: a real dspo-serve subprocess (`--workers` processes, over `--index` or the HotpotQA dev index) under
    `--clients` loopback clients for `--duration-s`; the server's RSS (summed over its processes) is sampled every 5 s
    (start = after one warm-up request of each size)."""
    import httpx

    from dspo.search.bm25 import build_or_load_index, read_manifest

    _, queries, _ = shared_workload()
    if args.queries is not None:  # e.g. the synthetic corpus's own queries for a --scale index (bench/_scale.py)
        queries = [json.loads(line)["query"] for line in args.queries.read_text().splitlines() if line.strip()]
    batch_mix = parse_batch_mix(args.batch_mix)
    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    if args.index is not None and read_manifest(args.index) is None:
        raise SystemExit(f"--index {args.index}: no dspo index there (manifest.json); build one with dspo-index")
    with tempfile.TemporaryDirectory() as tmp:
        index = args.index
        if index is None:
            index = Path(tmp) / "ix"
            build_or_load_index(HOTPOTQA / "corpus.jsonl.gz", index, show_progress=False)
        port = free_port()
        server = start_server(index, port, args.workers, tuple(args.serve_override))
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", server, timeout_s=args.load_timeout_s)
            url = f"http://127.0.0.1:{port}/retrieve"
            for size in batch_mix:
                httpx.post(url, json={"queries": queries[:size], "topk": 5}, timeout=60.0).raise_for_status()
            first, processes = server_rss_mib(server.pid)
            rss = [first]

            async def run() -> dict:
                async def sample() -> None:
                    while True:
                        await asyncio.sleep(5.0)
                        rss.append(server_rss_mib(server.pid)[0])

                sampler = asyncio.create_task(sample())
                try:
                    return await load_clients(url, queries, args.clients, args.duration_s, batch_mix, args.bad_share)
                finally:
                    sampler.cancel()

            row = asyncio.run(run())
            rss.append(server_rss_mib(server.pid)[0])
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            row["server_alive_after"] = health.status_code == 200
            row["health_after"] = health.json()  # one worker's: its index digest, cache statistics, pending
        finally:
            server.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=60)  # the workers' graceful shutdown answers what is in flight
            server.kill()
            server.wait()
    row["workers"], row["server_processes"] = args.workers, processes
    row["index"] = str(args.index) if args.index is not None else "hotpotqa_dev500 (built)"
    half = rss[len(rss) // 2]  # a leak keeps growing in the second half; allocator warm-up levels off in the first
    row["server_rss_mib"] = {
        "start": round(rss[0], 1),
        "middle": round(half, 1),
        "end": round(rss[-1], 1),
        "max": round(max(rss), 1),
        "every_5s": [round(x, 1) for x in rss],
    }
    row["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    print(
        f"\nserver soak: {row['clients']} clients x {row['duration_s']}s, batch mix {batch_mix}, "
        f"{args.workers} worker(s), index {row['index']}"
    )
    print(
        f"  requests/s {row['requests_per_s']}  queries/s {row['queries_per_s']}  p50 {row['p50_ms']} ms  "
        f"p99 {row['p99_ms']} ms  errors {row['errors']} {row['error_kinds']}  503 (busy) {row['rejected_503']}"
    )
    for size, stats in row["by_batch_size"].items():
        latency = f"p50 {stats['p50_ms']} ms  p99 {stats['p99_ms']} ms"
        print(f"  {size:>4} queries/request: {stats['requests']:>7} requests  {latency}")
    print(f"  bad requests answered with their 4xx: {row['bad_requests_answered_4xx']}")
    memory = {k: v for k, v in row["server_rss_mib"].items() if k != "every_5s"}
    print(f"  server RSS MiB: {memory}  (samples every 5 s: {len(rss)}, all in the JSON)")
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["index", "server", "all"], default="index")
    parser.add_argument(
        "--synthetic-size", type=int, default=1_000_000, help="passages in the synthetic corpus (0: skip)"
    )
    parser.add_argument("--time-cap-s", type=float, default=300.0, help="kill one (corpus, backend) run after this")
    parser.add_argument("--query-budget-s", type=float, default=60.0, help="rank-bm25 query time budget per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed search passes; the best is reported")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument(
        "--batch-mix", default="1:0.6,8:0.25,64:0.12,512:0.03", help="SIZE:SHARE of the good requests (max 512)"
    )
    parser.add_argument("--bad-share", type=float, default=0.05, help="share of bad requests (each must get its 4xx)")
    parser.add_argument("--workers", type=int, default=1, help="dspo-serve workers=N (processes on one port)")
    parser.add_argument("--index", type=Path, default=None, help="serve this index directory (default: build one)")
    parser.add_argument(
        "--queries", type=Path, default=None, help="soak queries: JSON Lines with 'query' (default: HotpotQA)"
    )
    parser.add_argument("--serve-override", nargs="*", default=[], help="dspo-serve overrides, e.g. cache_size=0")
    parser.add_argument("--load-timeout-s", type=float, default=600.0, help="wait this long for the server's /health")
    add_output_arguments(parser, "retrieval.json")
    parser.add_argument(
        "--scale", type=int, nargs="+", default=None, help="scale mode: corpus sizes, e.g. 1000000 5000000 21015324"
    )
    parser.add_argument("--scale-backends", nargs="+", default=["tantivy", "bm25s"], help="backends in scale mode")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/bench/scale"), help="scale mode's files")
    parser.add_argument("--keep", action="store_true", help="scale mode: keep corpora and indexes")
    parser.add_argument("--scale-time-cap-s", type=float, default=4 * 3600.0, help="scale mode: per build/query run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "retrieval.json")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    report: dict = {"cpu_count": os.cpu_count()}
    if args.scale:
        from _scale import print_table, scale_mode

        measured = provenance()
        rows = scale_mode(args.scale, args.scale_backends, args.workdir, args.keep, args.scale_time_cap_s)
        report = {"scale": rows, "scale_measured": measured, "cpu_count": os.cpu_count()}
        print_table(rows)
    elif args.mode in ("index", "all"):
        measured = provenance()
        report["index"] = index_mode(args)
        report["index_measured"] = measured
    if args.mode in ("server", "all") and not args.scale:
        measured = provenance()
        report["server"] = {"measured": measured, **server_mode(args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    args.out.write_text(json.dumps({**previous, **report}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    check(report)


def check(report: dict) -> None:
    """Exit non-zero when a (corpus, backend) run was skipped or answered nothing, or the soak measured nothing."""
    rows, server = report.get("index", []), report.get("server", {})
    figures = {f"{r['corpus']} {r['backend']}.{k}": r.get(k) or None for r in rows for k in ("queries", "qps")}
    for r in report.get("scale", []):
        figures[f"scale {r['passages']} {r['backend']}.qps_single"] = r.get("qps_single") or None
    errors_scale = {f"scale {r['passages']} {r['backend']}": r.get("skipped") for r in report.get("scale", [])}
    figures.update(
        {f"server.{k}": server[k] if server[k] > 0 else None for k in ("requests", "p50_ms")} if server else {}
    )
    errors = {f"{r['corpus']} {r['backend']} (skipped)": r.get("skipped") for r in rows} | errors_scale
    require_measured(
        "retrieval",
        {**figures, **({"server.alive_after": server["server_alive_after"] or None} if server else {})},
        errors,
    )


if __name__ == "__main__":
    main()
