"""Does dspo's BM25 rank like Lucene's? Top-3 agreement with Lucene's BM25Similarity at the same k1, b and analyzer.

    python bench/lucene_agreement.py                  # HotpotQA dev (500 questions) + the toy world, two settings
    python bench/lucene_agreement.py --smoke          # 50 questions per corpus (the test suite's mode)
    python bench/lucene_agreement.py --jar anserini-0.22.1-fatjar.jar   # a Lucene / Anserini jar you already have

What runs. Lucene 9.5 itself, from the Anserini fat jar that pyserini 0.22.1 ships (the last pyserini that runs on
Java 17; newer ones need Java 21): `--jar PATH`, or else `pip download pyserini==0.22.1 --no-deps` into the cache
(`--cache-dir`, default `$DSPO_CACHE/lucene` or `~/.cache/dspo/lucene`), the jar extracted from the wheel and the
140 MB wheel deleted. bench/lucene/LuceneBm25.java is compiled there with `javac` (once per source version) and run
with `java`: it indexes every passage PRE-TOKENIZED (dspo's `Tokenizer` output joined by spaces, read by Lucene's
WhitespaceAnalyzer: the analyzer is exactly dspo's: lower-case `\\w+` tokens minus Lucene's 33 English stop words, no
stemming; a passage is its title + text, as `BM25Index.build` indexes it) and searches each question as a BooleanQuery
of SHOULD TermQuerys, one per query token, a repeated token once per repetition (dspo counts a repeated query word
again, as rank-bm25 does), with `BM25Similarity(k1, b)`. Ties go to the earlier passage on both sides. dspo side:
every backend of `dspo.search.bm25.BACKENDS` (at least bm25s and rank_bm25; one that fails is reported with its error,
and bm25s or rank_bm25 failing fails the run), through the public `BM25Index.build(...).search(questions, 3)`.

Without a JDK (`javac` and `java` on PATH or in $JAVA_HOME/bin) the script exits with code 2 and says so.

Corpora: data/hotpotqa_dev500 (4,943 passages, 500 questions, gold = `metadata.supporting_titles`) and the toy world
of the default config (`dspo.toy.world.generate_world(ToyWorldConfig())`, generated in memory: 1,356 passages; its
val + test questions, gold = the titles of the chain's entities). The FlashRAG benchmark question files in
data/benchmarks/ ship without a corpus (theirs is the 21M-passage wiki-18 dump), so they have nothing to search here.

Settings: k1=1.2, b=0.75 (Lucene's `BM25Similarity()` default, dspo's default) and k1=0.9, b=0.4, pyserini's default,
which is what Search-R1's BM25 server gets: its `search_r1/search/retrieval_server.py` `BM25Retriever` builds
`LuceneSearcher(self.index_path)` and never calls `set_bm25`. In the pyserini 0.22.1 wheel,
`pyserini/search/lucene/_searcher.py` line 51 (`LuceneSearcher.__init__`) creates `JLuceneSearcher(index_dir)` =
Anserini's `io.anserini.search.SimpleSearcher` (line 36), whose constructor sets
`new BM25Similarity(Float.parseFloat(args.bm25_k1[0]), Float.parseFloat(args.bm25_b[0]))` from
`SearchCollection.Args` defaults "0.9" and "0.4" (read with `javap -c` from the wheel's jar); the Python side states
the same defaults at line 345, `def set_bm25(self, k1=float(0.9), b=float(0.4))`, and line 437,
`LuceneSimilarities.bm25(k1=0.9, b=0.4)`. (That server also analyzes with Anserini's DefaultEnglishAnalyzer, Porter
stemming: a different analyzer from dspo's, on purpose not compared here.)

Reported per (corpus, backend, setting): top-3 overlap (mean |dspo top-3 ∩ Lucene top-3| / 3), the share of
questions with the identical top-3 list (same passages, same order), recall@3 of the gold titles for dspo and Lucene
side by side. Why they differ, measured rather than guessed: Lucene's BM25Similarity stores a document's length in
one byte (`SmallFloat.intToByte4`: exact below 24 tokens, then 4 significant bits, rounded down: 68 and 71 tokens
both read as 68), while dspo uses exact lengths. So Lucene is run a second time with Anserini's
AccurateBM25Similarity (the same BM25 formula, the exact length stored as the norm), and a numpy port of Lucene's
BM25 arithmetic (float32 idf and tf parts, as `BM25Similarity.BM25Scorer`) is run with both kinds of length, as a
check that the arithmetic is understood (its one-byte scores match Lucene's to float32 rounding). Each question whose
dspo top-3 differs from Lucene's is classified: `length` when Lucene with exact lengths ranks exactly like dspo (the
two Lucene runs differ in nothing else), `tie` when two of the passages concerned have the same float32 score,
`other` else. Written to `outputs/bench/lucene_agreement.json` (or
`--out`); `--update-shipped` writes the tracked `bench/results/lucene_agreement.json` that bench/README.md quotes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance

REPO = Path(__file__).resolve().parents[1]
HOTPOTQA = REPO / "data" / "hotpotqa_dev500"
JAVA_SOURCE = Path(__file__).resolve().parent / "lucene" / "LuceneBm25.java"
PYSERINI_VERSION = "0.22.1"  # Anserini 0.22.1 / Lucene 9.5.0; runs on Java 11+ (later pyserini needs Java 21)
SETTINGS = ((1.2, 0.75), (0.9, 0.4))  # Lucene's BM25Similarity() default; pyserini's LuceneSearcher default
SETTING_NAMES = {(1.2, 0.75): "Lucene default", (0.9, 0.4): "pyserini default"}
REQUIRED_BACKENDS = ("bm25s", "rank_bm25")
TOP_K = 3
NO_JDK_EXIT = 2


def say(message: str) -> None:
    print(f"[lucene_agreement] {message}", flush=True)


# ---------------------------------------------------------------------------------------------- Lucene, the jar, javac


def find_jdk() -> tuple[str, str] | None:
    """(javac, java) from $JAVA_HOME/bin or PATH, or None when either is missing."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "javac").is_file() and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "javac"), str(Path(home) / "bin" / "java")
    javac, java = shutil.which("javac"), shutil.which("java")
    return (javac, java) if javac and java else None


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSPO_CACHE") or Path.home() / ".cache" / "dspo") / "lucene"


