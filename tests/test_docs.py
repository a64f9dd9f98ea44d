"""Docs that run as written (issue 71): every `dspo-*` command line of README.md and docs/*.md composes (and
dspo-train does not refuse its settings), every relative link and every doc path the repository cites resolves
(anchors included), every metric tag and config key the docs cite is one the code logs or a config defines, the
console sample is what the default prints, and no page outgrows a topic.

A command line that cannot compose here is marked on the line before it (before the fence, for a whole code block)
with `<!-- docs-test: skip <reason> -->`. A marker whose lines compose is stale and fails too, so the list stays
short. Placeholders compose as they are (Hydra checks no path): `model.path=RUN/model` needs no marker.
"""

from __future__ import annotations

import ast
import copy
import re
import shlex
import tomllib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

from dspo.testing import HYDRA_COMMANDS

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# each console script's primary config (conf/<name>.yaml)
CONFIGS = HYDRA_COMMANDS
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh", "text"}
SKIP_MARKER = re.compile(r"<!--\s*docs-test:\s*skip\b\s*(.*?)\s*-->")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
SHELL_SEPARATORS = {"|", "||", "&&", ";", "&"}
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--resolve", "--run", "-r", "--version", "--shell-completion", "-sc"}
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-dir", "-cd"}
CONFIG_NAME_FLAGS = {"--config-name", "-cn"}


@cache
def script_modules() -> dict[str, str]:
    """`python -m <module>` forms of the console scripts (pyproject's [project.scripts]): module -> config name; a
    module behind two commands (dspo-index and dspo-serve) names no single config and is left out."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    modules = Counter(target.split(":")[0] for target in scripts.values())
    return {
        target.split(":")[0]: CONFIGS[name]
        for name, target in scripts.items()
        if name in CONFIGS and modules[target.split(":")[0]] == 1
    }


# --- reading markdown ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A piece of a doc that may hold a command: one line of a shell code block (continuations joined) or an inline
    code span; `skip` is the reason of a docs-test marker that covers it."""

    path: Path
    line: int
    text: str
    fenced: bool
    skip: str | None = None

    @property
    def where(self) -> str:
        shown = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path.name
        return f"{shown}:{self.line}"


@dataclass
class Page:
    """A markdown file split into its fenced code lines and its prose paragraphs (line numbers kept)."""

    path: Path
    code: list[Span]  # shell code lines (other languages' blocks are not commands)
    paragraphs: list[list[tuple[int, str, str | None]]]  # (line number, text, skip reason) per prose line


@cache
def read_page(path: Path) -> Page:
    code: list[Span] = []
    paragraphs: list[list[tuple[int, str, str | None]]] = [[]]
    fence: tuple[str, str, str | None] | None = None  # (marker, language, skip) of the open code block
    pending: list[tuple[int, str]] = []  # a shell line continued with a backslash
    skip: str | None = None  # a marker waiting for the next non-blank line
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if fence is not None:
            marker, language, block_skip = fence
            if line.strip().startswith(marker) and not line.strip().strip(marker[0]):
                fence = None
            elif language in SHELL_FENCES:
                pending.append((number, line))
                if not line.rstrip().endswith("\\"):
                    text = " ".join(part.rstrip().removesuffix("\\") for _, part in pending)
                    code.append(Span(path, pending[0][0], text, fenced=True, skip=block_skip))
                    pending = []
            continue
        opened = FENCE.match(line)
        if opened:
            fence, skip = (opened.group(1), opened.group(2).lower(), skip), None
            paragraphs.append([])
        elif SKIP_MARKER.search(line):
            skip = SKIP_MARKER.search(line).group(1) or "(no reason given)"
            paragraphs.append([])
        elif not line.strip():
            paragraphs.append([])
        else:
            paragraphs[-1].append((number, line, skip))
            skip = None
    return Page(path, code, [p for p in paragraphs if p])


