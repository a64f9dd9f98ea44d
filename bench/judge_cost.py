"""The judge reward's cost per round on the toy, with and without its dedupe and cache, and its agreement with subEM
(issue 73; dspo/env/judge.py).

    python bench/judge_cost.py                                   # the local judge (the toy warm start, CPU)
    python bench/judge_cost.py --server http://127.0.0.1:8000/v1 --served-model toy-judge --constrain

Real episodes: the shipped warm start (the toy default's policy, HFEngine, the RL temperature) answers the toy world's
training questions through the default environment (search over the world's BM25 index, subEM), `--rounds` rounds of
`--questions` questions x G=`--group-size`; the questions come from a pool of `--pool` so that later rounds revisit
earlier rounds' questions, as a second epoch does. Each round's episodes are then scored by `JudgedReward` around
subEM (dedupe in the batch + the LRU across rounds), and the same answers judged again one call per answered episode
(no dedupe, no cache) by the same client: calls and seconds of both, per round, each the median of `--repeats`
timings (the machine is shared). A server judge should run without its prefix cache (vLLM's
`--no-enable-prefix-caching`), or the second pass finds the first one's prompts cached. The judge sees only
(question, gold answers, answer), so judging after the rollout costs what judging inside it would. JSON:
outputs/bench/judge_cost.json (or `--out`; `--update-shipped`: bench/results/judge_cost.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance


def workload(pool: int):
    """(model dir, the training questions, the default environment, the agent config, the RL temperature)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import dspo  # noqa: F401  registers the config resolvers
    from dspo.data.qa import load_qa
    from dspo.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["output_dir=/tmp"])
    world, model_dir = instantiate(cfg.prepare.toyworld)  # the toy world of paths.toy_root (built once, then reused)
    items = load_qa(world.train, benchmark="toy", limit=pool)
    return model_dir, items, instantiate(cfg.env), instantiate(cfg.rollout.agent), float(cfg.algorithm.temperature)


def judge_reward(args: argparse.Namespace, model_dir: str):
    from dspo.env.judge import JudgedReward
    from dspo.env.rewards import SubEMReward

    if args.server:
        settings = {"base_url": args.server, "model": args.served_model, "constrain": args.constrain}
        return JudgedReward(SubEMReward(), concurrency=args.concurrency, **settings)
    return JudgedReward(SubEMReward(), model_path=str(Path(args.judge_model or model_dir)))


def one_round(reward, groups, repeats: int) -> dict:
    """Judge one round's episodes with dedupe + cache (the reward, its cache as it was before the round at each
    repeat), then one call per answered episode; the median seconds of `repeats` each (the machine is shared)."""
    from dspo.env.rewards import EpisodeRecord

    records = [EpisodeRecord(g.item, [], t.answer) for g in groups for t in g.trajectories]
    kept, seconds = reward.cache._items.copy(), []
    for _ in range(repeats):
        reward.cache._items = kept.copy()
        tic = time.perf_counter()
        results = reward.score(records)
        seconds.append(time.perf_counter() - tic)
    triples = [t for t in (reward._triple(e, r) for e, r in zip(records, results)) if t is not None]
    plain = []
    for _ in range(repeats):
        tic = time.perf_counter()
        replies = reward.client.judge([reward.prompt.render(t) for t in triples])
        plain.append(time.perf_counter() - tic)
    agrees = [r.components["judge_agrees"] for r in results if "judge_agrees" in r.components]

    def count(name: str) -> int:
        return int(sum(r.components[name] for r in results))

    return {
        "episodes": len(records),
        "answered": len(triples),
        "calls": count("judge_calls"),
        "cache_hits": count("judge_cached"),
        "deduped": count("judge_deduped"),
        "judge_s": statistics.median(seconds),
        "plain_calls": len(replies),
        "plain_s": statistics.median(plain),
        "errors": count("judge_error"),
        "judge_mean": sum(r.outcome for r in results) / len(results),
        "subem_mean": sum(r.components["subem"] for r in results) / len(results),
        "agreement": sum(agrees) / len(agrees) if agrees else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--questions", type=int, default=8, help="questions per round")
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--pool", type=int, default=16, help="distinct questions the rounds cycle through")
    parser.add_argument("--judge-model", default=None, help="the local judge's model dir (default: the policy's)")
    parser.add_argument("--server", default=None, help="an OpenAI-compatible judge URL instead (…/v1)")
    parser.add_argument("--served-model", default=None, help="with --server: the served model's name")
    parser.add_argument("--constrain", action="store_true", help="with --server: vLLM samples only the choice words")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timings per round (the median is kept)")
    add_output_arguments(parser, "judge_cost.json")
    args = parser.parse_args(argv)
    if min(args.rounds, args.questions, args.group_size, args.pool, args.repeats) < 1:
        parser.error("--rounds, --questions, --group-size, --pool and --repeats must be >= 1")
    args.out = output_path(parser, args, "judge_cost.json")
    return args


def main() -> None:
    args = parse_args()
    measured = provenance()
    from dspo.agent import build_agent
    from dspo.engines import HFEngine
    from dspo.toy.tokenizer import load_tokenizer

    model_dir, items, env, agent_config, temperature = workload(args.pool)
    agent_config.temperature = temperature
    engine, tokenizer = HFEngine(model_path=model_dir), load_tokenizer(model_dir)
    agent = build_agent(agent_config, engine=engine, tokenizer=tokenizer, env=env)
    reward = judge_reward(args, model_dir)
    rounds = []
    for index in range(args.rounds):
        start = index * args.questions % len(items)
        batch = (items * 2)[start : start + args.questions]
        groups = agent.rollout(batch, group_size=args.group_size, policy_version=0, seed=index).groups
        rounds.append(one_round(reward, groups, args.repeats))
        print(f"[round {index}] " + json.dumps({k: round(v, 4) if v else v for k, v in rounds[-1].items()}), flush=True)
    totals = {key: sum(r[key] for r in rounds) for key in ("episodes", "answered", "calls", "judge_s", "plain_s")}
    agreements = [r["agreement"] for r in rounds if r["agreement"] is not None]
    result = {
        **measured,
        "judge": reward.describe(),
        "settings": vars(args) | {"out": str(args.out)},
        "rounds": rounds,
        "totals": totals | {"agreement_mean": sum(agreements) / len(agreements) if agreements else None},
    }
    require_measured("judge_cost", {"rounds": rounds, "judge_s": totals["judge_s"], "plain_s": totals["plain_s"]})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["totals"], indent=2), f"\nwritten: {args.out}", flush=True)


if __name__ == "__main__":
    main()
