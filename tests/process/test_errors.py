"""Issue 32 (2): a user mistake ends every CLI with one or two lines (exit status 2), not a traceback, and is found
before slow work. The CLIs run in-process (their Hydra entry points, as the console scripts call them)."""

from __future__ import annotations

import sys
import time

import pytest

from dspo.process.errors import user_errors, user_message
from dspo.testing import build_toy_lm


@pytest.fixture()
def cli(tmp_path, monkeypatch, capsys):
    """`cli(main, "dspo-eval", *overrides)`: a Hydra entry point run in-process -> (exit code, stderr, seconds)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSPO_OUTPUTS", str(tmp_path / "outputs"))
    monkeypatch.setenv("DSPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DSPO_VERBOSE", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def run(main, name: str, *overrides: str) -> tuple[int, str, float]:
        monkeypatch.setattr(sys, "argv", [name, *overrides])
        capsys.readouterr()
        start = time.perf_counter()
        with pytest.raises(SystemExit) as exit_info:
            main()
        return exit_info.value.code, capsys.readouterr().err, time.perf_counter() - start

    return run


def _eval_main():
    from dspo.eval.cli import main

    return main()


def _train_main():
    from dspo.train import main

    return main()


def _rollout_main():
    from dspo.rollout.cli import main

    return main()


def _index_main():
    from dspo.search.cli import index_main

    return index_main()


def _serve_main():
    from dspo.search.cli import serve_main

    return serve_main()


@pytest.mark.parametrize(
    ("main", "name", "overrides", "expected"),
    [
        (_eval_main, "dspo-eval", ["model.path=missing_model"], "model.path=missing_model: no config.json there"),
        (_eval_main, "dspo-eval", ["ckpt_path=missing.ckpt"], "ckpt_path=missing.ckpt: no such checkpoint"),
        (_train_main, "dspo-train", ["trainer.val_check_interval=3"], "is not a multiple of algorithm.num_minibatches"),
        (_train_main, "dspo-train", ["prepare=none", "algorithm.group_size=1"], "algorithm.group_size: must be >= 2"),
        (_train_main, "dspo-train", ["ckpt_path=last", "run_name=none_such"], "ckpt_path=last: no checkpoint matches"),
        (_train_main, "dspo-train", ["imports=[no_such_module]"], "imports: module 'no_such_module' failed to import"),
        (_rollout_main, "dspo-rollout", [], "model.path is not set"),
        (_index_main, "dspo-index", ["corpus=missing.jsonl", "output=idx"], "corpus file not found: missing.jsonl"),
        (_serve_main, "dspo-serve", ["index=missing_index"], "missing_index"),
    ],
)
def test_user_mistakes_end_in_a_message_not_a_traceback(cli, main, name, overrides, expected) -> None:
    code, err, _ = cli(main, name, *overrides)
    assert code == 2, err
    assert f"{name}: error: " in err and expected in err, err
    assert "Traceback" not in err and "e.g. " in err  # an example of a right call follows the message
    assert len(err.strip().splitlines()) <= 3, err


def test_a_plain_model_without_an_index_is_refused_before_the_model_loads(cli, tmp_path) -> None:
    """The README's `dspo-eval model.path=DIR` on a Hugging Face model (no dspo record): the missing index is named
    before the engine starts (it used to fail after 14.5 s of model loading, with a 25-line traceback)."""
    model = build_toy_lm(str(tmp_path / "plain"))
    code, err, seconds = cli(_eval_main, "dspo-eval", f"model.path={model}")
    assert code == 2 and "retriever.index is not set" in err and "retriever=remote" in err, err
    assert seconds < 10


def test_verbose_shows_the_stack(cli, monkeypatch) -> None:
    monkeypatch.setenv("DSPO_VERBOSE", "1")
    code, err, _ = cli(_eval_main, "dspo-eval", "model.path=missing_model")
    assert code != 2 and "dspo-eval: error:" not in err


def test_only_dspo_validation_errors_count_as_user_mistakes() -> None:
    from dspo.algorithms.config import AlgorithmConfig

    try:
        AlgorithmConfig(group_size=1)
    except ValueError as error:
        assert user_message(error) == "algorithm.group_size: must be >= 2 for group-normalized advantages, got 1"
    try:
        int("not a number")  # a ValueError raised outside dspo: a bug to report, with its stack
    except ValueError as error:
        assert user_message(error) is None
    with pytest.raises(RuntimeError), user_errors("dspo-x", "dspo-x a=1"):
        raise RuntimeError("an unexpected failure keeps its stack")


BROKEN_PLUGIN = '''
class BrokenData:
    """A data module whose constructor has a bug: the user's to fix, at the line the stack names."""

    def __init__(self, **settings):
        self.settings = settings
        self.size = settings.get("nothing").size  # the bug: None has no attribute `size`
'''


@pytest.mark.parametrize("verbose", [False, True])
def test_a_bug_in_a_plugins_constructor_keeps_its_traceback(cli, tmp_path, monkeypatch, verbose) -> None:
    """Issue 39 (5): an exception inside a target's constructor is a bug, not a configuration mistake: the stack is
    shown and names the plug-in's line (it used to be one `error:` line with exit status 2, the line lost)."""
    (tmp_path / "broken_plugin.py").write_text(BROKEN_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    if verbose:
        monkeypatch.setenv("DSPO_VERBOSE", "1")
    overrides = ["prepare=none", "imports=[broken_plugin]", "data._target_=broken_plugin.BrokenData"]
    code, err, _ = cli(_train_main, "dspo-train", *overrides)
    assert code != 2 and "dspo-train: error:" not in err, err
    assert "AttributeError" in err and "'NoneType' object has no attribute 'size'" in err, err
    assert 'broken_plugin.py", line 7, in __init__' in err, err


def test_configuration_mistakes_at_instantiation_stay_one_line(cli, tmp_path, monkeypatch) -> None:
    """A target that does not exist and a key the target does not take are the config's: one line, exit status 2."""
    (tmp_path / "broken_plugin.py").write_text(BROKEN_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err, _ = cli(_train_main, "dspo-train", "prepare=none", "data._target_=broken_plugin.NoSuchData")
    assert code == 2 and "Traceback" not in err and "NoSuchData" in err, err
    code, err, _ = cli(_train_main, "dspo-train", "prepare=none", "+module.no_such_setting=1")
    assert code == 2 and "Traceback" not in err and "no_such_setting" in err, err


def test_an_error_dspo_did_not_raise_on_purpose_is_a_bug() -> None:
    """Only a `raise` statement of dspo is its validation: a KeyError of a subscript in dspo's code is a bug."""
    from dspo.toy.sources import chain_types

    try:
        chain_types({})  # metadata["entity_type"]: a lookup that fails, not a message written for the user
    except KeyError as error:
        assert user_message(error) is None