def inline_spans(page: Page) -> Iterator[Span]:
    """The inline code spans of the prose (a span may run over a line break; a table's `\\|` is a `|`)."""
    for paragraph in page.paragraphs:
        text = "\n".join(line for _, line, _ in paragraph)
        for match in CODE_SPAN.finditer(text):
            index = text.count("\n", 0, match.start())
            number, _, skip = paragraph[index]
            content = match.group(2).replace("\n", " ").replace("\\|", "|").strip()
            yield Span(page.path, number, content, fenced=False, skip=skip)


def prose_without_code(page: Page) -> Iterator[tuple[int, str]]:
    """Each prose line with its code spans blanked out (links inside code are not links)."""
    for paragraph in page.paragraphs:
        text = "\n".join(line for _, line, _ in paragraph)
        text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        for (number, _, _), line in zip(paragraph, text.split("\n"), strict=True):
            yield number, line


# --- command lines ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    span: Span
    config: str
    overrides: tuple[str, ...]
    multirun: bool


def without_shell_comment(text: str) -> str:
    """The line up to a `#` that starts a word outside quotes (bash's rule: `generating#5` is no comment)."""
    quote = None
    for index, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or text[index - 1].isspace()):
            return text[:index]
    return text


def commands_in(span: Span) -> list[Command]:
    """The `dspo-*` (or `python -m <module>`) commands of a span, each with its overrides up to a shell separator."""
    text = without_shell_comment(span.text) if span.fenced else span.text
    text = text.removeprefix("$ ")
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote: prose in backticks, not a command line
        return []
    modules, found = script_modules(), []
    for index, word in enumerate(words):
        if word in CONFIGS and "--compare" in words[index + 1 :]:  # dspo-eval --compare A B: report files, no Hydra
            continue
        if word in CONFIGS:
            found.append(command_from(span, CONFIGS[word], words[index + 1 :]))
        elif word == "-m" and index + 1 < len(words) and words[index + 1] in modules:
            found.append(command_from(span, modules[words[index + 1]], words[index + 2 :]))
    return found


def command_from(span: Span, config: str, words: list[str]) -> Command:
    """Hydra's overrides of one command: flags dropped (`-m` noted), `...` and `[optional]` placeholders read as the
    docs mean them (`[backend=tantivy]` is an override that may be left out, `[overrides]` and `...` are none)."""
    overrides, multirun, words = [], False, list(words)
    while words:
        word = words.pop(0)
        if word in SHELL_SEPARATORS or word.startswith((">", "2>")):
            break
        if word in ("-m", "--multirun"):
            multirun = True
        elif word in CONFIG_NAME_FLAGS and words:
            config = words.pop(0)
        elif word.startswith("--config-name="):
            config = word.split("=", 1)[1]
        elif word in HYDRA_FLAGS_WITH_VALUE and words:
            words.pop(0)
        elif word in HYDRA_FLAGS or word.startswith("-") or word in ("...", "…"):
            continue
        elif word.startswith("[") and word.endswith("]"):
            if "=" in word:
                overrides.append(word[1:-1])
        else:
            overrides.append(word)
    return Command(span, config, tuple(overrides), multirun)


