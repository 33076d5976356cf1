"""The Syn-GRPO output template: parsing and the syn_format reward."""

import pytest

from vlrl.rewards import get_reward
from vlrl.rewards.syn import parse_syn_response, syn_format

GOOD = "<think>the box is left</think><diversity>0.4</diversity><description>a striped blue sky</description><answer>[1, 2, 3, 4]</answer>"


def test_a_well_formed_response_parses_into_its_four_parts():
    parsed = parse_syn_response(GOOD + "<|im_end|>")
    assert parsed.well_formed
    assert (parsed.think, parsed.diversity, parsed.description, parsed.answer) == (
        "the box is left", 0.4, "a striped blue sky", "[1, 2, 3, 4]")
    assert syn_format(GOOD) == 1.0 and get_reward("syn_format") is syn_format


@pytest.mark.parametrize("response, diversity, description", [
    (GOOD.replace("0.4", "1.7"), None, "a striped blue sky"),  # out of [0, 1]
    (GOOD.replace("0.4", "high"), None, "a striped blue sky"),  # not a number
    (GOOD.replace("a striped blue sky", "   "), 0.4, None),  # empty description
    (GOOD.replace("<diversity>0.4</diversity>", ""), None, "a striped blue sky"),  # missing block
    (GOOD + "<description>two</description>", 0.4, None),  # two descriptions
])
def test_malformed_parts_are_none_and_the_format_reward_is_zero(response, diversity, description):
    parsed = parse_syn_response(response)
    assert parsed.diversity == diversity and parsed.description == description
    assert not parsed.well_formed and syn_format(response) == 0.0


def test_order_and_stray_text_matter_and_think_can_be_optional():
    swapped = "<think>t</think><description>d</description><diversity>0.1</diversity><answer>a</answer>"
    assert syn_format(swapped) == 0.0
    assert syn_format("so: " + GOOD) == 0.0
    no_think = GOOD.split("</think>")[1]
    assert syn_format(no_think) == 0.0
    assert syn_format(no_think, require_think=False) == 1.0
    assert parse_syn_response("<diversity>40%</diversity>").diversity == pytest.approx(0.4)
