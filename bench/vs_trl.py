"""End to end vs TRL: wall time of one RL step of dspo (vLLM engine, Lightning loop) and of TRL's GRPOTrainer in
GSPO mode (`importance_sampling_level="sequence"`) on CPU, and the cost of dspo's dynamic filter.

    .venv/bin/python bench/vs_trl.py                  # B=4 prompts x G=5, 96 new tokens, 1 warm-up + 3 steps, 2 repeats
    .venv/bin/python bench/vs_trl.py --profile        # dspo only, once: phase times + torch.profiler's top operators
    .venv/bin/python bench/vs_trl.py --steps 1 --repeats 1 --prompts 2 --group-size 2 --max-new-tokens 16  # smoke
    .venv/bin/python bench/vs_trl.py --fresh-trl-venv  # rebuild the throwaway TRL environment first

Same model, prompt tokens (checked by hash), G, B, max new tokens, temperature 1, subEM reward, beta = 0, clip
3e-4/4e-4, lr, micro-batch size, one AdamW step per round, single-turn generation (dspo: `max_turns=1`, no search).
One step = generate B x G completions, reward, forward/backward, optimizer step; dspo also pushes the weights into its
in-process vLLM engine (TRL generates with the training model). Each configuration runs in a fresh child process
(`--warmup` untimed steps, then `--steps` timed ones); the three configurations (dspo filter off = `algorithm=gspo`,
TRL, dspo filter on = `algorithm=dspo`) alternate, order reversed every other repeat, so load drift hits all of them.
Step time = median over the timed steps. No new repeat starts once it would overrun `--budget-s`. dspo's steps are
split into phases by timing the functions that do them (`bench/_dspo_side.py` `PHASES`: weight push, generation,
round building, logprob forward, objective, backward, gradient clipping, AdamW, and the rest); TRL's into generation
and the rest.
Filter cost = median rollout time per round, filter on / filter off. Both keep exactly B groups, so this is generation
per kept group at the measured keep-rate versus an unfiltered step (1/keep-rate = the cost without batched
over-sampling).

Model (`--model scripted`, default): a tiny Qwen2 (2 layers, hidden 128, Qwen2.5's 151k vocabulary, untied head)
built locally as a token-level Markov chain: both residual branches are zeroed, so the logits depend on the last token
only, and embedding/head rows encode filler "thinking" words (mean `--think-tokens`), then `<answer>yes|no|maybe
</answer>` and EOS. On the yes/no questions of data/ (HotpotQA, 2Wiki) it is right with probability `--p-correct`:
mixed rewards and a real keep-rate on both sides, while every token costs a full forward of the architecture. It never
writes `</search>` and ends with EOS right after `</answer>`, so TRL runs without stop strings (with them transformers
spends ~2 s per generate call scanning the vocabulary); for other models TRL stops at dspo's stop strings.
`--model toy`: the toy default's warm-started model and train questions (single-turn it rarely scores, so the filter
may keep nothing); `--model DIR --items FILE`: any local model and QA file.

TRL runs in its own environment (`--trl-venv`, default bench/.trl-venv, git-ignored), built by this script: a venv
whose `.pth` file adds this environment's site-packages (torch, transformers, dspo are not reinstalled), then `pip
install trl==VERSION` constrained to the versions installed here (so only accelerate is added). Reused while it
imports that TRL version. Threads: `--threads` torch threads on both sides (dspo via DSPO_NUM_THREADS as
`dspo-train`; vLLM's CPU backend then pins its own OMP threads), TRL via torch.set_num_threads.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance
from _trl_env import ensure_trl_venv, probe_trl

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # carried by the repository (data/README.md)
YES_NO_SOURCES = [DATA / "benchmarks" / f"{name}.jsonl" for name in ("hotpotqa", "2wikimultihopqa")]
STOP = ["</search>", "</answer>"]  # what dspo's agent stops a turn at (searchr1 tags)
FILLER = ["Ġthe", "Ġquestion", "Ġasks", "Ġwhether", "Ġboth", "Ġare", "Ġsame", "Ġcompare"]
FILLER += ["Ġfacts", "Ġand", "Ġcheck", "Ġwhich", "Ġone", "Ġis", "Ġolder", "Ġfirst"]
GOAL_RATIO = 0.10  # issue 17: dspo's median step (filter off) at most a tenth of TRL's
VARIANTS = {"dspo_nofilter": "dspo filter off (gspo)", "trl": "TRL GRPOTrainer, GSPO", "dspo_filter": "dspo filter on"}


# ------------------------------------------------------------------------------------------------ model and data
def build_scripted_model(directory: str, last_prompt_token: str, p_correct: float, think_tokens: float) -> str:
    """Tiny Qwen2 whose next token depends on the current token only (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspo.toy.model import build_tiny_model

    if not 0 < p_correct <= 0.5:
        raise ValueError(f"--p-correct must be in (0, 0.5], got {p_correct}")
    path = build_tiny_model(str(DATA / "tokenizers" / "qwen2.5"), directory, tie_word_embeddings=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    t = tokenizer.convert_tokens_to_ids
    filler, leave = [t(w) for w in FILLER], 1.0 / max(think_tokens, 1.0)
    chain: dict[int, dict[int, float]] = {t(last_prompt_token): {f: 1 / len(filler) for f in filler}}
    chain.update({f: {**{g: (1 - leave) / len(filler) for g in filler}, t("<"): leave} for f in filler})
    answer = {t("yes"): p_correct, t("no"): p_correct, t("maybe"): 1 - 2 * p_correct}
    chain[t("<")], chain[t("answer")], chain[t(">")] = {t("answer"): 1.0}, {t(">"): 1.0}, answer
    chain.update({a: {t("</"): 1.0} for a in answer})
    # "</answer>" as "</" "ans" "wer" ">\n": its tokens differ from the opening tag's, so the chain can end there
    chain[t("</")], chain[t("ans")], chain[t("wer")] = {t("ans"): 1.0}, {t("wer"): 1.0}, {t(">Ċ"): 1.0}
    chain[t(">Ċ")] = {tokenizer.eos_token_id: 1.0}
    with torch.no_grad():
        for layer in model.model.layers:  # residual stream = embedding of the current token
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        scale = math.sqrt(emb.shape[1])  # RMSNorm turns a one-hot row into sqrt(hidden) * one-hot
        head.zero_()
        for k, (src, nexts) in enumerate(chain.items()):
            emb[src] = 0.0
            emb[src, k] = 1.0
            for dst, p in nexts.items():
                if p > 0:
                    head[dst, k] = (math.log(p) + 30.0) / scale  # every other token: logit 0, ~e^-27 of the mass
    model.save_pretrained(path)
    return path


def resolve_workload(args: argparse.Namespace, work: Path) -> tuple[str, list[dict], list[str]]:
    """Model directory, QA rows and their prompts as dspo's agent renders them (chat template, searchr1, no tools)."""
    from transformers import AutoTokenizer

    from dspo.data.qa import load_qa
    from dspo.env.prompting import build_messages, render_prompt

    if args.model == "toy":
        root = Path(os.environ.get("DSPO_CACHE", Path.home() / ".cache" / "dspo")) / "toyworld" / "default"
        if not (root / "model" / "config.json").is_file():
            raise SystemExit(f"--model toy: no toy model in {root} (run dspo-train once), or use --model scripted")
        model, items_path = str(root / "model"), args.items or root / "world" / "train.jsonl"
        items = load_qa(str(items_path))
    else:
        items = [i for p in ([args.items] if args.items else YES_NO_SOURCES) for i in load_qa(str(p))]
        if not args.items:
            items = [i for i in items if {a.strip().lower() for a in i.golden_answers} <= {"yes", "no"}]
        model = args.model
    items = items[: args.num_questions]
    rows = [{"id": str(i), "question": q.question, "golden_answers": q.golden_answers} for i, q in enumerate(items)]
    if model == "scripted":
        tok = AutoTokenizer.from_pretrained(str(DATA / "tokenizers" / "qwen2.5"))
        ids = tok.encode(render_prompt(tok, build_messages("q", "searchr1"), "searchr1"), add_special_tokens=False)
        last = tok.convert_ids_to_tokens(ids[-1])
        model = build_scripted_model(str(work / "model"), last, args.p_correct, args.think_tokens)
    tok = AutoTokenizer.from_pretrained(model)
    return model, rows, [render_prompt(tok, build_messages(r["question"], "searchr1"), "searchr1") for r in rows]


# ------------------------------------------------------------------------------------------------ runs
# Settings of both dspo configurations; everything the toy experiment would set is given here (`~experiment`).
# The BM25 retriever over 50 passages exists because the environment needs one: with max_turns=1 nobody searches.
DSPO_FIXED = (
    "~experiment prepare=none model=local model.attn_implementation=sdpa data.val_files=null data.test_files=null "
    "retriever=bm25 retriever.show_progress=false algorithm.num_minibatches=1 algorithm.kl_coef=0.0 rollout=vllm "
    "rollout.agent.max_turns=1 rollout.agent.max_total_tokens=2048 rollout.agent.tag_format=searchr1 "
    "rollout.agent.top_p=1.0 optimizer.warmup_steps=0 optimizer.weight_decay=0.01 optimizer.max_grad_norm=1.0 "
    "trainer.limit_val_batches=0 trainer.enable_progress_bar=false +trainer.enable_checkpointing=false logger=none "
    "~callbacks.checkpoint ~callbacks.best ~callbacks.lr_monitor ~callbacks.progress "
    "callbacks.rollout.sample_every_n_rounds=0 "
    "run_test=false"
)


def dspo_spec(args: argparse.Namespace, work: Path, model: str, filtered: bool, seed: int) -> dict:
    a = args
    overrides = [
        *DSPO_FIXED.split(),
        f"model.path={model}",
        f"data.train_files=[{work / 'items.jsonl'}]",
        f"retriever.index={work / 'bm25'}",
        f"retriever.corpus={work / 'corpus.jsonl'}",
        f"algorithm={'dspo' if filtered else 'gspo'}",  # mixed_outcome filter / none; both sequence-level, same clip
        f"algorithm.group_size={a.group_size}",
        f"algorithm.batch_groups={a.prompts}",
        f"algorithm.micro_batch_size={a.micro_batch_size}",
        f"algorithm.temperature={a.temperature}",
        f"algorithm.initial_keep_rate={a.initial_keep_rate}",
        f"rollout.agent.max_new_tokens_per_turn={a.max_new_tokens}",
        f"optimizer.lr={a.lr}",
        f"trainer.max_steps={a.warmup + a.steps}",
        f"+callbacks.rollout.export_dir={work / 'export'}",
        f"output_dir={work / 'run'}",
        f"seed={seed}",
    ]
    return {"overrides": overrides, "threads": a.threads}


def trl_spec(args: argparse.Namespace, model: str, rows: list[dict], prompts: list[str], seed: int) -> dict:
    keys = ("group_size", "max_new_tokens", "micro_batch_size", "temperature", "lr", "warmup", "steps", "threads")
    # The scripted model ends with EOS right after "</answer>" and never writes "</search>": stop strings would
    # change nothing but cost transformers ~2 s per generate call (a scan of the 151k vocabulary), so it runs without.
    stop = [] if args.model == "scripted" else STOP
    return {
        **{k: getattr(args, k) for k in keys},
        **{"model": model, "prompts": prompts, "golden_answers": [r["golden_answers"] for r in rows]},
        **{"prompts_per_step": args.prompts, "stop": stop, "clip_low": 3e-4, "clip_high": 4e-4, "seed": seed},
    }


def prepare_work(work: Path, rows: list[dict]) -> None:
    """The QA file and a 50-passage corpus (the environment needs a retriever; with max_turns=1 nobody searches)."""
    (work / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(DATA / "hotpotqa_dev500" / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        corpus = [next(f).rstrip("\n") for _ in range(50)]
    (work / "corpus.jsonl").write_text("\n".join(corpus) + "\n")


def run_child(python: str, script: str, spec: dict, work: Path, tag: str, timeout: float) -> dict:
    spec_path, out_path, log_path = work / f"{tag}.spec.json", work / f"{tag}.result.json", work / f"{tag}.log"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [python, str(ROOT / "bench" / script), str(spec_path), str(out_path)]
    tic = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            code = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            code = code.returncode
    except subprocess.TimeoutExpired:
        code = -1
    wall = time.perf_counter() - tic
    if code != 0 or not out_path.is_file():
        tail = log_path.read_text()[-2000:]
        print(f"[{tag}] FAILED (exit {code}, {wall:.0f} s); log {log_path}:\n{tail}", flush=True)
        return {"error": f"exit {code}", "log_tail": tail, "wall_s": wall, "steps": []}
    return {**json.loads(out_path.read_text()), "wall_s": wall}


def run_variant(args: argparse.Namespace, name: str, rep: int, work: Path, model: str, rows: list, prompts: list):
    seed, tag, limit = args.seed + rep, f"{name}_{rep}", args.child_timeout_s
    if name == "trl":
        spec = trl_spec(args, model, rows, prompts, seed)
        result = run_child(str(args.trl_venv / "bin" / "python"), "_trl_side.py", spec, work, tag, limit)
    else:
        spec = dspo_spec(args, work, model, name == "dspo_filter", seed)
        result = run_child(sys.executable, "_dspo_side.py", spec, work, tag, limit)
    shown = ", ".join(f"{s['step_s']:.2f}" for s in result["steps"][args.warmup :]) or "-"
    error = f" ({result['error']})" if result.get("error") else ""
    print(f"[repeat {rep}] {VARIANTS[name]:26} steps (s): {shown}; child {result['wall_s']:.0f} s{error}", flush=True)
    return {**result, "variant": name, "repeat": rep}


def summarize(runs: list[dict], warmup: int, batch_groups: int) -> dict:
    steps = [s for r in runs for s in r["steps"][warmup:]]
    if not steps:
        return {"steps": 0}
    out: dict = {"steps": len(steps), "step_s_min": min(s["step_s"] for s in steps)}
    out["step_s_max"] = max(s["step_s"] for s in steps)
    out.update({f"{k}_median": statistics.median(s[k] for s in steps) for k in steps[0]})
    if "groups_sampled" in steps[0]:  # every round keeps exactly B groups
        out["keep_rate_pooled"] = len(steps) * batch_groups / max(sum(s["groups_sampled"] for s in steps), 1)
    out["per_repeat_step_s"] = [statistics.median(s["step_s"] for s in r["steps"][warmup:]) for r in runs]
    return out


def build_report(summary: dict, runs: dict) -> dict:
    def med(name: str, key: str) -> float:
        return summary.get(name, {}).get(f"{key}_median", float("nan"))

    ratio = {k: med(k, "step_s") / med("trl", "step_s") for k in ("dspo_nofilter", "dspo_filter")}
    from _dspo_side import PHASES  # imports Lightning: only once there is something to report

    phase_keys = ["step_s", *PHASES, "other_s", "train_s"]
    filter_cost = med("dspo_filter", "generate_s") / med("dspo_nofilter", "generate_s")
    digests = {k: {r.get("prompt_digest") for r in rs if r.get("prompt_digest")} for k, rs in runs.items()}
    per_repeat = [summary.get(k, {}).get("per_repeat_step_s", []) for k in ("dspo_nofilter", "trl")]
    return {
        "dspo_step_s": med("dspo_nofilter", "step_s"),
        "trl_step_s": med("trl", "step_s"),
        "ratio": ratio["dspo_nofilter"],  # dspo (filter off) / TRL, medians of the timed steps
        "goal_ratio_met": bool(ratio["dspo_nofilter"] <= GOAL_RATIO) if math.isfinite(ratio["dspo_nofilter"]) else None,
        "phases": {
            "dspo_nofilter": {k: med("dspo_nofilter", k) for k in phase_keys},
            "trl": {k: med("trl", k) for k in ("step_s", "generate_s", "train_s")},
        },
        "ratio_dspo_nofilter_over_trl": ratio["dspo_nofilter"],
        "ratio_dspo_filter_over_trl": ratio["dspo_filter"],
        "ratio_per_repeat": [d / t for d, t in zip(*per_repeat)],
        "filter_cost": filter_cost,
        "filter_keep_rate": summary.get("dspo_filter", {}).get("keep_rate_pooled", float("nan")),
        "filter_cost_goal_met": bool(filter_cost <= 1.5) if math.isfinite(filter_cost) else None,
        "same_prompt_tokens": len(set().union(*digests.values())) == 1 and all(digests.values()),
        "phase_seams": PHASES,  # what each phase times: results of other seams are not comparable (issue 40)
    }


def finite(x: Any) -> Any:
    """NaN/inf -> None, so that the JSON file is strict JSON."""
    if isinstance(x, dict | list):
        return {k: finite(v) for k, v in x.items()} if isinstance(x, dict) else [finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def print_table(summary: dict, report: dict) -> None:
    head = ("variant", "n", "step s", "[min, max]", "gen s", "train s", "traj", "tok/traj", "reward", "keep")
    print("\n{:28} {:>2} {:>7} {:>15} {:>6} {:>7} {:>5} {:>8} {:>6} {:>5}".format(*head))
    for name, s in summary.items():
        if not s.get("steps"):
            print(f"{VARIANTS[name]:28} no measured steps")
            continue
        span = f"[{s['step_s_min']:.2f}, {s['step_s_max']:.2f}]"
        print(
            f"{VARIANTS[name]:28} {s['steps']:2d} {s['step_s_median']:7.2f} {span:>15} {s['generate_s_median']:6.2f} "
            f"{s['train_s_median']:7.2f} {s['trajectories_median']:5.0f} {s['tokens_per_traj_median']:8.1f} "
            f"{s['reward_mean_median']:6.2f} {s.get('keep_rate_pooled', float('nan')):5.2f}"
        )
    verdict = {True: "met", False: "NOT met", None: "n/a"}
    repeats = ", ".join(f"{x:.2f}" for x in report["ratio_per_repeat"])
    print(
        f"\ndspo (filter off) / TRL step time: {report['ratio_dspo_nofilter_over_trl']:.2f}x "
        f"(goal <= {GOAL_RATIO}x: {verdict[report['goal_ratio_met']]}); per repeat: {repeats}"
    )
    print_phases(report["phases"]["dspo_nofilter"])
    print(f"dspo (filter on)  / TRL step time: {report['ratio_dspo_filter_over_trl']:.2f}x")
    keep = report["filter_keep_rate"]
    print(
        f"filter cost, generation per kept group vs an unfiltered step: {report['filter_cost']:.2f}x at keep-rate "
        f"{keep:.2f} (goal <= 1.5x: {verdict[report['filter_cost_goal_met']]}; 1/keep-rate = {1 / keep:.2f})"
    )
    print(f"same prompt tokens on both sides: {report['same_prompt_tokens']}")


def print_phases(phases: dict[str, float]) -> None:
    from _dspo_side import PHASES

    step = phases.get("step_s", float("nan"))
    print("\ndspo step (filter off), median seconds per phase:")
    for key in [*PHASES, "other_s"]:
        value = phases.get(key, float("nan"))
        label = PHASES.get(key, "the rest: Lightning's loop, logging, Python")
        print(f"  {key:12} {value:7.3f} s {value / step:6.1%}  {label}")


def profile(args: argparse.Namespace, work: Path, model: str, measured: dict) -> None:
    """One dspo child (filter off) under torch.profiler: its phase times and the top operators by self CPU time."""
    spec = {**dspo_spec(args, work, model, False, args.seed), "profile": True, "profile_rows": 25}
    result = run_child(sys.executable, "_dspo_side.py", spec, work, "profile", args.child_timeout_s)
    steps = result["steps"][args.warmup :]
    error = "\n".join(filter(None, [result.get("error"), result.get("log_tail")]))
    require_measured("vs_trl", {"profile.measured_steps": len(steps) or None}, {"profile": error})
    phases = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    print_phases(phases)
    print(
        "\ntop operators by self CPU time (whole run, warm-up and generation included; profiler overhead inflates "
        "small ops):"
    )
    for op in result.get("top_ops", []):
        print(f"  {op['op'][:48]:48} {op['calls']:8d} calls {op['self_cpu_s']:8.2f} s {op['share']:6.1%}")
    print("\nthe same by input shapes:")
    for op in result.get("top_ops_by_shape", []):
        head = f"  {op['op'][:32]:32} {op['calls']:6d} calls {op['self_cpu_s']:7.2f} s {op['share']:6.1%}"
        print(f"{head}  {op['shapes']}")
    out = args.out.with_name("profile_dspo_step.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    from _dspo_side import PHASES

    record = {"measured": measured, "config": vars_json(args), "phases": phases, "phase_seams": PHASES, **result}
    out.write_text(json.dumps(finite(record), indent=1) + "\n")
    print(f"\nwrote {out}")
    require_measured(
        "vs_trl",
        {
            "profile.phases": phases,
            "profile.top_ops": result.get("top_ops"),
            "profile.top_ops_by_shape": result.get("top_ops_by_shape"),
        },
    )


def vars_json(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="scripted", help="scripted | toy | a local model directory")
    add("--items", type=Path, help="QA file (default: the yes/no questions of data/benchmarks)")
    add("--num-questions", type=int, default=64)
    add("--prompts", type=int, default=4, help="B: prompts (kept groups) per step")
    add("--group-size", type=int, default=5, help="G")
    add("--max-new-tokens", type=int, default=96)
    add("--micro-batch-size", type=int, help="sequences per forward/backward (default 10 if it divides B*G, else B*G)")
    add("--temperature", type=float, default=1.0)
    add("--lr", type=float, default=1e-6)
    add("--initial-keep-rate", type=float, default=0.5, help="dspo's over-sampling prior (algorithm default)")
    add("--p-correct", type=float, default=0.25, help="scripted model: P(right answer), at most 0.5")
    add("--think-tokens", type=float, help="scripted model: mean filler tokens before the answer (default N/2)")
    add("--warmup", type=int, default=1, help="unmeasured steps per child process (at least 1)")
    add("--steps", type=int, default=3, help="measured steps per child process")
    add("--repeats", type=int, default=2, help="alternations of the configurations")
    add("--threads", type=int, default=os.cpu_count() or 1, help="torch threads on both sides")
    add("--seed", type=int, default=0)
    add("--skip-filter", action="store_true", help="no filter-on runs (no filter cost)")
    add("--trl-version", default="1.16.0")
    add("--trl-venv", type=Path, default=ROOT / "bench" / ".trl-venv")
    add("--fresh-trl-venv", action="store_true", help="rebuild the TRL environment")
    add(
        "--trl-if-installed",
        action="store_true",
        help="use the TRL environment only if it already imports trl==--trl-version; else skip the TRL side (no "
        "install, no ratio): the suite's smoke run",
    )
    add("--child-timeout-s", type=float, default=400.0)
    add("--keep-work", action="store_true", help="keep the work dir (model, child logs) instead of deleting it")
    add("--budget-s", type=float, default=540.0, help="start no repeat that would end later than this")
    add_output_arguments(parser, "vs_trl.json")
    add(
        "--profile",
        action="store_true",
        help="profile one dspo run instead (writes profile_dspo_step.json beside --out)",
    )
    args = parser.parse_args(argv)
    b, g = args.prompts, args.group_size
    args.micro_batch_size = args.micro_batch_size or (10 if (b * g) % 10 == 0 else b * g)
    if (b * g) % args.micro_batch_size or args.warmup < 1:
        parser.error(f"--micro-batch-size must divide B*G = {b * g} and --warmup must be >= 1")
    args.think_tokens = args.think_tokens or args.max_new_tokens / 2
    args.out = output_path(parser, args, "vs_trl.json")
    return args


def main() -> None:
    args = parse_args()
    measured = provenance()
    b, g = args.prompts, args.group_size
    load_before, t0 = os.getloadavg(), time.perf_counter()
    if args.profile:
        work = Path(tempfile.mkdtemp(prefix="dspo_bench_profile_"))
        model, rows, _ = resolve_workload(args, work)
        prepare_work(work, rows)
        profile(args, work, model, measured)
        shutil.rmtree(work, ignore_errors=True)
        return

    trl_info = trl_environment(args)
    if trl_info:
        print(
            f"TRL environment {args.trl_venv}: trl {trl_info['trl']}, accelerate {trl_info['accelerate']}; torch "
            f"{trl_info['torch']}, transformers {trl_info['transformers']} from dspo's environment",
            flush=True,
        )
    work = Path(tempfile.mkdtemp(prefix="dspo_bench_vs_trl_"))
    model, rows, prompts = resolve_workload(args, work)
    prepare_work(work, rows)
    print(
        f"model {model}; {len(rows)} questions; B={b} x G={g}, {args.max_new_tokens} new tokens, "
        f"micro-batch {args.micro_batch_size}; work dir {work}",
        flush=True,
    )

    order = ["dspo_nofilter"] + (["trl"] if trl_info else []) + ([] if args.skip_filter else ["dspo_filter"])
    runs: dict[str, list[dict]] = {k: [] for k in order}
    start = time.perf_counter()
    for rep in range(args.repeats):
        now = time.perf_counter()
        if rep and now - t0 + (now - start) / rep > args.budget_s:
            print(f"stopping after {rep} repeats: another would end past --budget-s {args.budget_s:.0f}", flush=True)
            break
        for name in order if rep % 2 == 0 else order[::-1]:  # A B C, C B A, ...
            runs[name].append(run_variant(args, name, rep, work, model, rows, prompts))

    summary = {k: summarize([r for r in rs if r["steps"]], args.warmup, b) for k, rs in runs.items()}
    report = build_report(summary, runs)
    print_table(summary, report)
    env = {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()}
    env.update({k: v for k, v in (trl_info or {}).items() if not k.endswith("_file")})
    config = vars_json(args)
    record = {"measured": measured, "config": config, "environment": env, **report, "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(finite(record), indent=1) + "\n")
    print(f"\nwrote {args.out}" + (f"; child logs in {work}" if args.keep_work else ""))
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    if not trl_info:
        print(f"TRL side SKIPPED: TRL {args.trl_version} is not installed in {args.trl_venv} (--trl-if-installed)")
    check(report, summary, runs)


def trl_environment(args: argparse.Namespace) -> dict | None:
    """The TRL environment's versions; None when --trl-if-installed finds no TRL there (the side is skipped)."""
    if not args.trl_if_installed:
        return ensure_trl_venv(args.trl_venv, args.trl_version, args.fresh_trl_venv)
    python = args.trl_venv / "bin" / "python"
    info = probe_trl(python) if python.exists() else None
    if info is None or info["trl"] != args.trl_version:
        print(
            f"TRL side SKIPPED: trl=={args.trl_version} is not installed in {args.trl_venv} (--trl-if-installed; "
            "run without it to build that environment). Only dspo's side is measured: no ratio.",
            flush=True,
        )
        return None
    return ensure_trl_venv(args.trl_venv, args.trl_version, False)


def check(report: dict, summary: dict, runs: dict) -> None:
    """Exit non-zero when a configuration that ran measured no step, or a figure of it is NaN (bench/_checks.py)."""
    figures: dict = {f"{name}.measured_steps": summary[name].get("steps") or None for name in runs}
    figures["dspo_step_s"] = report["dspo_step_s"]
    figures["phases.dspo_nofilter"] = report["phases"]["dspo_nofilter"]
    if "trl" in runs:
        figures.update({k: report[k] for k in ("trl_step_s", "ratio")})
        figures["same_prompt_tokens"] = report["same_prompt_tokens"] or None  # both sides must see the same tokens
    if "dspo_filter" in runs:
        figures.update({k: report[k] for k in ("filter_cost", "filter_keep_rate")})
    errors = {
        f"{r['variant']} (repeat {r['repeat']})": "\n".join(filter(None, [r.get("error"), r.get("log_tail")]))
        for rs in runs.values()
        for r in rs
    }
    require_measured("vs_trl", figures, errors, hint="the side's log tail is above; bench/_dspo_side.py times dspo")


if __name__ == "__main__":
    main()