def choices(override: str, multirun: bool) -> list[str]:
    """The values one override stands for: `key=a|b` (a doc's "either") and, under -m, a sweep `key=a,b` or
    `key=range(...)` (an Optuna `interval(...)` is the sweeper's to sample: it stands for itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key, _, value = override.partition("=")
    options = [f"{key}={v}" for v in value.split("|")] if "|" in value else [override]
    if not multirun:
        return options
    points = []
    for option in options:
        parsed = OverridesParser.create().parse_override(option)
        try:
            values = list(parsed.sweep_string_iterator()) if parsed.is_sweep_override() else []
        except Exception:  # noqa: BLE001 - interval(...)
            values = []
        points += [f"{parsed.get_key_element()}={v}" for v in values] or [option]
    return points


def variants(command: Command) -> list[tuple[str, ...]]:
    """The command lines one doc line stands for, thinned: each value of each key in at least one (the i-th takes
    the i-th value of every key), since every combination would cost seconds and test nothing more."""
    options = [choices(override, command.multirun) for override in command.overrides]
    return [tuple(o[i % len(o)] for o in options) for i in range(max((len(o) for o in options), default=1))]


def doc_commands() -> list[Command]:
    found = []
    for path in DOCS:
        page = read_page(path)
        for span in [*page.code, *inline_spans(page)]:
            found.extend(commands_in(span))
    return found


def selects_configs(override: str) -> bool:
    """Whether an override changes what is composed (a config group's option, Hydra's own settings, its search path)
    rather than a value of the composed config."""
    key = override.lstrip("+~").split("=", 1)[0].split("@", 1)[0]
    return key.startswith("hydra") or (REPO / "conf" / key).is_dir()


@cache
def composed(config: str, selections: tuple[str, ...]):
    from dspo.testing import compose_config

    return compose_config(config, list(selections))


@cache
def composition_error(config: str, overrides: tuple[str, ...]) -> str | None:
    """Why `dspo-<config> overrides` stops before it runs (None: it composes, and dspo-train accepts the settings).

    Each set of group choices is composed once; the values are then set as Hydra sets them after composing
    (`_apply_overrides_to_config`), since composing costs a third of a second and the docs repeat their choices."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        cfg = composed(config, tuple(o for o in overrides if selects_configs(o)))
        values = OverridesParser.create().parse_overrides([o for o in overrides if not selects_configs(o)])
        sweeps = [o.input_line for o in values if o.is_sweep_override()]
        if sweeps:
            return f"{sweeps[0]}: a sweep, which Hydra takes only with -m (--multirun)"
        if values:  # on a copy: the composed config is shared by the lines that choose the same groups
            cfg = copy.deepcopy(cfg)
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        if config == "train":  # what dspo-train refuses at once, before anything is built
            from dspo.train import check_round_alignment
            from dspo.training.combinations import check_combinations

            check_round_alignment(cfg)
            check_combinations(cfg)
    except Exception as error:  # noqa: BLE001 - every failure is the report
        return f"{type(error).__name__}: {str(error).strip()}"
    return None


def command_errors(command: Command) -> list[str]:
    try:
        lines = variants(command)
    except Exception as error:  # noqa: BLE001 - an override Hydra's parser refuses
        return [f"{type(error).__name__}: {error}"]
    return [error for line in lines if (error := composition_error(command.config, line))]


def describe(command: Command, error: str) -> str:
    shown = " ".join([command.config, *(["-m"] if command.multirun else []), *command.overrides])
    return f"{command.span.where}: {shown}\n    {error}"


@pytest.fixture
def at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # hydra.searchpath=[file://docs/examples/conf] is relative, as the docs run it


def test_every_command_line_in_the_docs_composes(at_repo_root):
    failures, stale = [], []
    for command in doc_commands():
        errors = command_errors(command)
        if command.span.skip is None:
            failures += [describe(command, error) for error in errors]
        elif not errors:
            stale.append(f"{command.span.where}: marked `skip {command.span.skip}` but composes: drop the marker")
    assert not failures + stale, "\n".join(failures + stale)


# --- links and cited doc paths ------------------------------------------------------------------------------------

MARKDOWN_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lowercased, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: Counter[str] = Counter()
    found = set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    for paragraph in read_page(path).paragraphs:
        for _, line, _ in paragraph:
            heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if heading:
                base = slug(heading.group(1))
                found.add(base if not seen[base] else f"{base}-{seen[base]}")
                seen[base] += 1
    return frozenset(found)


def link_problem(source: Path, target: str, bases: tuple[Path, ...] | None = None) -> str | None:
    """What is wrong with a relative link `path#anchor` from `source` (None: the file, and the heading, exist)."""
    if target.startswith(EXTERNAL):
        return None
    path, _, anchor = unquote(target).partition("#")
    candidates = [(base / path).resolve() for base in (bases or (source.parent,))] if path else [source]
    existing = [c for c in candidates if c.exists()]
    if not existing:
        return f"{target}: no file {candidates[0].relative_to(REPO) if candidates[0].is_relative_to(REPO) else path}"
    if anchor and existing[0].suffix == ".md" and anchor not in anchors(existing[0]):
        return f"{target}: no heading #{anchor} in {existing[0].relative_to(REPO)}"
    return None


