"""`python -m dspo.toy.rebuild`: how a sampled 2-hop rollout is classified, and where the rebuild is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspo.toy.rebuild import TWO_HOP_OUTCOMES, two_hop_outcome
from dspo.types import Trajectory


def _rollout(searches: int, answer: str | None, reward: float) -> Trajectory:
    return Trajectory([1], [2], [1], [0.0], reward=reward, answer=answer, num_tool_calls=searches)


@pytest.mark.parametrize(
    ("searches", "answer", "reward", "expected"),
    [
        (0, "Sarunstan", 1.0, "no_search"),  # a lucky guess is still a guess
        (1, " Lipindale ", 0.0, "one_search_answered_intermediate"),
        (1, "Lipindaleburg", 0.0, "one_search_other"),
        (1, None, 0.0, "one_search_other"),
        (2, "Sarunstan", 1.0, "two_searches_right"),
        (3, "Lipindale", 0.0, "two_searches_wrong"),
    ],
)
def test_two_hop_outcome(searches, answer, reward, expected) -> None:
    assert two_hop_outcome(_rollout(searches, answer, reward), intermediate="Lipindale") == expected
    assert expected in TWO_HOP_OUTCOMES


def test_report_refuses_a_folder_without_a_model(tmp_path, capsys) -> None:
    from dspo.toy.rebuild import main

    with pytest.raises(SystemExit):
        main(["--report", str(tmp_path), "--workdir", str(tmp_path / "work")])
    assert f"--report {tmp_path}: not a model folder (no config.json)" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # refused before building anything


def test_rebuild_writes_outside_the_repository_unless_asked(capsys) -> None:
    """`python -m dspo.toy.rebuild` writes outputs/toy_warmstart; the tracked data/toy_warmstart/ only with
    --update-shipped (the slow rebuild test passes --output DIR)."""
    from dspo.process.resources import data_dir
    from dspo.toy.rebuild import parse_args

    assert Path(parse_args([]).output) == Path("outputs") / "toy_warmstart"
    assert Path(parse_args(["--update-shipped"]).output) == data_dir() / "toy_warmstart"
    assert parse_args(["--output", "/tmp/rebuilt"]).output == "/tmp/rebuilt"
    with pytest.raises(SystemExit):
        parse_args(["--output", "/tmp/rebuilt", "--update-shipped"])
    assert "--output and --update-shipped" in capsys.readouterr().err


def test_the_deep_warm_start_ships_its_model_beside_the_default() -> None:
    """experiment=toy_deep's warm start (a fine-tune of the shipped model, same tokenizer): --update-shipped writes
    data/toy_deep_warmstart (model/ only), never data/toy_warmstart."""
    from dspo.process.resources import data_dir
    from dspo.toy.rebuild import parse_args

    args = parse_args(["--update-shipped", "experiment=toy_deep"])
    assert Path(args.output) == data_dir() / "toy_deep_warmstart" and args.parts == ("model",)
    assert Path(parse_args(["experiment=toy_deep"]).output) == Path("outputs") / "toy_deep_warmstart"
    assert parse_args([]).parts == ("tokenizer", "model")
