"""Which step daemons of a job a node still holds, read from its spool directory: a socket file
counts only while a live socket is bound to it. A node that loses power (its slurmstepds SIGKILLed)
leaves the files behind; counting them kept a requeued job from being started until SLURM's own
BeginTime (about 2 minutes here)."""

from __future__ import annotations

import socket

from lmcore.slurm.admin import step_sockets


def test_a_socket_file_counts_only_while_a_live_socket_is_bound_to_it(tmp_path):
    spool = tmp_path / "slurmd-n2"
    spool.mkdir()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(spool / "n2_41.0"))
    live.listen(1)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(spool / "n2_41.4294967291"))
    dead.close()  # its daemon killed: the file stays, nothing is bound to it
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(spool / "n2_410.0"))  # another job whose id starts alike
    try:
        assert (spool / "n2_41.4294967291").exists()
        assert [p.name for p in step_sockets(str(tmp_path / "slurmd-%n"), "n2", "41")] == ["n2_41.0"]
        live.close()
        assert step_sockets(str(tmp_path / "slurmd-%n"), "n2", "41") == []
        assert step_sockets("", "n2", "41") == []
    finally:
        other.close()


def test_a_step_daemon_that_refuses_is_not_the_controller_down():
    """`scontrol listpids JOB NODE` where the job's slurmstepd died answers "Unable to connect to
    slurmstepd: Connection refused": the step is gone; reading it as the controller down made the
    campaign's start of a requeued job fail."""
    from lmcore.slurm.commands import says_controller_down

    assert not says_controller_down("Unable to connect to slurmstepd: Connection refused")
    assert says_controller_down("slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
    assert says_controller_down("scontrol: error: Connection refused")