def test_every_relative_link_resolves():
    problems = []
    for path in DOCS:
        page = read_page(path)
        for number, line in prose_without_code(page):
            targets = MARKDOWN_LINK.findall(line) + HTML_LINK.findall(line) + REFERENCE_LINK.findall(line)
            for target in targets:
                problem = link_problem(path, target)
                if problem:
                    problems.append(f"{path.relative_to(REPO)}:{number}: {problem}")
    assert not problems, "\n".join(problems)


# A doc path cited in text, code or a comment: `docs/loggers.md#loggers`, `loggers.md#loggers`, `docs/faults.md`.
CITED_DOC = re.compile(r"(?<![\w/.-])((?:\.\./)*(?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?")
CITING_FILES = ("README.md", "docs/**/*.md", "dspo/**/*.py", "conf/**/*.yaml", "bench/**/*.py", "bench/**/*.md")
CITING_FILES += ("tests/**/*.py", "scripts/**/*", "hydra_plugins/**/*.py", "Makefile", "pyproject.toml")


def cited_doc_paths(path: Path) -> Iterator[tuple[int, str]]:
    """`docs/....md[#anchor]` and `....md#anchor` mentions (other `.md` names may be files a command writes)."""
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        line = re.sub(r"\]\([^)]*\)", "]", line)  # markdown links: the link test's
        for match in CITED_DOC.finditer(line):
            if match.group(1).startswith("docs/") or match.group(2):
                yield number, match.group(0)


def test_every_cited_doc_path_and_anchor_exists():
    """Moved sections keep their citations: every `docs/x.md#anchor` in the code, configs, tests and docs resolves."""
    problems = []
    files = {p for pattern in CITING_FILES for p in REPO.glob(pattern) if p.is_file() and p != Path(__file__)}
    for path in sorted(files):
        for number, cited in cited_doc_paths(path):
            problem = link_problem(path, cited, bases=(path.parent, REPO, REPO / "docs"))
            if problem:
                problems.append(f"{path.relative_to(REPO)}:{number}: {problem}")
    assert not problems, "\n".join(problems)


# --- metric tags --------------------------------------------------------------------------------------------------

NAMESPACES = ("rollout", "train", "loss", "val", "test", "guard", "mismatch", "reward")
DOC_TAG = re.compile(rf"^(?:{'|'.join(NAMESPACES)})/[\w<>*{{}},|.@/-]*$")
STAT_KEY = re.compile(r"^[a-z_]+(?:/[\w<>*{},|.-]+)+$")  # `invalid/judge/bad_arguments`: a key of rollout stats
CODE_HOLE, DOC_HOLE = "\0", "\1"  # an f-string's `{...}` in the code; a `<name>` in the docs
KEYED = {"dict", "update"}  # calls whose keyword arguments are keys (of statistics, components)

# Tags the code builds from names the static scan cannot follow, each with why (none today: roles, tools, benchmarks
# and detectors are `<name>` placeholders the scan matches to the code's `{...}`).
DYNAMIC_TAGS: dict[str, str] = {}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of a module's docstrings: they cite tags, they log none."""
    kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    firsts = [node.body[0] for node in ast.walk(tree) if isinstance(node, kinds) and node.body]
    return {id(f.value) for f in firsts if isinstance(f, ast.Expr) and isinstance(f.value, ast.Constant)}


def strings_of(tree: ast.AST) -> Iterator[str]:
    """The strings a module builds: literals, f-strings (`{...}` as CODE_HOLE) and keyword keys (`update(cost=...)`)."""
    skipped = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skipped.update(id(part) for part in node.values)  # an f-string's pieces are not strings of their own
            yield "".join(p.value if isinstance(p, ast.Constant) else CODE_HOLE for p in node.values)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            yield node.value
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in KEYED:
            yield from (keyword.arg for keyword in node.keywords if keyword.arg)


