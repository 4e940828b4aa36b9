"""The REST path's pure parts (lmcore.slurm.rest_job, rest_records, rest): a rendered job's
options (the ones its #SBATCH header was written from) as slurmrestd's job description, the environment sbatch would send, the server's answers
as squeue's and sacct's rows, the token's checks and the API version chosen. The real slurmrestd
is exercised in tests/integration/test_rest_submission.py."""

from __future__ import annotations

import base64
import json
import os

import pytest

from launcher.submit.script import sbatch_lines
from lmcore.job import site_options
from lmcore.slurm import rest_records
from lmcore.slurm.batch_job import BatchJob, options_of
from lmcore.slurm.rest import KNOWN_APIS, RestError, choose_api, read_token_file, token_claims
from lmcore.slurm.rest_job import (
    CLIENT_SIDE,
    NO_VAL16,
    OPTIONS,
    RestJobError,
    job_description,
    megabytes,
    minutes,
)

OPTIONS_OF_A_RUN = (("chdir", "/runs/x"), ("cpus-per-task", "2"), ("error", "/runs/x/submitit/%j_0_log.err"),
                    ("exclusive", ""), ("gres", "gpu:8"), ("gres-flags", "enforce-binding"), ("job-name", "x"),
                    ("mem", "1802240M"), ("nodes", "2"), ("ntasks-per-node", "8"), ("open-mode", "append"),
                    ("output", "/runs/x/submitit/%j_0_log.out"), ("partition", "gpu"), ("requeue", ""),
                    ("signal", "USR2@120"), ("time", "720"), ("account", "proj"), ("qos", "normal"))


def _batch(*options: tuple[str, str]) -> BatchJob:
    """A job as launcher.submit.script renders one: its header written from ``options``."""
    return BatchJob("\n".join(["#!/bin/bash", *sbatch_lines(list(options)), "srun python -m x", ""]), options_of(options))


def _desc(*options: tuple[str, str], **kw):
    return job_description(_batch(*(options or OPTIONS_OF_A_RUN)), environment={"PATH": "/usr/bin", "HOME": "/root"},
                           cwd="/work", host="login1", **kw)["job"]


def test_the_options_sbatch_reads_become_the_job_descriptions_fields():
    job = _desc()
    assert job["name"] == "x" and job["nodes"] == "2" and job["tasks_per_node"] == 8 and job["cpus_per_task"] == 2
    assert job["time_limit"] == {"set": True, "infinite": False, "number": 720}
    assert job["memory_per_node"]["number"] == 1802240 and job["tres_per_node"] == "gres/gpu:8"
    assert job["flags"] == ["GRES_BINDING_ENFORCED"] and job["shared"] == ["none"] and job["requeue"] is True
    assert job["kill_warning_signal"] == "SIGUSR2" and job["kill_warning_delay"]["number"] == 120
    assert job["kill_warning_flags"] == [] and job["open_mode"] == ["APPEND"]
    assert job["standard_output"].endswith("%j_0_log.out") and job["current_working_directory"] == "/runs/x"
    assert job["account"] == "proj" and job["qos"] == "normal" and job["partition"] == "gpu"
    assert job["tres_per_task"] == "cpu=2"  # as sbatch sends --cpus-per-task
    assert job["oom_kill_step"] == NO_VAL16  # sbatch's "not set": the cluster's default applies


def test_the_script_sent_is_the_rendered_text_and_its_header_says_the_same_options():
    batch = _batch(*OPTIONS_OF_A_RUN)
    body = job_description(batch, environment={}, cwd="/w", host="h")
    assert body["script"] == batch.text
    header = [line for line in batch.text.splitlines() if line.startswith("#SBATCH ")]
    assert len(header) == len(OPTIONS_OF_A_RUN) and header[3] == "#SBATCH --exclusive"


def test_the_command_lines_options_win_over_the_scripts():
    job = _desc(extra=[("dependency", "afterok:12"), ("partition", "high")])
    assert job["dependency"] == "afterok:12" and job["partition"] == "high"


