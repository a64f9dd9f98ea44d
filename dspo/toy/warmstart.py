"""SFT warm start for the embedded CPU default: teach a random tiny model the search-tool format from demonstrations.

Why this exists (and departs from the paper, which starts RL from Qwen2.5-Instruct): nothing pretrained can be
downloaded here, and a random model cannot discover `<tool_call>` JSON by RL in minutes. So the toy default first
fine-tunes on scripted demonstrations (`dspo.toy.demos`), a configurable share of them imperfect so RL has room to
improve. Real runs skip this and start RL from an instruct model.

Demonstrations are rendered by the real agent loop (`dspo.toy.render`: `ToolCallingAgent` + `ScriptedEngine` + BM25
over the toy corpus), so the SFT sequences are token for token what RL rollouts will look like (same template, same
tool-turn wrappers, same observation format), and the loss covers exactly the mask-1 (model-generated) tokens.

Two stages: name-recall drills (`recall_examples`, a curriculum of 1, 2, then 4 names per drill) first, because
copying a name from a passage is the skill whole demonstrations fail to teach in the time budget; then the
demonstrations, with copied name pieces weighted up, over the demo split and `demo_renamings` copies of it with every
demo entity renamed at random (`dspo.toy.renaming`), so that memorized name completions never pay. Demonstrations use
only the world's `demo` entities (see `dspo.toy.world`): RL's training questions stay as new to the warm-started model
as validation ones. `early_stop_share` makes a share of the 2-hop demonstrations answer after the first search, the
under-searching of instruct models on multi-hop questions that Search-R1-style RL corrects.

The repository ships the result for the default config (`data/toy_warmstart`, rebuilt by `python -m
dspo.toy.rebuild --update-shipped`); `prepare_toy_default` adopts it when the manifests match (`dspo.toy.shipped`).
experiment=toy_deep ships a fine-tune of it (`data/toy_deep_warmstart/model`, `deep_demos`): the default never saw a
chain longer than two hops and, from it, RL never completed a third (measured, docs/toy-deep.md).

Everything is cached: `prepare_toy_default` reuses a world, tokenizer and model whose manifests match the config.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspo.cachedir import build_lock, staged_folder
from dspo.data.qa import load_qa
from dspo.engines import HFEngine
from dspo.env.prompting import QWEN_INSTRUCTION, SEARCH_TOOL_SCHEMA
from dspo.process.progress_log import duration, phase, progress_logger
from dspo.search.bm25 import BM25Index
from dspo.search.corpus import load_corpus
from dspo.toy.cache_changes import read_manifest, rebuild_notice
from dspo.toy.deep import DEEP_HOPS
from dspo.toy.demos import IMPERFECT_KINDS, check_imperfect_kinds, make_script
from dspo.toy.drills import recall_examples
from dspo.toy.model import build_tiny_model
from dspo.toy.renaming import fresh_names, renamed_world
from dspo.toy.render import demo_agent, demo_environment, render_demonstrations, toy_retriever
from dspo.toy.selfplay import render_proposer_demonstrations
from dspo.toy.sft import demo_examples, train_sft
from dspo.toy.shipped import adopt_shipped
from dspo.toy.tokenizer import load_tokenizer, train_tokenizer
from dspo.toy.world import (
    SPLITS,
    ToyWorldConfig,
    ToyWorldFiles,
    build_toyworld,
    load_name_words,
    load_world_meta,
    name_pieces,
)
from dspo.types import QAItem, Trajectory

MANIFEST = "warmstart_manifest.json"
TOKENIZER_MANIFEST = "dspo_tokenizer.json"
log = logging.getLogger(__name__)
progress = progress_logger("warmstart")


@dataclass
class WarmStartConfig:
    """Demonstrations, tiny-model size, and the SFT loop. `agent` holds the demonstrations' episode limits
    (`AgentConfig` fields) and search limits (`topk`, ...: the search tool's), kept equal to the RL run's
    `rollout.agent` and `env.tools.search` so that demonstrations look like rollouts (`demo_agent`)."""

    seed: int = 0
    imperfect_share: float = 0.3
    # 2-hop demonstrations that answer after the first search (the intermediate entity), as instruct models often
    # stop searching too early on multi-hop questions. At 0.5 greedy decoding stopped early on nearly every 2-hop
    # validation question while 42 % of sampled 2-hop rollouts searched twice (measured): RL has to learn the second
    # hop from the groups where it was taken.
    early_stop_share: float = 0.0
    # what an imperfect demonstration does (dspo.toy.demos.IMPERFECT_KINDS), drawn uniformly
    imperfect_kinds: list = field(default_factory=lambda: list(IMPERFECT_KINDS))
    # imperfect_share for multi-hop questions (None = the same). With 0.3-0.4 for both, the warm start skipped the
    # search in 32-53 % of sampled 2-hop rollouts, ~1.5x its demonstrations' share (measured); the early stops
    # already leave 2-hop questions room for RL
    hop2_imperfect_share: float | None = None
    num_demos: int | None = None  # None = every demo-split question (entities RL and evaluation never see)
    # extra copies of the demonstrations with every demo entity renamed at random (dspo.toy.renaming): without them
    # the model recalled memorized name completions instead of copying names from passages (measured)
    demo_renamings: int = 7
    # more renamed copies of the 2-hop demonstrations only: the turn after a second search (copying a country name read
    # two passages in) was what the warm start got wrong most often (measured), and the demo split's entities support
    # only ~430 distinct 2-hop questions, so more practice there has to come from fresh names
    hop2_renamings: int = 0
    hidden_size: int = 192
    num_layers: int = 3
    num_heads: int = 3
    num_kv_heads: int = 1
    intermediate_size: int = 512
    # stage 1: synthetic name-recall drills that form the copy circuit (recall_examples), as [names per drill, steps]
    recall_curriculum: list = field(default_factory=lambda: [[1, 200], [2, 200], [4, 400]])
    recall_batch_size: int = 64
    steps: int = 1200  # stage 2: whole trajectories
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # Weight of an auxiliary next-token loss on environment tokens (retrieved passages), SFT only; RL never trains
    # them. 0 (default): a passage's first mention of a name is unpredictable, and 0.3 did not help copying (measured).
    context_loss_weight: float = 0.0
    # Weight of the name-word tokens the model writes (copied entity names: the skill that needs learning; the rest
    # of a turn is format the model learns in a few hundred steps). Measured, validation name pieces right (teacher
    # forced): 0.8 % (300 drill steps, weight 1), 5 % (300, weight 5), 68 % (800, weight 5).
    name_loss_weight: float = 5.0
    torch_threads: int | None = None  # None = leave torch's setting alone
    agent: dict = field(default_factory=dict)
    # env=two_sources (dspo.toy.sources): {tool: entity types its source holds}; demonstrations then call the source
    # that holds each hop's page with probability `right_tool_share` (room for RL to learn the choice). None: `search`
    sources: dict | None = None
    right_tool_share: float = 1.0
    # fine-tune this model (a folder with the same tokenizer, e.g. the shipped warm start) instead of a random one:
    # it already reads and copies names, so a new call format takes a few hundred steps, not the whole recipe
    init_model: str | None = None
    # experiment=toy_deep: up to this many 3- and 4-hop demonstrations (the demo split's chains, `demo_deep.jsonl`,
    # dspo.toy.deep) join the 1-/2-hop ones, and `deep_renamings` renamed copies of them. The shipped warm start never
    # saw a chain longer than 2: greedy, it answered 3-hop questions without searching or after 1-2 searches (measured)
    deep_demos: int = 0
    deep_renamings: int = 0
    # env=goal_reflect (dspo.toy.goal_demos): demonstrations state a goal before each search and reflect after it, in
    # env=goal_reflect's instruction, rendered at this search noise (a correct one searches a hop again when its
    # results lack the page)
    goal_reflect: bool = False
    goal_reflect_noise: float = 0.0
    # experiment=toy_selfplay (dspo.toy.selfplay): proposer demonstrations join the solver's (one per demo question,
    # in the proposer's instruction), plus `proposer_renamings` renamed copies of them
    proposer_demos: bool = False
    proposer_renamings: int = 0

    def __post_init__(self) -> None:
        self.imperfect_kinds = list(check_imperfect_kinds(self.imperfect_kinds))
        if self.goal_reflect and self.sources:
            raise ValueError(
                "WarmStartConfig: goal_reflect and sources are separate environments (one search tool vs two); set one"
            )
        if not 0.0 <= self.goal_reflect_noise <= 1.0:
            raise ValueError(f"WarmStartConfig.goal_reflect_noise must be in [0, 1], got {self.goal_reflect_noise}")
        for name in ("imperfect_share", "early_stop_share", "hop2_imperfect_share", "right_tool_share"):
            share = getattr(self, name)
            if share is not None and not 0.0 <= share <= 1.0:
                raise ValueError(f"WarmStartConfig.{name} must be in [0, 1], got {share}")
        for name in ("deep_demos", "deep_renamings", "proposer_renamings"):
            if getattr(self, name) < 0:
                raise ValueError(f"WarmStartConfig.{name} must be >= 0, got {getattr(self, name)}")


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# fields added after the shipped warm start was built: left out of its key at their defaults, so that the shipped
# model (data/toy_warmstart) still matches the default config
_LATER_FIELDS = {"sources": None, "right_tool_share": 1.0, "init_model": None, "deep_demos": 0, "deep_renamings": 0}
_LATER_FIELDS |= {"goal_reflect": False, "goal_reflect_noise": 0.0, "proposer_demos": False, "proposer_renamings": 0}


def config_key(config: WarmStartConfig) -> str:
    fields = {k: v for k, v in asdict(config).items() if k not in _LATER_FIELDS or v != _LATER_FIELDS[k]}
    # how fast, not what: 1 and 2 threads build bitwise-equal weights (measured); None keeps the shipped keys
    fields["torch_threads"] = None
    if config.init_model:  # the starting weights, not where they lie
        fields["init_model"] = _file_digest(Path(config.init_model) / "model.safetensors")
    return _digest(fields)


def _file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _read_manifest(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer for the toy world


def tokenizer_texts(world: ToyWorldFiles) -> list[str]:
    """Corpus, questions (raw and inside the agent's instruction), the tool schema, and scripted turns."""
    corpus = [json.loads(line)["contents"] for line in Path(world.corpus).read_text().splitlines()]
    texts = list(corpus)
    titles = [c.split("\n", 1)[0].strip('"') for c in corpus]
    passages = dict(zip(titles, corpus))
    # observation-like lines ("Doc 1 (Title: name) ..."), so the agent's observation prefix gets compact tokens
    texts += [f"Doc {1 + i % 3} (Title: {title}) {c}" for i, (title, c) in enumerate(zip(titles, corpus))]
    meta = load_world_meta(world)
    rng = random.Random(0)
    for split in SPLITS:
        for item in load_qa(getattr(world, split), benchmark="toy"):
            texts += [item.question, QWEN_INSTRUCTION.format(question=item.question)]
            observations = [passages[name] for name in item.metadata["chain"]]
            script = make_script(item, meta, rng, imperfect_share=0.3)
            texts += [script(observations[:turn]) for turn in range(len(observations) + 1)]
    texts += [json.dumps(SEARCH_TOOL_SCHEMA)] * 20
    return texts


def build_toy_tokenizer(
    world: ToyWorldFiles, output_dir: str, vocab_size: int = 1024, shipped: str | None = None
) -> str:
    """Train (or reuse, when its manifest matches this world and size) the toy tokenizer; returns its directory.
    `shipped`: a folder holding a tokenizer built the same way (dspo.toy.shipped), copied in when its manifest matches.

    The world's name words are one id each (shared by all splits), so an unseen validation name is a new combination
    of trained ids and copying it is copying 1-3 ids."""
    out = Path(output_dir)
    # version: bumped when tokenizer_texts changes (4: quotes cut after the later name, dspo.toy.demos.evidence)
    key = {"world": _file_digest(world.corpus) + _file_digest(world.demo), "vocab_size": vocab_size, "version": 4}
    if _tokenizer_is_built(out, key):
        return str(out)
    with build_lock(out):  # the ranks of a node prepare at once: one builds or adopts, the others use its result
        if _tokenizer_is_built(out, key):  # another process built it while this one waited
            return str(out)
        if adopt_shipped(shipped, out, TOKENIZER_MANIFEST, lambda recorded: recorded == key):
            return str(out)
        with staged_folder(out) as staging:  # swapped in whole: a reader never finds the folder missing or half made
            train_tokenizer(tokenizer_texts(world), str(staging), vocab_size=vocab_size, words=load_name_words(world))
            (staging / TOKENIZER_MANIFEST).write_text(json.dumps(key))
        log.info("toy tokenizer: trained %s", out)
    return str(out)


def _tokenizer_is_built(out: Path, key: dict) -> bool:
    return _read_manifest(out / TOKENIZER_MANIFEST) == key and (out / "tokenizer.json").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# Entry points


def warm_start(
    output_dir: str,
    world: ToyWorldFiles,
    tokenizer_dir: str,
    config: WarmStartConfig | None = None,
    shipped: str | None = None,
) -> str:
    """Build the tiny model, fine-tune it on rendered demonstrations, save model + tokenizer; returns `output_dir`.

    Skipped entirely when `output_dir/warmstart_manifest.json` records the same config, world and tokenizer, or when
    the folder `shipped` (dspo.toy.shipped) does: it is then copied in.
    """
    config = config or WarmStartConfig()
    out = Path(output_dir)
    key = {
        "config": config_key(config),
        "world": _file_digest(world.corpus) + _file_digest(world.demo),
        "tokenizer": _file_digest(Path(tokenizer_dir) / "tokenizer.json"),
    }
    if _warm_start_is_built(out, key):
        return str(out)
    with build_lock(out):  # the ranks of a node prepare at once: one trains or adopts, the others use its result
        if _warm_start_is_built(out, key):  # another process built it while this one waited
            return str(out)
        if adopt_shipped(shipped, out, MANIFEST, lambda recorded: recorded.get("key") == key):
            return str(out)
        _announce_rebuild(out, key, config, shipped)
        # trained in a sibling folder and swapped in whole, manifest included: an interrupted run never looks
        # finished, and a process loading the old model never finds the folder missing or half written
        with staged_folder(out) as staging, phase("warm start rebuild", progress):
            _train_warm_start(staging, world, tokenizer_dir, config, key)
        log.info("warm start: trained %s", out)
    return str(out)


def _announce_rebuild(out: Path, key: dict, config: WarmStartConfig, shipped: str | None) -> None:
    """The line before a rebuild: which config keys made it (against the nearest recorded build: the one cached at
    `out`, or the shipped one) and how long it should take (`dspo.toy.cache_changes`)."""
    candidates = {  # the shipped one first: named when both are as near (the cache adopted it)
        f"the shipped warm start ({shipped})": read_manifest(shipped, MANIFEST),
        f"the cached build ({out})": read_manifest(out, MANIFEST),
    }
    notice, _ = rebuild_notice(key, asdict(config), candidates, _LATER_FIELDS)
    log.info("warm start: building %s by SFT, %s", out, notice)


def _warm_start_is_built(out: Path, key: dict) -> bool:
    manifest = _read_manifest(out / MANIFEST)
    return manifest is not None and manifest.get("key") == key and (out / "config.json").is_file()


def _train_warm_start(
    staging: Path, world: ToyWorldFiles, tokenizer_dir: str, config: WarmStartConfig, key: dict
) -> None:
    """`warm_start`'s build: the model, tokenizer and manifest (last) written to `staging`."""
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(tokenizer_dir)
    from transformers import AutoModelForCausalLM

    if config.init_model:
        model = AutoModelForCausalLM.from_pretrained(
            _check_init_model(config.init_model, tokenizer), dtype=torch.float32
        )
    else:
        build_tiny_model(
            tokenizer_dir,
            str(staging),
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            intermediate_size=config.intermediate_size,
            seed=config.seed,
        )
        model = AutoModelForCausalLM.from_pretrained(str(staging), dtype=torch.float32)
    items = load_qa(world.demo, benchmark="toy", limit=config.num_demos)
    world_meta = load_world_meta(world)
    words, pieces = load_name_words(world), name_pieces(world)
    passages = load_corpus(world.corpus)

    def render(subset: list[QAItem], meta: dict[str, dict], index: BM25Index, seed: int) -> list[Trajectory]:
        env = demo_environment(
            index, meta, config.sources, config.agent, config.goal_reflect, config.goal_reflect_noise
        )
        return render_demonstrations(
            subset, meta, tokenizer, env, config.imperfect_share, seed, config.agent, config.early_stop_share,
            config.imperfect_kinds, config.hop2_imperfect_share, config.sources, config.right_tool_share,
            config.goal_reflect,
        )  # fmt: skip

    index = toy_retriever(world)
    demos = render(items, world_meta, index, config.seed)
    deep_items = deep_demo_items(world, config.deep_demos)
    if deep_items:  # a seed of their own: the 1-/2-hop demonstrations above and their copies stay as they were
        demos += render(deep_items, world_meta, index, config.seed + _DEEP_SEED)
    rng = random.Random(config.seed)
    hop2_items = [item for item in items if int(item.metadata["hops"]) > 1]
    # the same demo facts under fresh names (dspo.toy.renaming): every question, then the 2-hop ones only, then the
    # deep ones
    copies = [items] * config.demo_renamings + ([hop2_items] * config.hop2_renamings if hop2_items else [])
    copies += [deep_items] * config.deep_renamings if deep_items else []
    for copy, subset in enumerate(copies):
        meta, index, renamed = renamed_world(world_meta, passages, subset, fresh_names(world_meta, pieces, rng))
        demos += render(renamed, meta, index, config.seed + 1 + copy)
    if config.proposer_demos:  # after every copy above, on seeds of their own: those stay what they were
        demos += render_proposer_demonstrations(
            items, world_meta, tokenizer, index, config.seed + _PROPOSER_SEED, config.agent
        )
        for copy in range(config.proposer_renamings):
            meta, renamed_index, renamed = renamed_world(
                world_meta, passages, items, fresh_names(world_meta, pieces, rng)
            )
            seed = config.seed + _PROPOSER_SEED + 1 + copy
            demos += render_proposer_demonstrations(renamed, meta, tokenizer, renamed_index, seed, config.agent)
    rendered = time.perf_counter()
    progress.info("warm start: rendered %d demonstrations in %s", len(demos), duration(rendered - start))
    name_ids = set(tokenizer.convert_tokens_to_ids(words))
    stages = [
        (recall_examples(tokenizer, pieces, 8192, config.seed + k, names), steps, config.recall_batch_size)
        for k, (names, steps) in enumerate(config.recall_curriculum)
    ]
    stages += [
        (
            demo_examples(demos, config.context_loss_weight, name_ids, config.name_loss_weight),
            config.steps,
            config.batch_size,
        ),
    ]
    with _torch_threads(config.torch_threads):
        losses = train_sft(model, stages, tokenizer.pad_token_id, config)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    stats = {
        "demos": len(demos),
        "demo_reward_mean": sum(t.reward for t in demos) / max(1, len(demos)),
        "mean_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in demos) / max(1, len(demos)),
        "render_seconds": rendered - start,
        "train_seconds": time.perf_counter() - rendered,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),  # the timings'
    }
    (staging / MANIFEST).write_text(json.dumps({"key": key, "config": asdict(config), "stats": stats}, indent=2))


@contextlib.contextmanager
def _torch_threads(count: int | None) -> Iterator[None]:
    """torch's thread count for the SFT only (None: unchanged): an engine built later in the same process (the
    rebuild's measurement) takes its threads from torch's setting, and must measure as the shipped build did."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_DEEP_SEED = 10_000  # offset of the deep demonstrations' script seed (renamed copies use seed + 1 + copy)
_PROPOSER_SEED = 20_000  # ... and of the proposer demonstrations'


def deep_demo_items(world: ToyWorldFiles, limit: int) -> list[QAItem]:
    """The first `limit` 3-hop and the first `limit` 4-hop questions of the world's `demo_deep.jsonl` (none for 0)."""
    if limit == 0:
        return []
    path = world.extra.get("demo_deep")
    if not path or not Path(path).is_file():
        raise FileNotFoundError(
            f"prepare.toyworld.config.deep_demos: the world {world.root} has no demo_deep.jsonl (rebuild the world)"
        )
    items = load_qa(path, benchmark="toy")
    by_hops = [[item for item in items if int(item.metadata["hops"]) == hops][:limit] for hops in DEEP_HOPS]
    return [item for group in by_hops for item in group]


def _check_init_model(path: str, tokenizer) -> str:
    """`WarmStartConfig.init_model`, checked: a model folder whose tokenizer is this world's."""
    folder = Path(path)
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"prepare.toyworld.config.init_model: no model.safetensors in {folder}")
    if not (folder / "tokenizer.json").is_file() or load_tokenizer(str(folder)).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"prepare.toyworld.config.init_model: {folder} was trained with another tokenizer than this world's (or "
            "has none); "
            "start from a model of the same toy world (the shipped warm start) or set init_model=null"
        )
    return str(folder)