@cache
def code_strings() -> tuple[str, ...]:
    """Every string dspo/ builds that could be a tag (a tag has no space)."""
    found = {text for path in (REPO / "dspo").rglob("*.py") for text in strings_of(ast.parse(path.read_text()))}
    return tuple(sorted(text for text in found if not re.search(r"\s", text)))


def as_regex(text: str) -> str:
    return "".join("[^/]+" if char == CODE_HOLE else re.escape(char) for char in text)


def has_literal_segment(text: str) -> bool:
    return any(re.search(r"[a-z]", segment) and CODE_HOLE not in segment for segment in text.split("/"))


@cache
def tag_grammar() -> tuple[re.Pattern, tuple[re.Pattern, ...]]:
    """(the tags the code spells whole, the prefixes it puts before a key). `f"rollout/{key}"` is a prefix: it logs
    each key of a statistics dict, so `rollout/` + a key the code spells is a tag; as a whole tag it matches only a
    doc's placeholder (`guard/<name>` for `f"guard/{name}"`), never any name. A string with no literal segment
    (`f"{a}/{b}_mean"`) spells no tag; a prefix of holes only (`f"{stage}/{name}/"`) needs two of them."""
    tags, prefixes = [], set()
    for text in code_strings():
        if text.endswith("/" + CODE_HOLE):
            tags.append(as_regex(text[:-1]) + re.escape(DOC_HOLE))
            text = text[:-1]
        if text.endswith("/") and (has_literal_segment(text) or text.count(CODE_HOLE) >= 2):
            prefixes.add(as_regex(text))
        elif not text.endswith("/") and has_literal_segment(text):
            tags.append(as_regex(text))
    whole = re.compile("|".join(f"(?:{tag})" for tag in tags))
    return whole, tuple(re.compile(prefix) for prefix in sorted(prefixes))


def produced(tag: str) -> bool:
    """A concrete tag (placeholders as DOC_HOLE) that the code spells whole, or as prefix + a tag it spells."""
    whole, prefixes = tag_grammar()
    if whole.fullmatch(tag):
        return True
    cuts = [i + 1 for i, char in enumerate(tag) if char == "/"]
    return any(prefix.fullmatch(tag[:cut]) and produced(tag[cut:]) for cut in cuts for prefix in prefixes)


def may_start(prefix: str) -> bool:
    """Whether some tag the code logs starts with `prefix` (`rollout/staleness_*`, `test/...`): a string the code
    spells starts with it, or a prefix the code puts before keys covers its head and a key starts with the rest."""
    if not prefix or any(text.startswith(prefix) for text in code_strings()):
        return True
    _, prefixes = tag_grammar()
    cuts = [i + 1 for i, char in enumerate(prefix) if char == "/"]
    return any(head.fullmatch(prefix[:cut]) and may_start(prefix[cut:]) for cut in cuts for head in prefixes)


def expanded(tag: str) -> list[str]:
    """`loss/ratio_mean|min|max`, `val/toy_{1,2}hop/subem` and `<name>` placeholders as concrete tags to look up."""
    braces = re.search(r"\{([^{}]*)\}", tag)
    if braces:
        options = [o for o in braces.group(1).split(",") if o not in ("...", "…")]
        return [t for o in options for t in expanded(tag[: braces.start()] + o + tag[braces.end() :])]
    first, *others = tag.split("|")
    tags = [first]
    for other in others:  # `x_mean|max` replaces what follows the last `_`; `subem|em|f1` the last segment
        head, last = first.rsplit("/", 1)
        stem = last.rsplit("_", 1)[0] + "_" if "_" in last and "_" not in other else ""
        tags.append(f"{head}/{stem}{other}")
    return [re.sub(r"<[^<>/]+>", DOC_HOLE, t) for t in tags]


