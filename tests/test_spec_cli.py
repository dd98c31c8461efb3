"""`meshd ask --speculate`: the flag reaches the request, and the figures line gives the acceptance rate;
`meshd serve --draft-model` refuses a draft model of another vocabulary in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.cli.ask import build_request
from meshd.cli.figures import print_figures
from meshd.cli.main import main
from meshd.cli.parser import build_parser
from meshd.client.ask import AskResult

# meshd serve processes with draft models
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("argv", "mode"), [([], "off"), (["--speculate", "ngram"], "ngram"),
                                            (["--speculate", "model"], "model")])
def test_speculate_flag_reaches_the_request(argv: list[str], mode: str) -> None:
    args = build_parser().parse_args(["ask", *argv, "hello"])
    assert build_request(args).speculate == mode


def test_an_unknown_speculation_mode_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["ask", "--speculate", "medusa", "hello"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--speculate" in err


def test_figures_give_the_acceptance_rate_only_when_drafting(capsys: pytest.CaptureFixture[str]) -> None:
    result = AskResult(prompt_tokens=[1], tokens=[2, 3], reason="eog", drafted=8, accepted=6)
    result.first_token_at = result.started + 0.1
    print_figures(result)
    assert "6/8 drafts accepted (75%)" in capsys.readouterr().err
    result.drafted = result.accepted = 0
    print_figures(result)
    assert "drafts" not in capsys.readouterr().err


def test_a_draft_model_of_another_vocabulary_is_refused_in_one_line(
        tiny_models: dict[str, Path], tiny_draft_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the tiny byte-level vocabulary against the default model's, which the draft model has
    code = main(["serve", "--model", str(tiny_models["llama-gqa-tied"]), "--draft-model", str(tiny_draft_model),
                 "--threads", "1", "--max-sessions", "2", "--session-tokens", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and "has another vocabulary" in err[0] and "Traceback" not in err[0], err


def test_a_draft_model_on_a_stage_before_the_tail_is_refused_in_one_line(
        default_model: Path, tiny_draft_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--model", str(default_model), "--layers", "0:10", "--draft-model", str(tiny_draft_model),
                 "--threads", "1", "--max-sessions", "2", "--session-tokens", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and "drafts at the tail" in err[0], err
