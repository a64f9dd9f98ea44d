"""What in-flight rounds cost a checkpoint (issue 74): bytes and seconds, on a real toy checkpoint and on a synthetic
round of a paper config's shape.

    .venv/bin/python bench/in_flight.py --checkpoint RUN/checkpoints/last.ckpt     # a k >= 1 toy run's checkpoint
    .venv/bin/python bench/in_flight.py --groups 64 --group-size 5 --tokens 4096  # 1/8 of a paper round

`--checkpoint`: the file's size with and without its `in_flight` entry, and `torch.save` of each (the save's own cost;
the wait for rounds still generating is in the run's log: "checkpoint: N in-flight round(s) ... stored (S s)").
Synthetic: `groups` x `group-size` trajectories of `tokens` tokens (a 300-token prompt, the rest response with
float32 logprobs, a 0/1 mask, a response text of 4 characters a token), encoded by `dspo.rollout.in_flight.pack` and
saved; printed per token and scaled to 512 groups (the paper configs' B x M rounds).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time

import torch
from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance


def _saved(obj) -> tuple[int, float]:
    buffer, start = io.BytesIO(), time.perf_counter()
    torch.save(obj, buffer)
    return buffer.tell(), time.perf_counter() - start


def checkpoint_costs(path: str) -> dict:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    key = next(k for k in checkpoint["callbacks"] if "RolloutCallback" in k)
    with_rounds, with_s = _saved(checkpoint)
    in_flight = checkpoint["callbacks"][key].pop("in_flight", None)
    without, without_s = _saved(checkpoint)
    rounds = len(in_flight["rounds"]) if in_flight else 0
    return {
        "file": path,
        "rounds": rounds,
        "bytes_with": with_rounds,
        "bytes_without": without,
        "save_s_with": round(with_s, 3),
        "save_s_without": round(without_s, 3),
    }


def synthetic_round(groups: int, group_size: int, tokens: int, prompt: int = 300):
    from dspo.rollout.messages import SampledRound
    from dspo.types import QAItem, RolloutGroup, Trajectory

    rng, response = random.Random(0), tokens - prompt
    out = []
    for g in range(groups):
        item = QAItem(f"q{g}", "a question of about this length?", ["answer"])
        trajectories = []
        for _ in range(group_size):
            mask = [int(rng.random() < 0.7) for _ in range(response)]
            logprobs = [float(torch.tensor(-rng.random(), dtype=torch.float32)) if m else 0.0 for m in mask]
            ids = [rng.randrange(151_000) for _ in range(response)]
            text = "x" * (4 * response)
            trajectories.append(
                Trajectory(
                    [rng.randrange(151_000) for _ in range(prompt)],
                    ids,
                    mask,
                    logprobs,
                    reward=1.0,
                    response_text=text,
                    policy_version=3,
                )
            )
        out.append(RolloutGroup(item, trajectories, prompt_index=g))
    return SampledRound(4, out, {"rollout/keep_rate": 0.5}, 3, {"epoch": 0, "position": 9, "seed": 0}, 0.5)


def synthetic_costs(groups: int, group_size: int, tokens: int) -> dict:
    from dspo.rollout.in_flight import pack

    sampled = synthetic_round(groups, group_size, tokens)
    start = time.perf_counter()
    packed = pack([sampled], {"rollout.max_staleness": 1})
    pack_s = time.perf_counter() - start
    size, save_s = _saved(packed)
    n = groups * group_size * tokens
    scale = 512 / groups
    return {
        "groups": groups,
        "group_size": group_size,
        "tokens": tokens,
        "bytes": size,
        "bytes_per_token": round(size / n, 2),
        "pack_s": round(pack_s, 3),
        "save_s": round(save_s, 3),
        "paper_round_mb": round(size * scale / 1e6, 1),
        "paper_pack_and_save_s": round((pack_s + save_s) * scale, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", nargs="*", default=[])
    parser.add_argument("--groups", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    add_output_arguments(parser, "in_flight.json")
    args = parser.parse_args()
    if not args.checkpoint and args.groups < 1:
        parser.error("nothing to measure: give --checkpoint FILE ... and/or --groups N (N >= 1)")
    args.out = output_path(parser, args, "in_flight.json")
    figures = {"checkpoints": {path: checkpoint_costs(path) for path in args.checkpoint}}
    if args.groups:
        figures["synthetic"] = synthetic_costs(args.groups, args.group_size, args.tokens)
    for name, value in figures.items():
        print(name, json.dumps(value), flush=True)
    require_measured("in_flight", {k: v for k, v in figures.items() if v})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), **figures}, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