def check_jar(jar: Path) -> None:
    with zipfile.ZipFile(jar) as archive:
        names = set(archive.namelist())
    needed = "org/apache/lucene/search/similarities/BM25Similarity.class"
    if needed not in names:
        raise SystemExit(f"{jar} holds no {needed}: not a Lucene / Anserini fat jar")


def obtain_jar(jar: Path | None, cache: Path) -> Path:
    """The Anserini fat jar: `jar` if given, else the cached one, else pip-downloaded and extracted from pyserini's
    wheel (the wheel is deleted after; only the jar is kept)."""
    if jar is not None:
        if not jar.is_file():
            raise SystemExit(f"--jar {jar}: no such file")
        say(f"using the jar given: {jar}")
        check_jar(jar)
        return jar
    target = cache / f"anserini-{PYSERINI_VERSION}-fatjar.jar"
    if target.is_file():
        say(f"using the cached jar {target}")
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".wheel-") as tmp:
        command = [sys.executable, "-m", "pip", "download", f"pyserini=={PYSERINI_VERSION}", "--no-deps"]
        command += ["--only-binary=:all:", "--disable-pip-version-check", "-d", tmp]
        say(f"downloading the pyserini {PYSERINI_VERSION} wheel (~140 MB; it carries Anserini + Lucene 9.5): "
            + " ".join(command))  # fmt: skip
        tic = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("pyserini-*.whl"))
        if done.returncode != 0 or not wheels:
            raise SystemExit(
                f"pip download pyserini=={PYSERINI_VERSION} failed (exit {done.returncode}):\n{done.stderr[-2000:]}\n"
                "Pass --jar PATH to an Anserini fat jar (pyserini/resources/jars/ inside that wheel) instead."
            )
        say(f"downloaded {wheels[0].name} ({wheels[0].stat().st_size / 2**20:.0f} MiB) in "
            f"{time.perf_counter() - tic:.1f} s")  # fmt: skip
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.startswith("pyserini/resources/jars/") and n.endswith(".jar")]
            if len(members) != 1:
                raise SystemExit(f"{wheels[0].name}: expected one jar under pyserini/resources/jars/, found {members}")
            say(f"extracting {members[0]} -> {target}")
            partial = target.with_suffix(f".part-{os.getpid()}")
            with wheel.open(members[0]) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        check_jar(partial)
        os.replace(partial, target)
    say(f"cached the jar at {target} (the wheel was deleted)")
    return target


