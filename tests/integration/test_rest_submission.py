"""Submission through slurmrestd on the real local cluster's REST API (lmcore.slurm.rest): SLURM
26.05 (from a Debian sid root) and 24.11 (a trixie root, whose packages give slurmrestd too), each
with JWT auth (launcher/localcluster/restd.py). The machine's own 22.05 speaks only REST API
v0.0.38, which lmlaunch does not: there these tests are skipped, saying so.

- A run submitted through a profile with ``submit.via: rest`` is preempted, requeued and resumes
  bit-identical to the uninterrupted run; ``status`` and ``history`` then answer for it with
  SLURM's commands unusable (through slurmrestd only).
- The REST submission's job record equals the sbatch submission's of the same plan in every field
  but those that name the submission path; ``cancel`` reaches it through REST.
- A sweep's array goes through REST too, and ``cancel SWEEP`` reaches every task.
- Bad input (a URL that does not answer, a token the server refuses, an API version it does not
  offer, a job it rejects, a token file others can read): exit 2 with the server's words, the
  token never printed, nothing left behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import waiting
from preempt_helpers import (
    BASE,
    MAX_STEPS,
    SPEC,
    assert_losses_match,
    assert_weights_identical,
    ddp_reference,
    ends,
    finish,
    lm,
    preempt,
    starts,
    submit,
    wait_step,
)
from shared_results import shared
from slurm_helpers import REPO, job_name, requeues_once_more_after_preemption
from waiting import HANG_S

from launcher.localcluster import restd
from launcher.localcluster.config import Settings
from launcher.runs import registry
from lmcore.slurm import client as slurm
from lmcore.slurm.rest import RestError, RestTarget

pytestmark = pytest.mark.both_versions
PROFILE = "local-rest"


@pytest.fixture(scope="module")
def rest_env(slurm_cluster, module_env, tmp_path_factory) -> dict[str, str]:
    """The module's environment with a profile ``local-rest``: the local profile submitting
    through this cluster's slurmrestd with a token from `scontrol token` (mode 600)."""
    layout = slurm_cluster
    if not restd.runs_rest(layout):
        version = slurm.config().get("SLURM_VERSION", "?")
        pytest.skip(f"this cluster's SLURM {version} runs no slurmrestd lmlaunch speaks (REST API v0.0.40 and later: "
                    "SLURM 23.11 on; the suite runs these on 24.11 and 26.05)")
    ports = Settings.from_json(layout.settings.read_text()).ports
    root = tmp_path_factory.mktemp("rest")
    token = root / "token"
    token.write_text(slurm.run(["scontrol", "token", "lifespan=7200"]).stdout)
    token.chmod(0o600)
    profiles = root / "profiles"
    profiles.mkdir()
    local = (REPO / "cluster_profiles" / "local.yaml").read_text()
    (profiles / f"{PROFILE}.yaml").write_text(
        local + f"\nsubmit: {{via: rest, url: '{restd.url(ports.slurmctld)}', token_file: '{token}'}}\n")
    return {**module_env, "LMLAUNCH_PROFILES_DIR": str(profiles), "REST_TOKEN_FILE": str(token),
            "REST_URL": restd.url(ports.slurmctld), "NO_SLURM_PATH": path_without_slurm(root / "bin")}


SLURM_COMMANDS = {"sbatch", "srun", "salloc", "squeue", "sacct", "scontrol", "scancel", "sinfo", "sacctmgr", "sstat",
                  "sprio", "sshare", "sattach", "sbcast", "sdiag", "sreport", "strigger", "scrontab", "sh5util"}


def path_without_slurm(where: Path) -> str:
    """A PATH with every program of this one but SLURM's commands (links in ``where``), as on a
    workstation that has no SLURM."""
    where.mkdir(parents=True, exist_ok=True)
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            link = where / entry.name
            if entry.name not in SLURM_COMMANDS and not link.exists() and not link.is_symlink():
                link.symlink_to(entry.path)
    return str(where)


