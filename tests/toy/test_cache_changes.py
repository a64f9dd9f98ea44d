"""The line before a warm-start rebuild names the keys that changed its cache key and the expected duration, from
what the cached and shipped builds' manifests recorded (`dspo.toy.cache_changes`); the SFT's periodic line."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path

from dspo.toy.cache_changes import expected_seconds, rebuild_notice, sft_steps
from dspo.toy.sft import sft_line
from dspo.toy.warmstart import _LATER_FIELDS, MANIFEST, WarmStartConfig, config_key

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "toy_warmstart" / "model" / MANIFEST


def _wanted(manifest: dict, config: WarmStartConfig) -> dict:
    return {**manifest["key"], "config": config_key(config)}


def test_an_agent_override_is_named_with_the_shipped_builds_duration():
    """`rollout.agent.max_turns=4` on the toy: the warm start's agent key follows it. The shipped build took 7.9 s
    of rendering + 606.8 s of SFT (its manifest): about 11 min, on the 2-core CPU it was built on."""
    shipped = json.loads(SHIPPED.read_text())
    recorded = WarmStartConfig(**shipped["config"])
    assert config_key(recorded) == shipped["key"]["config"]  # the manifest records every input of the key
    config = copy.deepcopy(recorded)
    config.agent["max_turns"] = 4
    candidates = {"the shipped one": shipped}
    notice, seconds = rebuild_notice(_wanted(shipped, config), asdict(config), candidates, _LATER_FIELDS)
    assert seconds == shipped["stats"]["render_seconds"] + shipped["stats"]["train_seconds"]
    assert notice == (
        "about 11 min on a 2-core CPU: it differs from the shipped one in prepare.toyworld.config.agent.max_turns "
        "(3 -> 4) (the warm start's agent keys follow rollout.agent.* and env.tools.search.topk: experiment=toy)"
    )


def test_the_nearest_build_is_named_and_its_time_scaled_by_sft_steps():
    shipped = json.loads(SHIPPED.read_text())
    cached = copy.deepcopy(shipped)
    cached["config"].update(steps=500, lr=2e-3)  # a cached build of another recipe, timed on 4 cores
    cached["stats"].update(render_seconds=10.0, train_seconds=130.0, cores=4)
    config = WarmStartConfig(**{**cached["config"], "steps": 1000})  # 3 changes from the shipped one, 2 from it
    wanted = {**_wanted(cached, config), "world": "another world"}
    candidates = {"the shipped one": shipped, "the cached one": cached}
    notice, seconds = rebuild_notice(wanted, asdict(config), candidates, _LATER_FIELDS)
    assert sft_steps(cached["config"]) == 800 + 500 and sft_steps(asdict(config)) == 1800
    assert seconds == 10.0 + 130.0 * 1800 / 1300 == 190.0
    assert notice == (
        "about 4 min on a 4-core CPU: it differs from the cached one in prepare.toyworld.config.steps (500 -> 1000), "
        "the toy world's files (prepare.toyworld.world_config)"
    )


def test_a_build_that_predates_a_field_compares_it_at_its_default_and_no_record_is_said():
    shipped = json.loads(SHIPPED.read_text())
    assert "deep_demos" not in shipped["config"] or shipped["config"]["deep_demos"] == 0
    config = WarmStartConfig(**{**shipped["config"], "deep_demos": 3})
    notice, _ = rebuild_notice(_wanted(shipped, config), asdict(config), {"it": shipped}, _LATER_FIELDS)
    assert "prepare.toyworld.config.deep_demos (0 -> 3)" in notice and "sources" not in notice
    assert rebuild_notice({}, {}, {"none": None}, {}) == (
        "no earlier build recorded to compare with (a new cache)",
        None,
    )
    assert expected_seconds({"config": {}}, {}) is None  # a manifest without timings: no duration promised


def test_the_sft_line_shows_the_step_the_recent_loss_and_the_time_left():
    losses = [4.0] * 380 + [1.0] * 20
    line = sft_line(400, 2800, losses, elapsed=90.0)
    # 2400 steps left at 90 s / 400 = 540 s
    assert line == "warm start (SFT): step 400/2800 (14 %), loss 1.000, 1m 30s so far, about 9m 00s left"
