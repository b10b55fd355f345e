"""What a new user reads first: the demo's answer and the shell fake's, whole sentences."""

from __future__ import annotations

from nixl_twisted import demo
from nixl_twisted.testing import __main__ as fakes_command
from nixl_twisted.testing import answers
from nixl_twisted.testing.fake import DEFAULT_TEXT, FakeVLLM


def test_by_default_the_demo_and_the_shell_fake_answer_one_whole_sentence() -> None:
    for parser in (demo.arguments(), fakes_command.arguments()):
        tokens = parser.parse_args([]).tokens
        said = "".join(answers.words(DEFAULT_TEXT, tokens))
        assert said.rstrip() == DEFAULT_TEXT  # (ends on its full stop, begins no other)


def test_the_shell_fakes_have_the_capacity_their_options_say() -> None:
    parse = fakes_command.arguments().parse_args
    capped = fakes_command.fake_options(
        parse(["--max-num-seqs", "4", "--max-num-queued-reqs", "9"])
    )
    assert (capped["max_num_seqs"], capped["max_num_queued_reqs"]) == (4, 9)
    unlimited = fakes_command.fake_options(parse([]))
    assert (unlimited["max_num_seqs"], unlimited["max_num_queued_reqs"]) == (0, None)
    # Every option is a FakeVLLM field: start_cluster would refuse any other.
    assert set(unlimited) <= set(FakeVLLM.__dataclass_fields__)
