// Lucene BM25 over PRE-TOKENIZED text, for bench/lucene_agreement.py (which compiles and runs it).
//
//   java -cp ANSERINI_FATJAR:CLASSES LuceneBm25 DOCS QUERIES OUT STATS K K1,B [K1,B ...]
//
// DOCS: one document per line (line i = document i), its tokens joined by single spaces (dspo's Tokenizer output), so
// Lucene's WhitespaceAnalyzer reproduces dspo's analyzer exactly (its longest-token limit raised from 255 characters
// to the tokenizer maximum, so no token is split). QUERIES: one query per line, tokens joined by spaces; each token
// becomes one SHOULD TermQuery of a BooleanQuery, a repeated token once per repetition (dspo counts a repeated query
// word again). For each (k1, b) the queries are searched with BM25Similarity(k1, b) and OUT gets one line per
// (variant, setting, query): "VARIANT<TAB>SETTING<TAB>QUERY<TAB>doc score doc score ..." (top K, best first; doc = line
// number in DOCS). Variant "lucene" is Lucene's BM25Similarity, which stores each document's length in one byte
// (SmallFloat.intToByte4: exact below 24, then 4 significant bits); variant "exact" (only when the jar is Anserini's)
// is Anserini's AccurateBM25Similarity, the same BM25 with the exact length stored as the norm, on an index of its own
// (norms are computed at indexing time). STATS gets one JSON object: Lucene's version and the index statistics.
//
// Ties: Lucene ranks equal scores by internal doc id. The index is written by one thread into one segment with a
// merge policy that only merges adjacent segments, so internal doc id = line number (checked against a stored field):
// ties go to the earlier document, as in dspo.

import java.io.BufferedReader;
import java.io.BufferedWriter;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import org.apache.lucene.analysis.core.WhitespaceAnalyzer;
import org.apache.lucene.document.Document;
import org.apache.lucene.document.Field;
import org.apache.lucene.document.FieldType;
import org.apache.lucene.document.StoredField;
import org.apache.lucene.index.DirectoryReader;
import org.apache.lucene.index.IndexOptions;
import org.apache.lucene.index.IndexWriter;
import org.apache.lucene.index.IndexWriterConfig;
import org.apache.lucene.index.LogDocMergePolicy;
import org.apache.lucene.index.StoredFields;
import org.apache.lucene.index.Term;
import org.apache.lucene.search.BooleanClause;
import org.apache.lucene.search.BooleanQuery;
import org.apache.lucene.search.CollectionStatistics;
import org.apache.lucene.search.IndexSearcher;
import org.apache.lucene.search.ScoreDoc;
import org.apache.lucene.search.TermQuery;
import org.apache.lucene.search.TopDocs;
import org.apache.lucene.search.similarities.BM25Similarity;
import org.apache.lucene.search.similarities.Similarity;
import org.apache.lucene.store.ByteBuffersDirectory;
import org.apache.lucene.store.Directory;
import org.apache.lucene.util.Version;

public class LuceneBm25 {
  static final String FIELD = "contents";
  static final int MAX_TOKEN_LENGTH = 1024 * 1024; // CharTokenizer's upper limit (default 255 would split tokens)

  public static void main(String[] args) throws IOException {
    if (args.length < 6) {
      System.err.println("usage: LuceneBm25 DOCS QUERIES OUT STATS K K1,B [K1,B ...]");
      System.exit(2);
    }
    List<String> docs = readLines(args[0]);
    List<String> queries = readLines(args[1]);
    int k = Integer.parseInt(args[4]);
    List<float[]> settings = new ArrayList<>();
    for (int i = 5; i < args.length; i++) {
      String[] kb = args[i].split(",");
      settings.add(new float[] {Float.parseFloat(kb[0]), Float.parseFloat(kb[1])});
    }

    Class<?> accurate = null;
    try {
      accurate = Class.forName("io.anserini.search.similarity.AccurateBM25Similarity");
    } catch (ClassNotFoundException e) {
      System.err.println("no io.anserini.search.similarity.AccurateBM25Similarity in the jar: variant 'exact' skipped");
    }

    try (DirectoryReader reader = index(docs, new BM25Similarity());
        BufferedWriter out = Files.newBufferedWriter(Paths.get(args[2]), StandardCharsets.UTF_8)) {
      IndexSearcher searcher = new IndexSearcher(reader); // no executor: one thread, deterministic
      IndexSearcher.setMaxClauseCount(Math.max(IndexSearcher.getMaxClauseCount(), 1 << 16));
      CollectionStatistics stats = searcher.collectionStatistics(FIELD);
      try (BufferedWriter statsOut = Files.newBufferedWriter(Paths.get(args[3]), StandardCharsets.UTF_8)) {
        statsOut.write(
            String.format(
                Locale.ROOT,
                "{\"lucene_version\": \"%s\", \"max_doc\": %d, \"doc_count\": %d, \"sum_total_term_freq\": %d,"
                    + " \"sum_doc_freq\": %d, \"segments\": %d, \"exact_variant\": %b}\n",
                Version.LATEST,
                reader.maxDoc(),
                stats == null ? 0 : stats.docCount(),
                stats == null ? 0 : stats.sumTotalTermFreq(),
                stats == null ? 0 : stats.sumDocFreq(),
                reader.leaves().size(),
                accurate != null));
      }
      for (int s = 0; s < settings.size(); s++) {
        searcher.setSimilarity(new BM25Similarity(settings.get(s)[0], settings.get(s)[1]));
        search(searcher, queries, k, "lucene\t" + s, out);
      }
      if (accurate != null) {
        Similarity indexing = newAccurate(accurate, 1.2f, 0.75f); // its norm is the exact length, whatever k1, b
        try (DirectoryReader exactReader = index(docs, indexing)) {
          IndexSearcher exact = new IndexSearcher(exactReader);
          for (int s = 0; s < settings.size(); s++) {
            exact.setSimilarity(newAccurate(accurate, settings.get(s)[0], settings.get(s)[1]));
            search(exact, queries, k, "exact\t" + s, out);
          }
        }
      }
    }
  }