def lm_without_slurm_commands(environ: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`lmlaunch ARGS` in a process without SLURM's commands (none on PATH, SLURM_CONF naming no
    file): what it learns about the cluster, it learns through slurmrestd."""
    env = {**environ, "SLURM_CONF": "/nonexistent/slurm.conf", "PATH": environ["NO_SLURM_PATH"]}
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=HANG_S)


def test_a_run_submitted_through_slurmrestd_is_preempted_requeued_and_resumes_bit_identical(rest_env, module_jobs):
    reference = shared("preempt-ddp-reference", lambda: ddp_reference(rest_env, module_jobs))
    name = job_name("rest", "preempted")
    job, run_dir = submit(rest_env, name, "--cluster", PROFILE)
    module_jobs.append(job)
    wait_step(run_dir, 20, attempt=1)
    r = preempt(rest_env, name, "requeue", "--start-now")
    assert r["requeued"], r
    finish(job, run_dir)
    extra = 1 if requeues_once_more_after_preemption() else 0  # 24.11 requeues such a job once more
    reasons = [e["reason"] for e in ends(run_dir)]
    assert reasons[0] == "preempted" and reasons[-1] == "completed" and len(reasons) == 2 + extra, ends(run_dir)
    assert starts(run_dir)[1]["start_step"] == ends(run_dir)[0]["end_step"] and starts(run_dir)[1]["job_id"] == job
    assert ends(run_dir)[-1]["end_step"] == MAX_STEPS
    assert_losses_match(run_dir, reference["losses"])
    assert_weights_identical(run_dir, reference)
    # status and history through slurmrestd alone (the run's profile submits through it)
    st = lm_without_slurm_commands(rest_env, "status", name, "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    view = json.loads(st.stdout)
    assert view["slurm"]["via"] == f"slurmrestd {rest_env['REST_URL']}", view["slurm"]
    (row,) = view["runs"]
    assert row["job_id"] == job and row["state"] == "COMPLETED" and row["step"] == MAX_STEPS, row
    hist = lm_without_slurm_commands(rest_env, "history", name, "--json")
    assert hist.returncode == 0, hist.stdout + hist.stderr
    attempts = json.loads(hist.stdout)["attempts"]
    assert [a["job_id"] for a in attempts] == [job] * (2 + extra), attempts
    assert (attempts[0]["reason"], attempts[-1]["reason"]) == ("preempted", "completed"), attempts
    assert attempts[1]["queue_wait_s"] is not None, attempts  # sacct's record of the requeue, through REST
    # a requeue through slurmrestd: API v0.0.45 (26.05) has the endpoint; 24.11's v0.0.42 says it has none
    target = RestTarget(rest_env["REST_URL"], rest_env["REST_TOKEN_FILE"], profile=PROFILE)
    with slurm.through_rest(target) as rest:
        if rest.offers("v0.0.45"):
            slurm.requeue(job)
            assert slurm.state_word(slurm.job_state(job)) in ("PENDING", "REQUEUED", "EXPEDITING"), slurm.job_state(job)
            slurm.cancel([job])
        else:
            with pytest.raises(RestError, match="has no job requeue endpoint"):
                slurm.requeue(job)


def _record(job_id: str, runs_root: str) -> dict[str, str]:
    info = slurm.show_job(job_id)
    assert info, job_id
    return {k: v.replace(runs_root, "<runs>").replace(f"/{job_id}_", "/<job>_") for k, v in info.items()}


# Fields of `scontrol show job` that name the submission path (or the moment), not the job:
# sbatch's own command line and the script file it read, the host:session that submitted
# (sbatch's shell, or slurmrestd's), and when.
SUBMISSION_FIELDS = {"SubmitLine", "Command", "AllocNode:Sid", "SubmitTime", "EligibleTime", "AccrueTime",
                     "LastSchedEval", "JobId", "ArrayJobId"}


def test_the_rest_submission_has_the_sbatch_submissions_job_record(rest_env, module_jobs, tmp_path):
    name = job_name("rest", "record")
    held = ("slurm.sbatch.hold=true", "resources.nodes=1")
    via = {}
    for path, profile in (("sbatch", "local"), ("rest", PROFILE)):
        env = {**rest_env, "LMLAUNCH_HOME": str(tmp_path / path / "home"), "LMLAUNCH_RUNS_ROOT": str(tmp_path / path / "runs")}
        args = ("submit", str(SPEC), f"name={name}", *BASE, *held, "--cluster", profile)
        if path == "rest":  # from a process with no SLURM command (no srun, no sbatch): through slurmrestd only
            r = lm_without_slurm_commands(env, *args)
            code, out, err = r.returncode, r.stdout, r.stderr
        else:
            code, out, err = lm(env, *args)
        assert code == 0, out + err
        via[path] = (re.search(r"job (\d+)", out).group(1), env)
        module_jobs.append(via[path][0])
    (a, env_a), (b, env_b) = via["sbatch"], via["rest"]
    rec_a, rec_b = _record(a, env_a["LMLAUNCH_RUNS_ROOT"]), _record(b, env_b["LMLAUNCH_RUNS_ROOT"])
    assert rec_a["JobState"] == "PENDING" and rec_a["Reason"] == "JobHeldUser", rec_a
    differ = {k: (rec_a.get(k), rec_b.get(k)) for k in set(rec_a) | set(rec_b)
              if k not in SUBMISSION_FIELDS and rec_a.get(k) != rec_b.get(k)}
    assert not differ, differ
    # the script slurmctld keeps for each is the one rendered (the run directories' paths and the
    # profile's name in its header aside)
    scripts = [slurm.run(["scontrol", "write", "batch_script", j, "-"]).stdout.replace(e["LMLAUNCH_RUNS_ROOT"], "<runs>")
               .replace(f"profile {PROFILE}", "profile local").replace(f"file {PROFILE}", "file local")
               for j, e in ((a, env_a), (b, env_b))]
    assert scripts[0] == scripts[1] and "#SBATCH --hold" in scripts[0]
    # any command through a profile's slurmrestd, per command (the sbatch path's run, asked with --rest)
    st = lm_without_slurm_commands(env_a, "--rest", PROFILE, "status", name, "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    view = json.loads(st.stdout)
    assert view["slurm"]["via"].startswith("slurmrestd ") and view["runs"][0]["state"] == "PENDING", view
    assert view["runs"][0]["reason"] == "JobHeldUser", view["runs"][0]
    # the logs' job facts, through slurmrestd (the run's profile says so)
    lg = lm_without_slurm_commands(env_b, "logs", name)
    assert lg.returncode == 0 and "slurm_conf" not in lg.stderr, lg.stdout + lg.stderr
    # cancel through slurmrestd only
    c = lm_without_slurm_commands(env_b, "cancel", name)
    assert c.returncode == 0, c.stdout + c.stderr
    waiting.until(lambda: not slurm.is_active(slurm.job_state(b)), progress=waiting.queue([b]),
                  what=f"job {b} cancelled through REST")
    assert slurm.state_word(slurm.job_state(b)) == "CANCELLED"
    slurm.cancel([a])


def test_a_sweep_is_one_array_through_slurmrestd_and_cancel_reaches_every_task(rest_env, module_jobs, tmp_path):
    name = job_name("rest", "sweep")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps({"name": name, "max_parallel": 1, "grid": {"optim.lr": [0.001, 0.01]}}))
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "sweep", str(SPEC), str(sweep), *BASE, "resources.nodes=1",
                        "slurm.sbatch.hold=true", "--cluster", PROFILE, "--json"], capture_output=True, text=True,
                       env=rest_env, cwd=REPO, timeout=HANG_S)
    assert r.returncode == 0, r.stdout + r.stderr
    (array,) = json.loads(r.stdout)["arrays"]
    module_jobs.append(array)
    tasks = slurm.squeue([array])
    assert sorted(t.job_id for t in tasks) == [f"{array}_0", f"{array}_1"], tasks
    info = slurm.show_job(array)
    assert info and info.get("ArrayTaskThrottle") == "1" and info["JobState"] == "PENDING", info
    c = lm_without_slurm_commands(rest_env, "cancel", name, "--json")
    assert c.returncode == 0, c.stdout + c.stderr
    assert len(json.loads(c.stdout)["points"]) == 2
    waiting.until(lambda: not any(slurm.is_active(j.state) for j in slurm.squeue([array])),
                  progress=waiting.queue([array]), what=f"the sweep's array {array} cancelled through REST")


def _refused(env: dict[str, str], name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "submit", str(SPEC), f"name={name}", *BASE, *extra,
                        "--cluster", PROFILE], capture_output=True, text=True, env=env, cwd=REPO, timeout=HANG_S)
    assert r.returncode == 2, r.stdout + r.stderr
    assert not (Path(env["LMLAUNCH_RUNS_ROOT"]) / name).exists(), "a refused submission left its run directory"
    assert registry.load_record(name, env) is None, "a refused submission left its registry record"
    return r


def _profile(env: dict[str, str], tmp_path: Path, **submit_section: str) -> dict[str, str]:
    d = tmp_path / f"profiles-{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    local = (REPO / "cluster_profiles" / "local.yaml").read_text()
    fields = ", ".join(f"{k}: '{v}'" for k, v in {"via": "rest", **submit_section}.items())
    (d / f"{PROFILE}.yaml").write_text(local + f"\nsubmit: {{{fields}}}\n")
    return {**env, "LMLAUNCH_PROFILES_DIR": str(d)}


def test_bad_rest_input_exits_2_in_the_servers_words_and_leaves_nothing(rest_env, tmp_path):
    url, token_file = rest_env["REST_URL"], rest_env["REST_TOKEN_FILE"]
    token = Path(token_file).read_text().strip().removeprefix("SLURM_JWT=")
    name = job_name("rest", "refused")
    # a URL nothing answers at
    r = _refused(_profile(rest_env, tmp_path, url="http://127.0.0.1:9", token_file=token_file), name)
    assert "slurmrestd at http://127.0.0.1:9" in r.stderr and "does not answer" in r.stderr, r.stderr
    # a token signed with another key: the server's 401, and the token never printed
    forged = tmp_path / "forged"
    head, payload, _ = token.split(".")
    forged.write_text(f"{head}.{payload}.c2lnbmVkLXdpdGgtYW5vdGhlci1rZXk")
    forged.chmod(0o600)
    r = _refused(_profile(rest_env, tmp_path, url=url, token_file=str(forged)), name)
    assert "refused the token" in r.stderr and "authentication" in r.stderr and payload not in r.stderr + r.stdout, r.stderr
    # an API version the server does not offer
    r = _refused(_profile(rest_env, tmp_path, url=url, token_file=token_file, api="v0.0.39"), name)
    assert "does not offer API v0.0.39" in r.stderr and "v0.0.42" in r.stderr, r.stderr
    # a job the server rejects, in its words
    r = _refused(rest_env, name, "slurm.sbatch.reservation=no-such-reservation")
    assert "reservation" in r.stderr.lower() and "slurmrestd" in r.stderr, r.stderr
    # an option slurmrestd's job description cannot carry: refused before anything is sent
    r = _refused(rest_env, name, "slurm.sbatch.hint=nomultithread")
    assert "--hint" in r.stderr and "no field" in r.stderr, r.stderr
    # a token file other users can read
    open_file = tmp_path / "open-token"
    open_file.write_text(token)
    open_file.chmod(0o644)
    r = _refused(_profile(rest_env, tmp_path, url=url, token_file=str(open_file)), name)
    assert "chmod 600" in r.stderr and token not in r.stderr, r.stderr
