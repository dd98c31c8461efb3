"""`meshd ask --speculate`: the flag reaches the request, and the figures line gives the acceptance rate."""

from __future__ import annotations

import pytest

from meshd.cli import build_parser, build_request, print_figures
from meshd.client.ask import AskResult


@pytest.mark.parametrize(("argv", "mode"), [([], "off"), (["--speculate", "ngram"], "ngram")])
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