  static Similarity newAccurate(Class<?> accurate, float k1, float b) {
    try {
      return (Similarity) accurate.getConstructor(float.class, float.class).newInstance(k1, b);
    } catch (ReflectiveOperationException e) {
      throw new IllegalStateException(e);
    }
  }

  /** One segment, doc id = line number (checked), norms computed by `similarity`. */
  static DirectoryReader index(List<String> docs, Similarity similarity) throws IOException {
    Directory dir = new ByteBuffersDirectory();
    IndexWriterConfig config = new IndexWriterConfig(new WhitespaceAnalyzer(MAX_TOKEN_LENGTH));
    config.setSimilarity(similarity);
    config.setMergePolicy(new LogDocMergePolicy()); // merges adjacent segments only: doc ids keep insertion order
    config.setRAMBufferSizeMB(1024);
    config.setUseCompoundFile(false);
    FieldType type = new FieldType();
    type.setIndexOptions(IndexOptions.DOCS_AND_FREQS);
    type.setTokenized(true);
    type.setOmitNorms(false);
    type.freeze();
    try (IndexWriter writer = new IndexWriter(dir, config)) {
      for (int i = 0; i < docs.size(); i++) {
        Document doc = new Document();
        doc.add(new Field(FIELD, docs.get(i), type));
        doc.add(new StoredField("row", i));
        writer.addDocument(doc);
      }
      writer.forceMerge(1);
    }
    DirectoryReader reader = DirectoryReader.open(dir);
    if (reader.maxDoc() != docs.size()) {
      throw new IllegalStateException("indexed " + reader.maxDoc() + " documents of " + docs.size());
    }
    StoredFields stored = reader.storedFields();
    for (int i = 0; i < reader.maxDoc(); i++) {
      int row = stored.document(i).getField("row").numericValue().intValue();
      if (row != i) {
        throw new IllegalStateException("internal doc id " + i + " holds line " + row + ": ties would differ");
      }
    }
    return reader;
  }

  static void search(IndexSearcher searcher, List<String> queries, int k, String prefix, BufferedWriter out)
      throws IOException {
    for (int q = 0; q < queries.size(); q++) {
      BooleanQuery.Builder builder = new BooleanQuery.Builder();
      for (String token : queries.get(q).split(" ")) {
        if (!token.isEmpty()) {
          builder.add(new TermQuery(new Term(FIELD, token)), BooleanClause.Occur.SHOULD);
        }
      }
      TopDocs top = searcher.search(builder.build(), k);
      StringBuilder line = new StringBuilder(prefix).append('\t').append(q).append('\t');
      for (int r = 0; r < top.scoreDocs.length; r++) {
        ScoreDoc hit = top.scoreDocs[r];
        if (r > 0) {
          line.append(' ');
        }
        line.append(hit.doc).append(' ').append(Float.toString(hit.score));
      }
      out.write(line.append('\n').toString());
    }
  }

  static List<String> readLines(String path) throws IOException {
    List<String> lines = new ArrayList<>();
    try (BufferedReader in = Files.newBufferedReader(Paths.get(path), StandardCharsets.UTF_8)) {
      for (String line = in.readLine(); line != null; line = in.readLine()) {
        lines.add(line);
      }
    }
    return lines;
  }
}