def compile_java(javac: str, jar: Path, cache: Path) -> Path:
    """Compile bench/lucene/LuceneBm25.java against `jar` into the cache (once per source and jar); the class dir."""
    key = hashlib.sha256(JAVA_SOURCE.read_bytes() + str(jar.resolve()).encode()).hexdigest()[:12]
    classes = cache / f"classes-{key}"
    if (classes / "LuceneBm25.class").is_file():
        say(f"using the compiled {classes / 'LuceneBm25.class'}")
        return classes
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".classes-"))
    command = [javac, "-nowarn", "-cp", str(jar), "-d", str(tmp), str(JAVA_SOURCE)]
    say("compiling: " + " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"javac failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    shutil.rmtree(classes, ignore_errors=True)
    os.replace(tmp, classes)
    return classes


def run_lucene(
    java: str, jar: Path, classes: Path, docs: list[list[str]], queries: list[list[str]], workdir: Path
) -> tuple[dict[tuple[str, tuple[float, float]], list[list[tuple[int, float]]]], dict, float]:
    """Top-3 (passage row, score) per query for each (variant, setting): variant "lucene" (BM25Similarity, one-byte
    lengths) and, with Anserini's jar, "exact" (AccurateBM25Similarity, exact lengths); the index statistics; the
    seconds it took."""
    for name, rows in (("docs.txt", docs), ("queries.txt", queries)):
        with (workdir / name).open("w", encoding="utf-8", newline="\n") as handle:
            handle.writelines(" ".join(tokens) + "\n" for tokens in rows)
    command = [java, "-cp", os.pathsep.join([str(jar), str(classes)]), "LuceneBm25"]
    command += [str(workdir / n) for n in ("docs.txt", "queries.txt", "hits.tsv", "stats.json")]
    command += [str(TOP_K)] + [f"{k1},{b}" for k1, b in SETTINGS]
    tic = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - tic
    if done.returncode != 0:
        raise RuntimeError(f"LuceneBm25 failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    hits: dict[tuple[str, tuple[float, float]], list[list[tuple[int, float]]]] = {}
    for line in (workdir / "hits.tsv").read_text(encoding="utf-8").splitlines():
        variant, setting, query, pairs = line.split("\t")
        fields = pairs.split()
        ranked = [(int(fields[i]), float(fields[i + 1])) for i in range(0, len(fields), 2)]
        hits.setdefault((variant, SETTINGS[int(setting)]), [[] for _ in queries])[int(query)] = ranked
    return hits, json.loads((workdir / "stats.json").read_text()), seconds


# ------------------------------------------------------------------------------------------------------------ corpora


@dataclass
class Workload:
    name: str
    passages: list  # dspo.types.Passage
    questions: list[str]
    gold: list[list[str]]  # gold titles per question


def hotpotqa(limit: int | None) -> Workload:
    from dspo.search.corpus import load_corpus

    rows = [json.loads(line) for line in (HOTPOTQA / "questions.jsonl").read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    return Workload(
        "hotpotqa_dev500",
        load_corpus(HOTPOTQA / "corpus.jsonl.gz"),
        [row["question"] for row in rows],
        [row["metadata"]["supporting_titles"] for row in rows],
    )


def toy_world(limit: int | None) -> Workload:
    from dspo.search.corpus import parse_passage
    from dspo.toy.world import ToyWorldConfig, generate_world

    _, corpus, qa, _, _ = generate_world(ToyWorldConfig())  # conf/prepare/toyworld.yaml's world (seed 0)
    rows = qa["val"] + qa["test"]
    rows = rows[:limit] if limit else rows
    return Workload(
        "toy_world",
        [parse_passage(r) for r in corpus],
        [r["question"] for r in rows],
        [r["metadata"]["chain"] for r in rows],
    )


# ------------------------------------------------------------------------------------ a numpy port of Lucene's BM25


def _long_to_int4(i: int) -> int:
    bits = i.bit_length()
    if bits < 4:
        return i
    shift = bits - 4
    return ((i >> shift) & 0x07) | ((shift + 1) << 3)


def _int4_to_long(i: int) -> int:
    bits, shift = i & 0x07, (i >> 3) - 1
    return bits if shift == -1 else (bits | 0x08) << shift


_NUM_FREE_VALUES = 255 - _long_to_int4(2**31 - 1)  # 24: lengths below this are stored exactly


def lucene_length(length: int) -> int:
    """The document length Lucene's BM25 sees: `SmallFloat.byte4ToInt(SmallFloat.intToByte4(length))`."""
    if length < _NUM_FREE_VALUES:
        return length
    code = _NUM_FREE_VALUES + _long_to_int4(length - _NUM_FREE_VALUES)
    return _NUM_FREE_VALUES + _int4_to_long(code - _NUM_FREE_VALUES)


class LucenePort:
    """Lucene 9's BM25Scorer arithmetic in numpy (float32 idf, norm cache and term scores; the sum in float64 cast
    to float32, as Lucene's disjunction scorers do), with exact or one-byte-encoded document lengths."""

    def __init__(self, docs: list[list[str]]) -> None:
        import numpy as np

        postings: dict[str, tuple[list[int], list[int]]] = {}
        for row, tokens in enumerate(docs):
            for term, tf in Counter(tokens).items():
                entry = postings.setdefault(term, ([], []))
                entry[0].append(row)
                entry[1].append(tf)
        self.postings = {
            t: (np.array(d, dtype=np.int64), np.array(f, dtype=np.float32)) for t, (d, f) in postings.items()
        }
        self.lengths = np.array([len(t) for t in docs], dtype=np.int64)
        self.doc_count = int((self.lengths > 0).sum())  # Lucene's N: documents that have the field
        self.encoded = np.array([lucene_length(int(n)) for n in self.lengths], dtype=np.float32)

    def scores(self, queries: list[list[str]], k1: float, b: float, one_byte: bool) -> list:
        """One float32 score row per query."""
        import numpy as np

        f32 = np.float32
        lengths = self.encoded if one_byte else self.lengths.astype(np.float32)
        avgdl = f32(float(self.lengths.sum()) / self.doc_count)
        norm_inverse = f32(1) / (f32(k1) * ((f32(1) - f32(b)) + f32(b) * lengths / avgdl))  # [N] float32
        rows = []
        for tokens in queries:
            total = np.zeros(len(self.lengths), dtype=np.float64)
            for term, count in Counter(tokens).items():  # a repeated term: one clause boosted by its count
                if term not in self.postings:
                    continue
                docs, tf = self.postings[term]
                idf = f32(math.log(1 + (self.doc_count - len(docs) + 0.5) / (len(docs) + 0.5)))
                weight = f32(count) * idf
                total[docs] += weight - weight / (f32(1) + tf * norm_inverse[docs])
            rows.append(total.astype(np.float32))
        return rows


def top_rows(scores, k: int = TOP_K) -> list[int]:
    """Indices of the k best positive scores, best first, ties to the lower index (as both dspo and Lucene)."""
    import numpy as np

    cand = np.flatnonzero(scores > 0)
    order = cand[np.lexsort((cand, -scores[cand]))]
    return [int(i) for i in order[:k]]


# --------------------------------------------------------------------------------------------------------- comparing


def overlap(a: list[int], b: list[int]) -> float:
    """|a ∩ b| / max(|a|, |b|): |a ∩ b| / 3 whenever either side has 3 hits (1.0 when both found nothing)."""
    size = max(len(a), len(b))
    return len(set(a) & set(b)) / size if size else 1.0


def recall(hits: list[list[int]], titles: list[str], gold: list[list[str]]) -> float:
    fractions = [len(set(g) & {titles[i] for i in h}) / len(set(g)) for h, g in zip(hits, gold, strict=True) if g]
    return sum(fractions) / len(fractions) if fractions else math.nan


def classify(dspo: list[int], lucene: list[int], exact: list[int], one_byte_scores) -> str:
    """Why dspo's top-3 differs from Lucene's: `length` when Lucene with exact lengths ranks like dspo (its two runs
    differ in nothing else), `tie` when Lucene's scores (the port's) of the passages concerned repeat, `other`."""
    if exact == dspo:
        return "length"
    values = [float(one_byte_scores[i]) for i in set(dspo) | set(lucene)]
    return "tie" if len(values) != len(set(values)) else "other"


def dspo_hits(backend: str, passages: list, questions: list[str], k1: float, b: float) -> list[list[int]]:
    from dspo.search.bm25 import BM25Index

    row_of = {p.id: i for i, p in enumerate(passages)}
    index = BM25Index.build(passages, backend=backend, k1=k1, b=b, show_progress=False)
    # dspo fills a top-k with zero-score passages when fewer match; Lucene returns only matches: compare matches
    return [[row_of[p.id] for p in hits if p.score > 0] for hits in index.search(questions, TOP_K)]


def measure(work: Workload, java: str, jar: Path, classes: Path, workdir: Path, backends: tuple[str, ...]) -> dict:
    from dspo.search.bm25 import Tokenizer

    tokenizer = Tokenizer()
    docs = [tokenizer(f"{p.title} {p.text}") for p in work.passages]  # what BM25Index.build indexes
    queries = [tokenizer(q) for q in work.questions]
    say(f"{work.name}: {len(docs):,} passages, {len(queries)} questions; running Lucene")
    lucene, stats, lucene_s = run_lucene(java, jar, classes, docs, queries, workdir)
    say(f"{work.name}: Lucene {stats['lucene_version']} indexed and searched both settings in {lucene_s:.1f} s")
    expected = {"doc_count": sum(1 for d in docs if d), "sum_total_term_freq": sum(map(len, docs))}
    analyzer_ok = all(stats[key] == value for key, value in expected.items())
    if not analyzer_ok:
        say(f"WARNING {work.name}: Lucene's index statistics {stats} differ from dspo's tokens {expected}")
    port = LucenePort(docs)
    titles = [p.title for p in work.passages]
    lengths = port.lengths
    corpus = {
        "passages": len(docs),
        "questions": len(queries),
        "queries_with_repeated_tokens": sum(1 for q in queries if len(q) != len(set(q))),
        "empty_passages": len(docs) - expected["doc_count"],
        "mean_tokens": float(lengths.mean()),
        "share_lengths_stored_exactly": float((lengths < _NUM_FREE_VALUES).mean()),
        "lucene_index": stats,
        "lucene_seconds": lucene_s,
        "analyzer_statistics_match": analyzer_ok,
        "diagnosis": [],
    }
    rows, errors = [], {}
    for k1, b in SETTINGS:
        luc = [[doc for doc, _ in hits] for hits in lucene[("lucene", (k1, b))]]
        one_byte_scores = port.scores(queries, k1, b, one_byte=True)
        one_byte = [top_rows(s) for s in one_byte_scores]
        port_exact = [top_rows(s) for s in port.scores(queries, k1, b, one_byte=False)]
        has_exact = ("exact", (k1, b)) in lucene
        exact = [[doc for doc, _ in hits] for hits in lucene[("exact", (k1, b))]] if has_exact else port_exact
        relative_errors = [
            abs(float(one_byte_scores[q][doc]) - score) / score
            for q, hits in enumerate(lucene[("lucene", (k1, b))])
            for doc, score in hits
        ]
        n = len(queries)
        corpus["diagnosis"].append(
            {
                "k1": k1,
                "b": b,
                "lucene_exact_lengths_variant": "AccurateBM25Similarity" if has_exact else "numpy port (no Anserini)",
                "lucene_exact_vs_lucene_identical_top3": sum(e == lu for e, lu in zip(exact, luc)) / n,
                "port_one_byte_vs_lucene_identical_top3": sum(o == lu for o, lu in zip(one_byte, luc)) / n,
                "port_one_byte_vs_lucene_max_rel_score_error": max(relative_errors, default=0.0),
                "port_exact_vs_lucene_exact_identical_top3": sum(p == e for p, e in zip(port_exact, exact)) / n,
            }
        )
        for backend in backends:
            if backend == "tantivy" and (k1, b) != (1.2, 0.75):
                say(f"{work.name}: backend tantivy skipped at k1={k1} b={b} (tantivy fixes k1=1.2, b=0.75)")
                continue
            try:
                tic = time.perf_counter()
                mine = dspo_hits(backend, work.passages, work.questions, k1, b)
                seconds = time.perf_counter() - tic
            except Exception:  # noqa: BLE001  a backend that fails is reported, not fatal to the others
                errors[f"{work.name} {backend} k1={k1} b={b}"] = traceback.format_exc()
                say(f"{work.name}: backend {backend} FAILED at k1={k1} b={b}:\n{traceback.format_exc()}")
                continue
            different = [q for q in range(n) if mine[q] != luc[q]]
            reasons = Counter(classify(mine[q], luc[q], exact[q], one_byte_scores[q]) for q in different)
            rows.append(
                {
                    "corpus": work.name,
                    "backend": backend,
                    "k1": k1,
                    "b": b,
                    "questions": n,
                    "top3_overlap": sum(map(overlap, mine, luc)) / n,
                    "top3_identical": 1 - len(different) / n,
                    "top3_same_set": sum(set(m) == set(lu) for m, lu in zip(mine, luc)) / n,
                    "recall3_dspo": recall(mine, titles, work.gold),
                    "recall3_lucene": recall(luc, titles, work.gold),
                    "recall3_lucene_exact_lengths": recall(exact, titles, work.gold),
                    "top3_overlap_vs_lucene_exact_lengths": sum(map(overlap, mine, exact)) / n,
                    "top3_identical_vs_lucene_exact_lengths": sum(m == e for m, e in zip(mine, exact)) / n,
                    "differing": len(different),
                    "differing_by_reason": {r: reasons.get(r, 0) for r in ("length", "tie", "other")},
                    "dspo_seconds": seconds,
                }
            )
    return {"corpus": corpus, "rows": rows, "errors": errors}


# ---------------------------------------------------------------------------------------------------------- the script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jar", type=Path, default=None, help="an Anserini / Lucene fat jar (default: pip-download)")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help=f"jar and classes (default: {default_cache_dir()})"
    )
    parser.add_argument("--smoke", action="store_true", help="50 questions per corpus (the test suite's mode)")
    parser.add_argument("--questions", type=int, default=None, help="first N questions per corpus (default: all)")
    add_output_arguments(parser, "lucene_agreement.json")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "lucene_agreement.json")
    if args.smoke and args.questions is None:
        args.questions = 50
    if args.smoke and args.update_shipped:
        parser.error("--smoke measures too little to be the shipped result")
    return args


def print_table(rows: list[dict]) -> None:
    print("\n| corpus | k1, b | backend | questions | top-3 overlap | identical top-3 | R@3 dspo | R@3 Lucene "
          "| differing: length / tie / other | identical top-3, Lucene with exact lengths |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        why = r["differing_by_reason"]
        print(
            f"| {r['corpus']} | {r['k1']}, {r['b']} ({SETTING_NAMES[(r['k1'], r['b'])]}) | {r['backend']} "
            f"| {r['questions']} | {r['top3_overlap']:.3f} | {r['top3_identical']:.3f} | {r['recall3_dspo']:.3f} "
            f"| {r['recall3_lucene']:.3f} | {r['differing']}: {why['length']} / {why['tie']} / {why['other']} "
            f"| {r['top3_identical_vs_lucene_exact_lengths']:.3f} |"
        )


def main() -> None:
    args = parse_args()
    jdk = find_jdk()
    if jdk is None:
        print(
            "bench/lucene_agreement.py: no JDK found: it needs `javac` and `java` (JDK 11 or later, e.g. Debian's "
            "openjdk-17-jdk-headless) on PATH or in $JAVA_HOME/bin, to compile and run bench/lucene/LuceneBm25.java "
            "against Lucene. Nothing was measured.",
            file=sys.stderr,
        )
        sys.exit(NO_JDK_EXIT)
    javac, java = jdk
    say(f"JDK: {javac}, {java}")
    measured = provenance()
    cache = (args.cache_dir or default_cache_dir()).expanduser()
    jar = obtain_jar(args.jar, cache)
    classes = compile_java(javac, jar, cache)

    from dspo.search import bm25

    backends = tuple(dict.fromkeys([*REQUIRED_BACKENDS, *bm25.BACKENDS]))
    say(f"dspo backends: {', '.join(backends)}")
    report: dict = {
        "measured": measured,
        "lucene": {"jar": str(jar), "pyserini": PYSERINI_VERSION if args.jar is None else None},
        "settings": [{"k1": k1, "b": b, "name": SETTING_NAMES[(k1, b)]} for k1, b in SETTINGS],
        "top_k": TOP_K,
        "smoke": args.smoke,
        "corpora": {},
        "rows": [],
        "backend_errors": {},
    }
    with tempfile.TemporaryDirectory(prefix="lucene_agreement-") as tmp:
        for load in (hotpotqa, toy_world):
            work = load(args.questions)
            workdir = Path(tmp) / work.name
            workdir.mkdir()
            result = measure(work, java, jar, classes, workdir, backends)
            report["corpora"][work.name] = result["corpus"]
            report["rows"] += result["rows"]
            report["backend_errors"].update(result["errors"])
    report["lucene"]["version"] = next(iter(report["corpora"].values()))["lucene_index"]["lucene_version"]
    print_table(report["rows"])
    for name, corpus in report["corpora"].items():
        print(
            f"\n{name}: {corpus['passages']:,} passages, mean {corpus['mean_tokens']:.1f} tokens, "
            f"{corpus['share_lengths_stored_exactly']:.3f} of them under 24 tokens (lengths Lucene stores exactly); "
            f"{corpus['queries_with_repeated_tokens']} of {corpus['questions']} questions repeat a token"
        )
        for d in corpus["diagnosis"]:
            print(
                f"  k1={d['k1']} b={d['b']}: Lucene with exact lengths ({d['lucene_exact_lengths_variant']}) has "
                f"Lucene's top-3 on {d['lucene_exact_vs_lucene_identical_top3']:.3f} of questions; the numpy port "
                f"with one-byte lengths on {d['port_one_byte_vs_lucene_identical_top3']:.3f} (scores within "
                f"{d['port_one_byte_vs_lucene_max_rel_score_error']:.1e} relative), with exact lengths has Lucene-"
                f"exact's on {d['port_exact_vs_lucene_exact_identical_top3']:.3f}"
            )
    for side, error in report["backend_errors"].items():
        print(f"backend FAILED: {side}: {error.strip().splitlines()[-1]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    check(report, backends)


def check(report: dict, backends: tuple[str, ...]) -> None:
    """Exit non-zero when a corpus or a required backend measured nothing, a figure is not a number, Lucene's index
    statistics disagree with dspo's tokens, or bm25s / rank_bm25 failed (other backends' failures are reported)."""
    figures: dict = {}
    for name, corpus in report["corpora"].items():
        figures[f"{name}.analyzer_statistics_match"] = corpus["analyzer_statistics_match"] or None
        for k1, b in SETTINGS:
            for backend in REQUIRED_BACKENDS:
                row = next(
                    (
                        r
                        for r in report["rows"]
                        if (r["corpus"], r["backend"], r["k1"], r["b"]) == (name, backend, k1, b)
                    ),
                    {},
                )
                for key in ("top3_overlap", "top3_identical", "recall3_dspo", "recall3_lucene"):
                    figures[f"{name}.{backend}.k1={k1},b={b}.{key}"] = row.get(key)
    errors = {side: e for side, e in report["backend_errors"].items() if side.split()[1] in REQUIRED_BACKENDS}
    require_measured("lucene_agreement", figures, errors)


if __name__ == "__main__":
    main()
