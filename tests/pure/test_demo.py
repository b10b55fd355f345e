"""What a new user reads first: the demo's answer and the shell fake's, whole sentences."""

from __future__ import annotations

from nixl_twisted import demo
from nixl_twisted.testing import __main__ as fakes_command
from nixl_twisted.testing import answers
from nixl_twisted.testing.fake import DEFAULT_TEXT


def test_by_default_the_demo_and_the_shell_fake_answer_one_whole_sentence() -> None:
    for parser in (demo.arguments(), fakes_command.arguments()):
        tokens = parser.parse_args([]).tokens
        said = "".join(answers.words(DEFAULT_TEXT, tokens))
        assert said.rstrip() == DEFAULT_TEXT  # (ends on its full stop, begins no other)