def test_the_environment_is_what_sbatch_would_send():
    env = dict(e.split("=", 1) for e in _desc()["environment"])
    assert env["PATH"] == "/usr/bin" and env["SLURM_SUBMIT_DIR"] == "/work" and env["SLURM_SUBMIT_HOST"] == "login1"
    assert env["SLURM_NTASKS"] == env["SLURM_NPROCS"] == "16" and env["SLURM_NTASKS_PER_NODE"] == "8"
    assert env["SLURM_CPUS_PER_TASK"] == "2" and env["SLURM_TRES_PER_TASK"] == "cpu=2"
    assert env["SLURM_MEM_PER_NODE"] == "1802240" and env["HYDRA_BOOTSTRAP"] == "slurm"
    assert env["SLURM_PRIO_PROCESS"] == "0"


def test_every_documented_sbatch_option_has_a_field_or_a_reason_it_has_none():
    """The class, not one example: each of sbatch's long options either maps to the job
    description or is named as one sbatch handles on the submitting side (refused, not dropped)."""
    assert not (set(site_options.SBATCH_OPTIONS) - set(OPTIONS) - CLIENT_SIDE - {"test-only"})
    assert not set(OPTIONS) & CLIENT_SIDE


@pytest.mark.parametrize("option", sorted(CLIENT_SIDE | {"container-image"}))
def test_an_option_without_a_field_is_refused_naming_it(option):
    with pytest.raises(RestJobError, match=f"--{option}: slurmrestd's job description has no field"):
        _desc((option, "x"))


@pytest.mark.parametrize(("text", "mins"), [("20", 20), ("1:30", 2), ("2:00:00", 120), ("1-0", 1440),
                                            ("1-2:30", 1590), ("0-0:0:59", 1), ("UNLIMITED", None)])
def test_slurm_times_in_whole_minutes(text, mins):
    got = minutes(text)
    assert (None if got["infinite"] else got["number"]) == mins


@pytest.mark.parametrize("bad", ["abc", "1:2:3:4", "-5", ""])
def test_a_bad_time_is_refused(bad):
    with pytest.raises(RestJobError):
        minutes(bad)


def test_memory_sizes_in_megabytes():
    assert [megabytes(t)["number"] for t in ("512", "512M", "2G", "1T", "1536K")] == [512, 512, 2048, 1048576, 2]
    with pytest.raises(RestJobError):
        megabytes("lots")


def test_bad_values_name_the_option():
    with pytest.raises(RestJobError, match="--open-mode=sometimes"):
        _desc(("open-mode", "sometimes"))
    with pytest.raises(RestJobError, match="--ntasks-per-node=many"):
        _desc(("ntasks-per-node", "many"))


def test_expedited_requeue_is_a_flag():
    job = _desc(("requeue", "expedite"), ("kill-on-invalid-dep", "yes"))
    assert job["requeue"] is True and job["flags"] == ["EXPEDITED_REQUEUE", "KILL_INVALID_DEPENDENCY"]


# --------------------------------------------------------------------------- answers as rows

JOB = {"job_id": 31, "name": "a", "job_state": ["PENDING"], "state_reason": "JobHeldUser", "restart_cnt": 1,
       "array_job_id": {"set": True, "number": 31}, "array_task_id": {"set": False, "number": 0},
       "array_task_string": "0-2%1", "time_limit": {"set": True, "number": 90}, "node_count": {"set": True, "number": 2},
       "nodes": "", "partition": "low", "user_name": "root", "submit_time": {"set": True, "number": 0},
       "start_time": {"set": True, "number": 0}}


def test_a_pending_arrays_one_record_is_one_row_per_task_as_squeue_r():
    rows = rest_records.queued_rows(JOB)
    assert [r.job_id for r in rows] == ["31_0", "31_1", "31_2"]
    assert rows[0].time_limit == "1:30:00" and rows[0].num_nodes == 2 and rows[0].restarts == 1
    assert rows[0].start == "N/A" and rows[0].reason == "JobHeldUser"
    assert rest_records.array_tasks({**JOB, "array_task_string": "1,4-8:2%2"}) == [1, 4, 6, 8]