def tag_problem(tag: str) -> str | None:
    if tag in DYNAMIC_TAGS:
        return None
    for concrete in expanded(tag):
        open_end = re.search(r"\*|\.\.\.|…|/$", concrete)  # `rollout/staleness_*`, `test/...`, `val/`: a prefix
        head = concrete[: open_end.start() + (open_end.group() == "/")] if open_end else None
        if head is not None and not may_start(head):
            return f"`{tag}`: no tag the code logs starts with {head!r}"
        if head is None and not produced(concrete):
            return f"`{tag}`: the code logs no {concrete.replace(DOC_HOLE, '<...>')!r}"
    return None


def test_every_metric_tag_cited_is_logged():
    problems = []
    for path in DOCS:
        for span in inline_spans(read_page(path)):
            if DOC_TAG.match(span.text):
                problem = tag_problem(span.text)
            elif STAT_KEY.match(span.text) and span.text.startswith(stat_families()):
                problem = f"`{span.text}`: logged as `rollout/{span.text}`"
            else:
                continue
            if problem:
                problems.append(f"{span.where}: {problem}")
    assert not problems, "\n".join(problems)


def stat_families() -> tuple[str, ...]:
    """The families of rollout statistics logged under `rollout/` (`invalid/<tool>/<kind>`, `calls/<tool>`, ...)."""
    from dspo.agent.accounting import CALL_STAT_KINDS

    return tuple(key for key in CALL_STAT_KINDS if key.endswith("/") and not key.startswith(NAMESPACES))


# --- config keys --------------------------------------------------------------------------------------------------

CONFIG_ROOTS = (REPO / "conf", REPO / "docs" / "examples" / "conf")
CITED_KEY = re.compile(r"^(\+{1,2}|~)?([a-z_]\w*(?:\.[\w-]+)+)(?:=\S*)?$")
FILE_NAME = re.compile(r"\.(?:jsonl|json|ya?ml|ckpt|pt|py|md|txt|png|log|csv|gz|parquet)$")  # `guard.jsonl`
# Spans that read like keys but name something else, each with why.
NOT_KEYS = {
    "rollout.agent.topk": "a removed key, named as such (dspo/agent/config.py turns it into the new one)",
    "trainer.test": "Lightning's Trainer method",
    "trainer.loggers": "Lightning's Trainer attribute",
    "trainer.global_step": "Lightning's Trainer attribute",
    "trainer.save_checkpoint": "Lightning's Trainer method",
    "trainer.mid_send": "a DSPO_FAULT point (dspo/rollout/faults.py)",
    "trainer.push": "a DSPO_FAULT point",
    "trainer.take": "a DSPO_FAULT point",
}


def key_paths(node, prefix: str) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "defaults":
                continue
            path = f"{prefix}.{key}" if prefix else str(key)
            yield path
            yield from key_paths(value, path)


@cache
def config_keys() -> frozenset[str]:
    """Every key the configs define, under its package (`conf/rollout/agent/default.yaml`'s `overflow` is
    `rollout.agent.overflow`; an experiment's `# @package _global_` keys are top-level)."""
    from omegaconf import OmegaConf

    keys = set()
    for root in CONFIG_ROOTS:
        for path in root.rglob("*.yaml"):
            header = re.match(r"#\s*@package\s+(\S+)", path.read_text())
            package = header.group(1) if header else ".".join(path.parent.relative_to(root).parts)
            package = "" if package == "_global_" else package.removeprefix("_global_.")
            keys.update(key_paths(OmegaConf.to_container(OmegaConf.load(path)), package))
    return frozenset(keys)


def test_every_config_key_cited_exists():
    """A key named in the prose (`callbacks.checkpoint.keep_last`, `rollout.agent.overflow=compact`) is one some
    config defines; `+key=...` adds a key, so it is left to the command-line test."""
    keys = config_keys()
    roots = {key.split(".")[0] for key in keys} - {"hydra"}
    problems = []
    for path in DOCS:
        for span in inline_spans(read_page(path)):
            cited = CITED_KEY.match(span.text)
            if not cited or cited.group(1) or FILE_NAME.search(cited.group(2)) or cited.group(2) in NOT_KEYS:
                continue
            key = cited.group(2)
            placeholder = any(part.isupper() for part in key.split("."))  # `env.KEY=...`
            if key.split(".")[0] in roots and key not in keys and not placeholder:
                problems.append(f"{span.where}: `{span.text}`: no config defines {key}")
    assert not problems, "\n".join(problems)


