"""Hydra entry points `dspo-index` (build + save a BM25 index) and `dspo-serve` (run the retrieval service).

Configs: conf/index.yaml and conf/serve.yaml beside the package (the package is installed editable). Both CLIs
keep the working directory and write no Hydra output folders.
"""

from __future__ import annotations

import time
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def run_index(cfg: DictConfig) -> Path:
    """Build the index described by an index config and save it; returns the output directory."""
    from dspo.search.bm25 import build_index_streamed, check_replaceable, corpus_fingerprint, read_manifest
    from dspo.search.corpus import iter_corpus, load_corpus

    output = Path(cfg.output)
    check_replaceable(output, bool(cfg.overwrite))  # fail before the (possibly long) build, not after
    if not Path(cfg.corpus).is_file():
        raise FileNotFoundError(f"corpus file not found: {cfg.corpus} (set corpus= to a JSON Lines file)")
    start = time.perf_counter()
    # bm25s and tantivy stream the corpus (bounded memory at any size); rank_bm25 holds it (the small-scale reference)
    passages = load_corpus(cfg.corpus) if cfg.backend == "rank_bm25" else iter_corpus(cfg.corpus)
    build_index_streamed(
        passages,
        output,
        backend=cfg.backend,
        k1=float(cfg.k1),
        b=float(cfg.b),
        overwrite=bool(cfg.overwrite),
        show_progress=bool(cfg.show_progress),
        corpus_info=corpus_fingerprint(cfg.corpus),
        workers=cfg.get("workers"),
    )
    manifest = read_manifest(output)
    size_mb = sum(f.stat().st_size for f in output.rglob("*") if f.is_file()) / 2**20
    print(
        f"[dspo-index] {cfg.backend} index (k1={cfg.k1}, b={cfg.b}) of {manifest['num_passages']:,} passages from "
        f"{cfg.corpus}, digest {manifest['digest']}, saved to {output.resolve()} ({size_mb:.1f} MiB) in "
        f"{time.perf_counter() - start:.1f}s"
    )
    return output


def run_serve(cfg: DictConfig) -> None:
    """Load (or build) the index of a serve config and serve it until interrupted."""
    from dspo.search.bm25 import load_retriever
    from dspo.search.server import serve
    from dspo.search.workers import check_workers

    workers = check_workers(cfg.workers)  # the config's mistakes fail before the (possibly minutes long) load
    limits = instantiate(cfg.limits)
    start = time.perf_counter()
    retriever = load_retriever(
        str(cfg.index), corpus=cfg.corpus, backend=cfg.backend, mmap=bool(cfg.mmap), cache_size=int(cfg.cache_size)
    )
    print(
        f"[dspo-serve] loaded {retriever.backend} index {cfg.index} ({len(retriever):,} passages) in "
        f"{time.perf_counter() - start:.1f}s; serving POST http://{cfg.host}:{cfg.port}/retrieve and GET /health "
        f"from {workers} worker process{'es' if workers > 1 else ''}",
        flush=True,
    )
    serve(
        retriever,
        workers=workers,
        host=str(cfg.host),
        port=int(cfg.port),
        limits=limits,
        log_level=str(cfg.log_level),
        keep_alive_s=int(cfg.keep_alive_s),
    )


@hydra.main(config_path=CONF_DIR, config_name="index", version_base="1.3")
def index_main(cfg: DictConfig) -> None:
    """`dspo-index corpus=PATH output=DIR [backend=bm25s|tantivy|rank_bm25]`."""
    from dspo.process.errors import user_errors

    with user_errors("dspo-index", "dspo-index corpus=data/hotpotqa_dev500/corpus.jsonl.gz output=outputs/index"):
        run_index(cfg)


@hydra.main(config_path=CONF_DIR, config_name="serve", version_base="1.3")
def serve_main(cfg: DictConfig) -> None:
    """`dspo-serve index=DIR [host=127.0.0.1] [port=8000] [workers=1]`."""
    from dspo.process.errors import user_errors

    with user_errors("dspo-serve", "dspo-serve index=outputs/index port=8000   (an index written by dspo-index)"):
        run_serve(cfg)