def test_a_running_task_and_an_accounted_attempt_read_as_squeue_and_sacct_print_them():
    running = {**JOB, "job_state": ["RUNNING"], "array_task_id": {"set": True, "number": 2}, "array_task_string": "",
               "start_time": {"set": True, "number": 1000}}
    (row,) = rest_records.queued_rows(running, now=1000 + 3725)
    assert row.job_id == "31_2" and row.elapsed == "1:02:05" and row.state == "RUNNING"
    acct = rest_records.accounted({"job_id": 7, "name": "n", "state": {"current": ["CANCELLED"]},
                                   "kill_request_user": "alice", "exit_code": {"return_code": {"set": True, "number": 0},
                                   "signal": {"id": {"set": True, "number": 15}}}, "time": {"elapsed": 59, "start": 0,
                                   "end": 0, "submission": 0}, "nodes": "n[1-2]", "partition": "low"})
    assert acct.state == "CANCELLED by alice" and acct.exit_code == "0:15" and acct.elapsed == "0:59"
    assert acct.start == "Unknown" and acct.nodes == "n[1-2]"
    assert rest_records.duration(2 * 86400 + 61) == "2-00:01:01" and rest_records.limit({"infinite": True}) == "UNLIMITED"


# --------------------------------------------------------------------------- token and version


def _jwt(claims: dict) -> str:
    def part(d):
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")
    return f"{part({'alg': 'HS256'})}.{part(claims)}.c2ln"


def test_a_token_file_is_read_only_when_others_cannot(tmp_path):
    token = _jwt({"sun": "alice", "exp": 4102444800})
    f = tmp_path / "tok"
    f.write_text(f"SLURM_JWT={token}\n")
    f.chmod(0o600)
    assert read_token_file(str(f)) == token and token_claims(token)["sun"] == "alice"
    f.chmod(0o640)
    with pytest.raises(RestError, match="chmod 600") as exc:
        read_token_file(str(f))
    assert token not in exc.value.message
    f.write_text("not a token")
    f.chmod(0o600)
    with pytest.raises(RestError, match="holds no JWT"):
        read_token_file(str(f))
    with pytest.raises(RestError, match="No such file"):
        read_token_file(str(tmp_path / "missing"))


def test_the_newest_api_both_speak_is_chosen_or_the_pinned_one_if_offered():
    assert choose_api(["v0.0.42", "v0.0.43", "v0.0.44", "v0.0.45"], None, "x") == "v0.0.45"
    assert choose_api(["v0.0.40", "v0.0.41", "v0.0.42"], None, "x") == "v0.0.42"
    assert choose_api(["v0.0.42", "v0.0.44"], "v0.0.42", "x") == "v0.0.42"
    with pytest.raises(RestError, match="does not offer API v0.0.39.*v0.0.42, v0.0.44"):
        choose_api(["v0.0.42", "v0.0.44"], "v0.0.39", "x")
    with pytest.raises(RestError, match=f"lmlaunch speaks {KNOWN_APIS[-1]} to {KNOWN_APIS[0]}"):
        choose_api(["v0.0.38"], None, "x")


def test_the_token_file_is_never_world_readable_by_default_umask(tmp_path):
    """What `scontrol token > file` leaves with a common umask (022) is refused; 077 is accepted."""
    old = os.umask(0o022)
    try:
        (tmp_path / "t").write_text(_jwt({"sun": "a"}))
    finally:
        os.umask(old)
    with pytest.raises(RestError, match="mode 644"):
        read_token_file(str(tmp_path / "t"))


# --------------------------------------------------------------------------- review: what sbatch and squeue do


def test_state_flags_read_as_squeue_prints_them():
    assert rest_records.queued({**JOB, "job_state": ["CANCELLED", "COMPLETING"]}).state == "COMPLETING"
    assert rest_records.queued({**JOB, "job_state": ["PENDING", "REQUEUED"]}).state == "REQUEUED"
    assert rest_records.queued({**JOB, "job_state": ["PENDING", "EXPEDITING"]}).state == "EXPEDITING"


