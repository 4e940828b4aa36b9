"""The slow-host stress mode (tests/slow_host.py): the burner's nice value gives a thread of the
suite the share of a core that a host with the target's import time would, and the burners are
pinned one to a core at that nice value."""

from __future__ import annotations

import os
import signal

import pytest
import slow_host


@pytest.mark.parametrize("quiet", [2.4, 2.6, 3.5, 4.56, 5.5])
def test_the_burners_nice_value_copies_a_host_whose_imports_take_the_target(quiet):
    nice = slow_host.burner_nice(quiet, 6.0)
    assert nice is not None and -20 <= nice <= 19
    effective = quiet / slow_host.share(nice)  # a task's imports beside the burner, in wall seconds
    assert effective == pytest.approx(6.0, rel=0.1), (quiet, nice, effective)


def test_a_host_as_slow_as_the_target_gets_no_burner():
    assert slow_host.burner_nice(6.0, 6.0) is None and slow_host.burner_nice(6.7, 6.0) is None
    assert slow_host.share(None) == 1.0


def test_the_burners_are_pinned_one_to_a_core_at_their_nice_value():
    core = min(os.sched_getaffinity(0))
    (pid,) = slow_host.start_burners(5, [core])
    try:
        assert os.sched_getaffinity(pid) == {core}
        assert os.getpriority(os.PRIO_PROCESS, pid) == 5
        assert os.getsid(pid) == pid  # a session of its own: scripts/test.sh kills it at the end
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