def test_the_console_sample_is_what_the_default_prints():
    """docs/console.md's validation line is the one a default `dspo-train` prints: its benchmarks, a step
    validation falls on, and `validation_table`'s format."""
    from dspo.callbacks.progress import validation_table
    from dspo.testing import compose_config

    cfg = compose_config("train", [])
    benchmarks, interval = sorted(cfg.data.val_files), cfg.trainer.val_check_interval
    samples = [s for s in inline_spans(read_page(REPO / "docs" / "console.md")) if "validation subEM" in s.text]
    assert samples, "docs/console.md shows no validation line"
    for sample in samples:
        step, rest = re.fullmatch(r"step (\d+) · validation subEM  (.*)", sample.text).groups()
        scores = dict(re.findall(r"(\S+) (\d\.\d+)", rest))
        mean = scores.pop("mean", None)
        metrics = {f"val/{name}/subem": float(value) for name, value in scores.items()}
        metrics["val/subem_mean"] = float(mean) if mean is not None else 0.0
        assert sorted(scores) == benchmarks, f"{sample.where}: the default validates on {benchmarks}"
        assert int(step) % interval == 0, f"{sample.where}: the default validates every {interval} steps"
        assert validation_table(metrics, int(step)) == sample.text, f"{sample.where}: not validation_table's format"


PAGE_LIMIT = 32_000  # characters: ~30k, where a page is split by topic (issue 71); the slack spares small edits


def test_no_doc_page_outgrows_a_topic():
    long = [f"{p.relative_to(REPO)}: {len(p.read_text())}" for p in DOCS[1:] if len(p.read_text()) > PAGE_LIMIT]
    assert not long, f"split these by topic (over {PAGE_LIMIT} characters): {long}"


# --- the checks themselves, on the defects they were written for ---------------------------------------------------

SAMPLE_PAGE = """Resume with `dspo-train ckpt_path=last
trainer.max_steps=20`; in a table | `dspo-train env=ikea\\|stepsearch` |

<!-- docs-test: skip the reason -->
```bash
dspo-eval model.path=~/.cache/model data=toy_deep \\
  retriever=toyworld   # a comment, not an override
```
"""


def test_the_reader_finds_commands_as_the_docs_write_them(tmp_path, at_repo_root):
    page = tmp_path / "page.md"
    page.write_text(SAMPLE_PAGE)
    page_read = read_page(page)
    found = [c for span in [*page_read.code, *inline_spans(page_read)] for c in commands_in(span)]
    shown = {(c.span.line, c.config, c.overrides, c.span.skip) for c in found}
    assert shown == {
        (1, "train", ("ckpt_path=last", "trainer.max_steps=20"), None),
        (2, "train", ("env=ikea|stepsearch",), None),
        (6, "eval", ("model.path=~/.cache/model", "data=toy_deep", "retriever=toyworld"), "the reason"),
    }
    eval_line = next(c for c in found if c.config == "eval")
    assert "LexerNoViableAlt" in command_errors(eval_line)[0]  # Hydra's lexer refuses the `~`
    assert [v for c in found if c.span.line == 2 for v in variants(c)] == [("env=ikea",), ("env=stepsearch",)]


def test_the_tag_check_tells_logged_tags_from_others():
    logged = ["val/nq/subem", "guard/reward_drop", "rollout/invalid/<tool>/<kind>", "loss/ratio_*", "test/...", "val/"]
    not_logged = ["rollout/keep_rat", "val/nq/subemm", "guard/reward_dropp", "rollout/foo_mean", "rollout/zzz*"]
    assert [tag_problem(tag) for tag in logged] == [None] * len(logged)
    assert all(tag_problem(tag) for tag in not_logged)
    assert "invalid/judge/bad_arguments".startswith(stat_families())  # cited without the rollout/ it is logged under