def test_time_used_counts_only_running_time_around_a_suspension():
    suspended = {**JOB, "job_state": ["SUSPENDED"], "array_task_string": "", "start_time": {"set": True, "number": 1000},
                 "pre_sus_time": {"set": True, "number": 300}, "suspend_time": {"set": True, "number": 1300}}
    assert rest_records.queued(suspended, now=5000).elapsed == "5:00"
    resumed = {**suspended, "job_state": ["RUNNING"], "suspend_time": {"set": True, "number": 2000}}
    assert rest_records.queued(resumed, now=2060).elapsed == "6:00"


def test_a_value_with_spaces_and_quotes_reaches_its_field_and_the_header_as_sbatch_reads_it():
    import shlex

    batch = _batch(("comment", "bob's run; rm -rf /"), ("nodes", "2"))
    assert _desc(*batch.options)["comment"] == "bob's run; rm -rf /"
    line = next(x for x in batch.text.splitlines() if x.startswith("#SBATCH --comment"))
    assert shlex.split(line[len("#SBATCH"):]) == ["--comment=bob's run; rm -rf /"], line


def test_zero_time_is_no_limit_and_mail_types_are_the_apis_words():
    assert minutes("0")["infinite"] is True
    job = _desc(("mail-type", "TIME_LIMIT_80,FAIL"))
    assert job["mail_type"] == ["FAIL", "TIME=80%"]
    with pytest.raises(RestJobError, match="not a --mail-type"):
        _desc(("mail-type", "SOMETIMES"))


def test_tres_per_node_from_two_options_is_one_list():
    job = _desc(("gres", "nvme:1"), ("gpus-per-node", "8"))
    assert job["tres_per_node"] == "gres/gpu:8,gres/nvme:1"


def test_sbatch_input_variables_apply_and_the_token_never_reaches_the_job():
    job = job_description(_batch(("partition", "a")), cwd="/w", host="h",
                          environment={"SBATCH_PARTITION": "b", "SBATCH_TIMELIMIT": "30", "SLURM_JWT": "a.b.c"})["job"]
    assert job["partition"] == "b" and job["time_limit"]["number"] == 30
    assert not any(e.startswith("SLURM_JWT=") for e in job["environment"])
    with pytest.raises(RestJobError, match=r"\$SBATCH_EXPORT is set"):
        job_description(_batch(), cwd="/w", host="h", environment={"SBATCH_EXPORT": "NONE"})


def test_a_client_never_shows_its_token_and_refuses_a_page_that_is_not_slurmrestds(tmp_path):
    import http.server
    import threading

    from lmcore.slurm.rest import RestClient, RestTarget

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/away"):
                self.send_response(302)
                self.send_header("Location", "http://example.invalid/steal")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html>Please log in</html>")

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = _jwt({"sun": "alice"})
    client = RestClient(RestTarget(f"http://127.0.0.1:{server.server_port}"), environ={"SLURM_JWT": token})
    try:
        with pytest.raises(RestError, match="not slurmrestd's JSON") as exc:
            client.api()
        assert token not in exc.value.message and token not in repr(client)
        with pytest.raises(RestError, match="redirected to http://example.invalid/steal: refused"):
            client.request("GET", "/away")
    finally:
        server.shutdown()
    with pytest.raises(RestError, match="does not answer"):
        RestClient(RestTarget("http://127.0.0.1:9"), environ={"SLURM_JWT": token}).api()
    with pytest.raises(RestError, match=r"\$SLURM_JWT holds no JWT"):
        RestClient(RestTarget("http://127.0.0.1:9"), environ={"SLURM_JWT": "x\ny"}).api()


def test_a_renewed_token_file_is_read_again(tmp_path):
    from lmcore.slurm.rest import RestClient, RestTarget

    f = tmp_path / "tok"
    first, second = _jwt({"sun": "alice", "n": 1}), _jwt({"sun": "alice", "n": 2})
    f.write_text(first)
    f.chmod(0o600)
    client = RestClient(RestTarget("http://127.0.0.1:9", str(f)), environ={})
    assert client.token()[0] == first
    f.write_text(second)
    os.utime(f, (1, 1))  # another mtime, as a renewal gives
    assert client.token()[0] == second