def evaluate_subem(
    model_dir: str, world: ToyWorldFiles, split: str = "val", limit: int | None = None, agent: dict | None = None
) -> float:
    """Greedy subEM of the model on a toy split with the real agent loop (HFEngine on CPU)."""
    tokenizer = load_tokenizer(model_dir)
    engine = HFEngine(model_path=model_dir, batch_size=64)
    searcher = demo_agent(engine, tokenizer, toy_retriever(world), agent)
    items = load_qa(getattr(world, split), benchmark="toy", limit=limit)
    groups = searcher.rollout(items, group_size=1, policy_version=0, greedy=True).groups
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / max(1, len(rewards))


def prepare_toy_default(
    root: str,
    world_config: ToyWorldConfig | None = None,
    vocab_size: int = 1024,
    config: WarmStartConfig | None = None,
    shipped: str | None = None,
    shipped_model: str | None = None,
) -> tuple[ToyWorldFiles, str]:
    """World + tokenizer + warm-started model under `root` (each step cached); returns (world files, model dir).

    `vocab_size` counts the name words (one id each, see `build_toy_tokenizer`); the rest goes to BPE merges.
    `shipped`: a folder with `tokenizer/` and `model/` built by `python -m dspo.toy.rebuild` (the repository carries
    one, `data/toy_warmstart`); each is copied in instead of built when its manifest matches. None = always build.
    `shipped_model`: a model folder tried instead of `shipped`'s `model/`, for a warm start that shares the shipped
    tokenizer (experiment=toy_deep: `data/toy_deep_warmstart/model`, a fine-tune of the shipped model).
    """
    world_config = world_config or ToyWorldConfig()
    base = Path(root)
    # fixed sub-directories (root/world, root/tokenizer, root/model): the train configs point at them; each step's
    # manifest rebuilds its output when its inputs change
    world = build_toyworld(str(base / "world"), world_config)
    ship = Path(shipped) if shipped else None
    tokenizer_dir = build_toy_tokenizer(world, str(base / "tokenizer"), vocab_size, ship and str(ship / "tokenizer"))
    model_ship = shipped_model or (ship and str(ship / "model"))
    model_dir = warm_start(str(base / "model"), world, tokenizer_dir, config, model_ship)
    return world, model_dir
