"""The joint names of every request are checked together; one that fails is named alone, as it was name by name."""

from __future__ import annotations

import pytest

from sequence_ai_ros.protocol import limits
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

NAMES = [f'joint_{k}' for k in range(26)]


def _request(names: list[str]) -> pb.ObservationRequest:
    return pb.ObservationRequest(request_id=1, state_names=names)


@pytest.mark.parametrize('names', [NAMES, [], ['x' * limits.MAX_NAME], ['é', 'ü ö', '関節']])
def test_printable_names_within_the_limit_pass(names):
    limits.check_observation(_request(names))


@pytest.mark.parametrize('bad', ['x' * (limits.MAX_NAME + 1), 'tab\there', 'bell\a', 'new\nline', '\x1b[31m'])
@pytest.mark.parametrize('at', [0, 13, 25])
def test_a_bad_name_anywhere_is_refused_naming_the_field_and_that_name(bad, at):
    names = [*NAMES[:at], bad, *NAMES[at + 1:]]
    with pytest.raises(limits.LimitViolation) as caught:
        limits.check_observation(_request(names))
    assert caught.value.field == 'state_names'
    with pytest.raises(limits.LimitViolation) as alone:      # the message is the one that name gets on its own
        limits.check_id(bad, 'state_names', limits.MAX_NAME)
    assert str(caught.value) == str(alone.value)


def test_the_first_of_several_bad_names_is_the_one_named():
    names = [*NAMES[:3], 'first\x00', *NAMES[4:9], 'y' * (limits.MAX_NAME + 5), *NAMES[10:]]
    with pytest.raises(limits.LimitViolation, match='first'):
        limits.check_observation(_request(names))
