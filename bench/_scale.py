"""`bench/retrieval.py --scale N [N ...]`: build and query indexes of wiki-18's shape at 1M, 5M and 21M passages.

For each size: the synthetic corpus (bench/_synthetic_wiki.py) is written to `--workdir`, then for each backend
`dspo-index` runs as a user runs it (a subprocess; peak resident memory sampled every 0.2 s over it and its
tokenizer workers: the main process's RSS, the whole tree's RSS (double-counting shared pages), and the tree's
anonymous memory, which excludes the mapped files' pages the kernel can drop), the index's disk
size is summed, and a fresh child process pinned to ONE core loads the index (memory-mapped) and answers the 1,000
queries: single queries (latency p50/p99 after one warm-up pass, so the page cache holds what they touch; the
first, cold pass is reported too) and batches of 64 (queries/s). The corpus and each index are deleted after use
unless `--keep`; disk needed at 21M: ~15 GB corpus + ~15 GB passages + the index (+ ~10 GB bm25s spill files).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
BATCH = 64


def anon_bytes(pid: int) -> int:
    """Resident anonymous memory of a process (RssAnon): what it cannot give back, unlike the pages of the files
    it maps, which RSS also counts (tantivy maps the segments it merges)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(pid: int) -> tuple[int, int, int]:
    """(RSS of process `pid`, RSS of it plus its descendants, RssAnon of it plus its descendants), in bytes."""
    import psutil

    try:
        proc = psutil.Process(pid)
        family = [proc, *proc.children(recursive=True)]
        main = proc.memory_info().rss
        return main, sum(p.memory_info().rss for p in family), sum(anon_bytes(p.pid) for p in family)
    except psutil.Error:
        return 0, 0, 0


def run_index(corpus: Path, output: Path, backend: str, timeout_s: float) -> dict:
    code = "from dspo.search.cli import index_main; index_main()"
    cmd = [
        sys.executable,
        "-c",
        code,
        f"corpus={corpus}",
        f"output={output}",
        f"backend={backend}",
        "show_progress=false",
    ]
    start, peak_main, peak_tree, peak_anon = time.perf_counter(), 0, 0, 0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None:
        main, tree, anon = tree_rss(proc.pid)
        peak_main, peak_tree, peak_anon = max(peak_main, main), max(peak_tree, tree), max(peak_anon, anon)
        if time.perf_counter() - start > timeout_s:
            proc.kill()
            return {"skipped": f"build exceeded --time-cap-s={timeout_s}"}
        time.sleep(0.2)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        return {"skipped": f"dspo-index exited {proc.returncode}: {out[-2000:]}"}
    disk = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    return {
        "build_s": round(time.perf_counter() - start, 1),
        "build_peak_rss_gib": round(peak_main / 2**30, 2),
        "build_peak_rss_tree_gib": round(peak_tree / 2**30, 2),
        "build_peak_anon_tree_gib": round(peak_anon / 2**30, 2),
        "disk_gib": round(disk / 2**30, 2),
        "index_only_gib": round((disk - (output / "passages.jsonl").stat().st_size) / 2**30, 2),
    }


def query_child(index: str, queries_path: str) -> dict:
    """Runs in a fresh process pinned to one core."""
    import numpy as np

    from dspo.search.bm25 import BM25Index

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    start = time.perf_counter()
    ix = BM25Index.load(index, mmap=True)
    load_s = time.perf_counter() - start
    rows = [json.loads(line) for line in Path(queries_path).read_text().splitlines()]
    queries = [row["query"] for row in rows]

    def single_pass() -> tuple[list[float], list]:
        lat, results = [], []
        for query in queries:
            t = time.perf_counter()
            results.append(ix.search([query], 3)[0])
            lat.append(time.perf_counter() - t)
        return lat, results

    cold, _ = single_pass()
    warm, results = single_pass()
    t = time.perf_counter()
    for i in range(0, len(queries), BATCH):
        ix.search(queries[i : i + BATCH], 3)
    batch_s = time.perf_counter() - t
    import psutil

    ms = np.array(warm) * 1000
    return {
        "load_s": round(load_s, 2),
        "query_rss_gib": round(psutil.Process().memory_info().rss / 2**30, 2),
        "queries": len(queries),
        "qps_single": round(len(queries) / sum(warm), 1),
        "qps_batch64": round(len(queries) / batch_s, 1),
        "qps_single_cold": round(len(queries) / sum(cold), 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "top3_source": round(float(np.mean([r["id"] in [p.id for p in hits] for r, hits in zip(rows, results)])), 3),
    }


def run_queries(index: Path, queries: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--query-child", str(index), str(queries)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        return {"skipped": f"query child exited {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def scale_mode(sizes: list[int], backends: list[str], workdir: Path, keep: bool, time_cap_s: float) -> list[dict]:
    sys.path.insert(0, str(BENCH))
    from _synthetic_wiki import save_queries, write_corpus

    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in sizes:
        corpus, queries = workdir / f"wiki_shaped_{size}.jsonl", workdir / f"wiki_shaped_{size}.queries.jsonl"
        start = time.perf_counter()
        save_queries(queries, write_corpus(corpus, size))
        generate_s = round(time.perf_counter() - start, 1)
        corpus_gib = round(corpus.stat().st_size / 2**30, 2)
        print(f"[scale] {size:,} passages generated in {generate_s}s ({corpus_gib} GiB)", flush=True)
        for backend in backends:
            output = workdir / f"index_{backend}_{size}"
            shutil.rmtree(output, ignore_errors=True)
            row = {"passages": size, "backend": backend, "corpus_gib": corpus_gib, "generate_s": generate_s}
            row.update(run_index(corpus, output, backend, time_cap_s))
            if "skipped" not in row:
                row.update(run_queries(output, queries, time_cap_s))
            print(f"[scale] {json.dumps(row)}", flush=True)
            rows.append(row)
            if not keep:
                shutil.rmtree(output, ignore_errors=True)
        if not keep:
            corpus.unlink()
    return rows


def print_table(rows: list[dict]) -> None:
    head = "| passages | backend | build | peak RSS (anon) | disk (index only) | q/s 1 core | batch q/s | p50 | p99 |"
    print(head + "\n|" + "---|" * 9)
    for r in rows:
        if "skipped" in r:
            print(f"| {r['passages']:,} | {r['backend']} | skipped: {r['skipped'][:80]} |")
            continue
        print(
            f"| {r['passages']:,} | {r['backend']} | {r['build_s']} s | {r['build_peak_rss_gib']} GiB "
            f"({r.get('build_peak_anon_tree_gib')}) | {r['disk_gib']} GiB ({r['index_only_gib']}) | "
            f"{r['qps_single']} | {r['qps_batch64']} | {r['p50_ms']} ms | {r['p99_ms']} ms |"
        )


if __name__ == "__main__" and sys.argv[1:2] == ["--query-child"]:
    print(json.dumps(query_child(sys.argv[2], sys.argv[3])))
