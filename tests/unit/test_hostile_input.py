"""Hostile and careless input through the real CLI process: every case exits 2 with one clear
message and no traceback, uses under 5 s of CPU and under 200 MB, writes nothing and calls no
SLURM command.

Each case runs ``python -m launcher.cli`` as a child process with:
- PATH starting with a directory of fake SLURM commands (sbatch, squeue, ...) that leave a
  canary file when called;
- HOME, LMLAUNCH_HOME, LMLAUNCH_RUNS_ROOT and the working directory in a fresh directory
  whose contents are compared before and after;
- its CPU time read from ``os.wait4`` and its peak memory from its own VmHWM (tests/unit/_cli_peak.py);
  wall time only guards against a hang: CPU time is what a runaway parse costs, and does not
  flake on a loaded machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from tests.unit.malformed_cases import BASE

REPO = Path(__file__).resolve().parents[2]
SLURM_COMMANDS = ("sbatch", "squeue", "sacct", "scontrol", "scancel", "sinfo", "srun", "salloc", "sacctmgr")
CPU_LIMIT_S = 5.0
RSS_LIMIT_MB = 200
HANG_GUARD_S = 60

HOSTILE_PROFILE = """\
partitions:
  batch: {max_time: "1:00:00"}
default_partition: batch
max_tasks_per_node: 4
runs_root: /runs
"""


@dataclass
class Result:
    code: int
    out: str
    err: str
    cpu_s: float
    rss_mb: float
    wall_s: float


@dataclass
class Sandbox:
    root: Path
    spec: Path
    env: dict[str, str] = field(default_factory=dict)

    def snapshot(self) -> set[str]:
        return {str(p.relative_to(self.root)) for p in self.root.rglob("*")}


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    canary = tmp_path / "slurm-called"
    for name in SLURM_COMMANDS:
        cmd = fake_bin / name
        cmd.write_text(f"#!/bin/sh\necho {name} >> {canary}\nexit 1\n")
        cmd.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    profiles = work / "profiles"
    profiles.mkdir()
    env = {
        "PATH": f"{fake_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(work / "home"),
        "USER": "u",
        "LMLAUNCH_HOME": str(work / "lmhome"),
        "LMLAUNCH_RUNS_ROOT": str(work / "runs"),
        "LMLAUNCH_PROFILES_DIR": str(profiles),
        "PYTHONPATH": str(REPO),
        "LANG": "C.UTF-8",
    }
    return Sandbox(root=work, spec=work / "job.yaml", env=env)


def run_measured(sb: Sandbox, args: list[str], extra_env: dict[str, str] | None = None) -> Result:
    """Run the CLI with ARGS in the sandbox; CPU time of this one child from os.wait4, its peak
    RSS from its own VmHWM."""
    peak_file = sb.root.parent / "peak-kb"
    peak_file.unlink(missing_ok=True)
    env = {**sb.env, **(extra_env or {}), "LMLAUNCH_TEST_PEAK_FILE": str(peak_file)}
    started = time.monotonic()
    out_path, err_path = sb.root.parent / "stdout", sb.root.parent / "stderr"
    with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.unit._cli_peak", *args],
            cwd=sb.root, env=env, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL,
        )
        deadline = started + HANG_GUARD_S
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                pytest.fail(f"lmlaunch {' '.join(args)[:80]} still ran after {HANG_GUARD_S} s")
            time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Result(
        code=proc.returncode,
        out=out_path.read_text(errors="replace"),
        err=err_path.read_text(errors="replace"),
        cpu_s=usage.ru_utime + usage.ru_stime,
        rss_mb=int(peak_file.read_text()) / 1024,
        wall_s=time.monotonic() - started,
    )


def assert_refused(sb: Sandbox, args: list[str], *needles: str, extra_env: dict[str, str] | None = None,
                   code: int = 4) -> Result:
    """Exit ``code`` (4: an invalid spec, profile or override; 2: an argument naming no file or run),
    one 'error:' message holding every needle, no traceback, within the CPU and memory bounds,
    nothing written, no SLURM command called."""
    before = sb.snapshot()
    r = run_measured(sb, args, extra_env)
    assert r.code == code, (r.code, r.err[-2000:])
    assert "Traceback" not in r.err, r.err[-2000:]
    assert r.err.startswith("error: "), r.err[:500]
    assert r.out == ""
    for needle in needles:
        assert needle in r.err, (needle, r.err[:2000])
    assert len(r.err) < 3000, f"message of {len(r.err)} characters"
    assert r.cpu_s < CPU_LIMIT_S, f"{r.cpu_s:.1f} s of CPU"
    assert r.rss_mb < RSS_LIMIT_MB, f"{r.rss_mb:.0f} MB peak"
    assert sb.snapshot() == before, sorted(sb.snapshot() ^ before)
    assert not (sb.root.parent / "slurm-called").exists(), (sb.root.parent / "slurm-called").read_text()
    return r


def with_line(after: str, line: str) -> str:
    """BASE with ``line`` inserted after the line that starts with ``after``."""
    out = []
    for existing in BASE.splitlines():
        out.append(existing)
        if existing.startswith(after):
            out.append(line)
    return "\n".join(out) + "\n"


# --- 1. a trailing newline (or another control character) in what reaches the script ----------

NEWLINE_CASES = {
    "run_name": (BASE.replace("name: t", 'name: "ok\\n"'), "name (line 1): 'ok\\n' is not a valid run name (it holds the control character '\\n')"),
    "mem": (with_line("  nodes", '  mem: "64G\\n"'), "resources.mem (line 5): '64G\\n' is not a SLURM memory size"),
    "account": (with_line("  nodes", '  account: "acct\\n"'), "resources.account (line 5): 'acct\\n' is not a SLURM name"),
    "qos": (with_line("  nodes", '  qos: "high\\n"'), "resources.qos (line 5): 'high\\n' is not a SLURM name"),
    "partition": (with_line("  nodes", '  partition: "low\\n"'), "resources.partition (line 5): 'low\\n' is not a SLURM name"),
    "constraint": (with_line("  nodes", '  constraint: "ib\\n#SBATCH --partition=high"'), "resources.constraint (line 5): 'ib\\n#SBATCH --partition=high' is not a SLURM name"),
    "time": (BASE.replace('time: "00:20:00"', 'time: "00:20:00\\n"'), "resources.time (line 6): '00:20:00\\n' is not a SLURM time"),
    "env_name": (BASE + 'env:\n  vars:\n    "OK\\ntouch /tmp/pwned; X": "1"\n', "env.vars: 'OK\\ntouch /tmp/pwned; X' is not a valid environment variable name"),
    "passthrough_name": (BASE + 'env:\n  passthrough: ["TOKEN\\n"]\n', "env.passthrough: 'TOKEN\\n' is not a valid environment variable name"),
    "data_path": (BASE.replace("path: /data/tiny", 'path: "/data/x\\n#SBATCH --partition=high"'), "data.path (line 10): '/data/x\\n#SBATCH --partition=high' is not a usable path"),
    "pretrained": (BASE.replace("type: gpt2", 'pretrained: "/m\\r"'), "model.pretrained (line 8): '/m\\r' is not a usable path"),
    "env_value_escape": (BASE + 'env:\n  vars:\n    A: "x\\u001b]0;pwned\\u0007"\n', "env.vars.A (line 19): 'x\\x1b]0;pwned\\x07' is not an environment value"),
    "wandb_project": (BASE + 'logging:\n  wandb: {project: "p\\n#SBATCH"}\n', "logging.wandb.project (line 18): 'p\\n#SBATCH' is not one line of text"),
}


@pytest.mark.parametrize("case", sorted(NEWLINE_CASES))
def test_a_control_character_in_a_script_bound_string_is_refused(case, sandbox):
    text, needle = NEWLINE_CASES[case]
    sandbox.spec.write_text(text)
    assert_refused(sandbox, ["validate", str(sandbox.spec)], needle)
    assert_refused(sandbox, ["submit", str(sandbox.spec), "--dry-run"], needle)


@pytest.mark.parametrize("override, key", [("checkpoint.dir=gs://bucket/prefix", "checkpoint.dir"),
                                           ("data.path=https://example.org/tiny", "data.path"),
                                           ("model.pretrained=gs://models/gpt2", "model.pretrained")])
def test_a_url_where_a_path_goes_is_refused_not_taken_for_a_local_directory(override, key, sandbox):
    """Object storage is not read or written: `s3://b/p` as a path would be the relative directory
    `s3:/b/p` beside the spec, silently."""
    sandbox.spec.write_text(BASE)
    for args in (["validate"], ["submit", "--dry-run"]):
        r = assert_refused(sandbox, [args[0], str(sandbox.spec), override, *args[1:]], f"{key} (override")
        assert "is not a usable path" in r.err and "not a URL" in r.err, r.err
    assert not list(sandbox.spec.parent.rglob("*:")), "a directory named after the URL's scheme"


def test_checkpoints_in_a_bucket_need_the_profiles_credentials_and_a_well_formed_location(sandbox):
    """`checkpoint.dir: s3://...` keeps the checkpoints in a bucket too (lmcore.objects): refused, naming
    the profile's key, when the profile names no credentials file; a malformed location says the form."""
    sandbox.spec.write_text(BASE)
    for args in (["validate"], ["submit", "--dry-run"]):
        r = assert_refused(sandbox, [args[0], str(sandbox.spec), "checkpoint.dir=s3://lmlaunch/runs/x", *args[1:]],
                           "needs S3 credentials")
        assert "set object_store_credentials in it" in r.err, r.err
    # a credentials file the attempt would refuse is refused now, where the nodes' path is readable here
    creds = sandbox.root / "s3.json"
    creds.write_text('{"endpoint": "http://127.0.0.1:7480", "access_key": "a", "secret_key": "b"}')
    creds.chmod(0o644)
    (sandbox.root / "profiles" / "s3.yaml").write_text(
        (REPO / "cluster_profiles" / "local.yaml").read_text() + f"object_store_credentials: {creds}\n")
    r = assert_refused(sandbox, ["validate", str(sandbox.spec), "checkpoint.dir=s3://lmlaunch/runs/x", "--cluster", "s3"],
                       "profile 's3' object_store_credentials")
    assert "has mode 644; it must be readable by its owner only (chmod 600" in r.err, r.err
    r = assert_refused(sandbox, ["validate", str(sandbox.spec), "checkpoint.dir=s3://Not_A_Bucket/x"], "checkpoint.dir")
    assert "not an S3 location; write s3://BUCKET/PREFIX" in r.err, r.err
    assert not list(sandbox.spec.parent.rglob("*:")), "a directory named after the URL's scheme"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("name=ok\n#SBATCH --partition=high", "holds the control character '\\n': an override is one line"),
        ("resources.account=a\rb", "holds the control character '\\r'"),
        ("env.vars.A=\x1b[2J", "holds the control character '\\x1b'"),
        ("name=" + "n" * 9000, "is too long: 9005 characters, at most 8192"),
    ],
    ids=["newline", "carriage_return", "escape", "too_long"],
)
def test_an_override_with_a_control_character_is_an_error_not_cut(override, needle, sandbox):
    sandbox.spec.write_text(BASE)
    r = assert_refused(sandbox, ["validate", str(sandbox.spec), override], needle)
    assert "\n#SBATCH" not in r.err


PROFILE_CASES = {
    "partition_name": (HOSTILE_PROFILE.replace("  batch:", '  "batch\\n":').replace("default_partition: batch", 'default_partition: "batch\\n"'), "'batch\\n' is not a SLURM name"),
    "account": (HOSTILE_PROFILE + 'account: "a\\n#SBATCH --qos=x"\n', "account (line 6): 'a\\n#SBATCH --qos=x' is not a SLURM name"),
    "setup_line": (HOSTILE_PROFILE + 'setup: ["module load x\\rrm -rf ~"]\n', "setup[0] (line 6): 'module load x\\rrm -rf ~' is not one shell line"),
    "env_name": (HOSTILE_PROFILE + 'env:\n  "NCCL_X\\n": {value: "1", why: "w"}\n', "'NCCL_X\\n' is not a valid environment variable name"),
    "runs_root": (HOSTILE_PROFILE.replace("runs_root: /runs", 'runs_root: "/runs\\n"'), "runs_root (line 5): '/runs\\n' is not a usable path"),
    "gres": (HOSTILE_PROFILE + 'gres_name: "gpu\\n"\n', "gres_name: 'gpu\\n' is not a GRES name"),
    "description": (HOSTILE_PROFILE + 'description: "a\\nb"\n', "description (line 6): 'a\\nb' is not one line of text"),
}


@pytest.mark.parametrize("case", sorted(PROFILE_CASES))
def test_a_control_character_in_a_profile_is_refused(case, sandbox):
    text, needle = PROFILE_CASES[case]
    (sandbox.root / "profiles" / "hostile.yaml").write_text(text)
    sandbox.spec.write_text(BASE)
    assert_refused(sandbox, ["validate", str(sandbox.spec), "--cluster", "hostile"], "hostile.yaml: ", needle)


# --- 2. resource exhaustion ------------------------------------------------------------------

BOMB = "".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
        *(f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)),
    ]
)


def test_an_alias_bomb_document_is_refused_quickly(sandbox):
    sandbox.spec.write_text(BOMB)
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "expands to more than 100000 values through its aliases")


def test_an_alias_bomb_under_an_unknown_key_is_refused_quickly(sandbox):
    sandbox.spec.write_text(BASE + "junk:\n" + "".join("  " + line + "\n" for line in BOMB.splitlines()))
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "expands to more than 100000 values")


def test_an_alias_bomb_inside_model_config_is_refused_quickly(sandbox):
    nested = "".join("    " + line + "\n" for line in BOMB.splitlines())
    sandbox.spec.write_text(BASE.replace("  type: gpt2\n", "  type: gpt2\n  config:\n" + nested))
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "expands to more than 100000 values")


def test_an_alias_bomb_in_an_override_is_refused_quickly(sandbox):
    sandbox.spec.write_text(BASE)
    flow = "{a: &a [1,1,1,1,1,1,1,1,1,1], " + ", ".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 10)}]" for i in range(7)
    ) + "}"
    assert_refused(sandbox, ["validate", str(sandbox.spec), f"model.config={flow}"], "override ", "expands to more than 100000 values")


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "a: &a {b: *a}\n", "&a [*a]\n"], ids=["list", "mapping", "root"])
def test_a_self_referencing_alias_is_refused(text, sandbox):
    sandbox.spec.write_text(text)
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "line 1: an alias refers to the list or mapping that contains it")


def test_ten_thousand_nested_lists_are_refused(sandbox):
    sandbox.spec.write_text(BASE + "junk: " + "[" * 10_000 + "]" * 10_000 + "\n")
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "line 17: nesting is deeper than 32 levels")
    assert_refused(sandbox, ["validate", str(sandbox.spec.with_name("nothing.yaml")), "x=" + "[" * 5000 + "]" * 5000], "job spec not found", code=2)
    sandbox.spec.write_text(BASE)
    assert_refused(sandbox, ["validate", str(sandbox.spec), "model.config=" + "[" * 4000 + "]" * 4000], "nesting is deeper than 32 levels")


def test_a_30_mb_spec_is_refused_without_reading_it(sandbox):
    with open(sandbox.spec, "w") as f:
        f.write(BASE)
        f.write("# padding\n" * 3_000_000)
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "is 30000", "bytes; at most 1048576 (1024 KiB)")


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"), ("/tmp", "a directory")])
def test_a_spec_that_is_not_a_regular_file_is_refused_before_reading(path, kind, sandbox):
    assert_refused(sandbox, ["validate", path], f"job spec {path} is {kind}, not a regular file", code=2)


def test_a_fifo_as_spec_is_refused_without_blocking(sandbox, tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert_refused(sandbox, ["validate", str(fifo)], "is a named pipe, not a regular file", code=2)


def test_an_oversized_or_bombed_profile_is_refused(sandbox):
    profiles = sandbox.root / "profiles"
    (profiles / "bomb.yaml").write_text(HOSTILE_PROFILE + "x:\n" + "".join("  " + line + "\n" for line in BOMB.splitlines()))
    sandbox.spec.write_text(BASE)
    assert_refused(sandbox, ["validate", str(sandbox.spec), "--cluster", "bomb"], "bomb.yaml: ", "expands to more than 100000 values")
    with open(profiles / "huge.yaml", "w") as f:
        f.write(HOSTILE_PROFILE + "# pad\n" * 400_000)
    assert_refused(sandbox, ["validate", str(sandbox.spec), "--cluster", "huge"], "cluster profile ", "at most 1048576")


# --- 3. tracebacks instead of errors ---------------------------------------------------------


def test_a_5000_digit_integer_in_the_file_is_refused(sandbox):
    sandbox.spec.write_text(BASE.replace("max_steps: 10", "max_steps: " + "9" * 5000))
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "line 15: the integer '9999", "has 5000 digits; at most 19")


def test_a_5000_digit_integer_in_an_override_is_refused(sandbox):
    sandbox.spec.write_text(BASE)
    assert_refused(sandbox, ["validate", str(sandbox.spec), "trainer.max_steps=" + "9" * 5000], "has 5000 digits; at most 19")


def test_an_integer_beyond_a_fields_range_names_the_range(sandbox):
    sandbox.spec.write_text(BASE.replace("max_steps: 10", "max_steps: 99999999999999999"))
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "trainer.max_steps (line 15): ", "less than or equal to 10000000000")


def test_a_spec_path_that_is_a_symlink_loop_is_an_error(sandbox, tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    assert_refused(sandbox, ["validate", str(loop)], f"cannot read job spec {loop}: Too many levels of symbolic links", code=2)


def test_a_spec_name_too_long_for_the_filesystem_is_an_error(sandbox, tmp_path):
    long = tmp_path / ("x" * 300 + ".yaml")
    r = assert_refused(sandbox, ["validate", str(long)], "cannot read job spec ", "File name too long", code=2)
    assert "x" * 200 not in r.err  # shortened in the message


def test_a_data_path_that_is_a_symlink_loop_is_an_error(sandbox):
    # A relative path is resolved against the spec's directory at submit (an absolute one is
    # passed on as written: the data is read on the allocation).
    loop = sandbox.root.parent / "loopdir"
    loop.symlink_to(loop)
    sandbox.spec.write_text(BASE.replace("path: /data/tiny", "path: ../loopdir/sub"))
    for command in (["validate"], ["submit", "--dry-run"]):
        assert_refused(
            sandbox, [command[0], str(sandbox.spec), *command[1:]],
            "data.path (line 10): cannot resolve the path '../loopdir/sub': Symlink loop",
        )


# --- 4. values silently changed --------------------------------------------------------------


@pytest.mark.parametrize(
    "value, needle",
    [
        (".inf", "model.config.n_layer must be a whole number (it is a count, size or id), got inf"),
        ("1e400", "model.config.n_layer must be a whole number (it is a count, size or id), got inf"),
        (".nan", "model.config.n_layer must be a whole number (it is a count, size or id), got nan"),
        ("4.5", "model.config.n_layer must be a whole number (it is a count, size or id), got 4.5"),
        ("4.0", "model.config.n_layer must be a whole number (it is a count, size or id), got 4.0"),
        ("'4'", "model.config.n_layer must be a whole number (it is a count, size or id), got '4'"),
        ("true", "model.config.n_layer must be a whole number (it is a count, size or id), got True"),
    ],
)
def test_a_non_integral_model_size_is_an_error(value, needle, sandbox):
    sandbox.spec.write_text(BASE.replace("  type: gpt2\n", f"  type: gpt2\n  config:\n    n_layer: {value}\n"))
    assert_refused(sandbox, ["validate", str(sandbox.spec)], "job.yaml: line 10: " + needle)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("    layer_norm_epsilon: .inf\n", "model.config.layer_norm_epsilon is inf: a model config holds finite numbers only"),
        ("    rope_scaling: {factor: .nan}\n", "model.config.rope_scaling.factor is nan"),
        ("    eos_token_id: [1, 2.5]\n", "model.config.eos_token_id must be a whole number"),
        ("    'bad key': 1\n", "model.config key 'bad key' is not a config attribute name"),
    ],
    ids=["inf", "nested_nan", "token_list", "key"],
)
def test_model_config_values_config_json_cannot_carry_are_errors(text, needle, sandbox):
    sandbox.spec.write_text(BASE.replace("  type: gpt2\n", "  type: gpt2\n  config:\n" + text))
    assert_refused(sandbox, ["validate", str(sandbox.spec)], needle)


@pytest.mark.parametrize("key, value", [("optim.lr", "1e400"), ("optim.eps", ".inf"), ("trainer.gradient_clip_val", ".nan"), ("data.val_fraction", ".nan")])
def test_non_finite_numbers_are_refused_in_every_float_field(key, value, sandbox):
    sandbox.spec.write_text(BASE)
    assert_refused(sandbox, ["validate", str(sandbox.spec), f"{key}={value}"], f"override '{key}={value}'", "finite")


# --- 5. messages -----------------------------------------------------------------------------


def test_a_5000_character_bad_name_is_shortened_in_the_message(sandbox):
    sandbox.spec.write_text(BASE.replace("name: t", "name: " + "é" * 5000))
    r = assert_refused(sandbox, ["validate", str(sandbox.spec)], "(5000 characters)", "is too long for a valid run name: 5000 characters, at most 64")
    assert len(r.err) < 400


def test_a_long_unknown_key_is_shortened(sandbox):
    sandbox.spec.write_text(BASE + "? " + "k" * 5000 + "\n: 1\n")
    r = assert_refused(sandbox, ["validate", str(sandbox.spec)], "unknown key 'kkk", "(5000 characters)")
    assert len(r.err) < 1000


def test_the_human_dry_run_shows_values_with_line_breaks_escaped(sandbox):
    sandbox.spec.write_text(BASE + 'env:\n  vars:\n    NOTE: "line one\\n#SBATCH --partition=high\\n\\tend"\n')
    r = run_measured(sandbox, ["submit", str(sandbox.spec), "--dry-run"])
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert not [line for line in lines if line.startswith("#SBATCH --partition=high")]
    assert "export NOTE=$'line one\\n#SBATCH --partition=high\\n\\tend'" in lines
    assert "NOTE=line one\\n#SBATCH --partition=high\\n\\tend    # set by the job spec" in r.out or any(
        line.startswith("NOTE=line one\\n#SBATCH --partition=high\\n\\tend") for line in lines
    )
    # the script itself: bash reads the value back exactly
    plan = json.loads(run_measured(sandbox, ["submit", str(sandbox.spec), "--dry-run", "--json"]).out)
    script = plan["script"]
    setup = "\n".join(line for line in script.splitlines() if line.startswith("export NOTE="))
    got = subprocess.run(["bash", "-c", setup + '\nprintf %s "$NOTE"'], capture_output=True, text=True, check=True).stdout
    assert got == "line one\n#SBATCH --partition=high\n\tend"


def test_a_closed_pipe_ends_the_dry_run_quietly(sandbox):
    sandbox.spec.write_text(BASE)
    cmd = f"{sys.executable} -m launcher.cli submit {sandbox.spec} --dry-run --offline | head -2"
    proc = subprocess.run(["bash", "-c", cmd], cwd=sandbox.root, env=sandbox.env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.stdout.startswith("# the cluster: not asked (--offline)\n# lmlaunch plan for run 't'"), proc.stdout
    assert proc.stdout.count("\n") == 2
    assert proc.stderr == ""
    big = f"{sys.executable} -m launcher.cli schema | head -c 10"
    proc = subprocess.run(["bash", "-c", big], cwd=sandbox.root, env=sandbox.env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.stderr == ""


# --- environments without $USER ----------------------------------------------------------------


def test_runs_root_with_user_falls_back_to_the_account_name_without_USER(sandbox):
    import pwd

    name = pwd.getpwuid(os.getuid()).pw_name
    (sandbox.root / "profiles" / "shared.yaml").write_text(
        HOSTILE_PROFILE.replace("runs_root: /runs", "runs_root: /shared/$USER/runs")
    )
    sandbox.spec.write_text(BASE)
    env = {k: v for k, v in sandbox.env.items() if k not in ("USER", "LOGNAME", "LMLAUNCH_RUNS_ROOT")}
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "submit", str(sandbox.spec), "--dry-run", "--json", "--cluster", "shared"],
        cwd=sandbox.root, env=env, capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plan"]["paths"]["run_dir"] == f"/shared/{name}/runs/t"


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mistral", "qwen3", "gpt_neox", "phi3", "gemma2"])
def test_the_integer_rule_of_model_config_matches_real_transformers_configs(model_type):
    from transformers import AutoConfig

    from lmcore.job.model_config import expects_integer

    config = AutoConfig.for_model(model_type).to_dict()
    whole = {k for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    # gemma2's query_pre_attn_scalar is a whole number there and a float in other models
    assert sorted(k for k in whole if not expects_integer(k)) in ([], ["query_pre_attn_scalar"])
    not_whole = {k for k, v in config.items() if v is not None and not isinstance(v, list) and k not in whole}
    assert sorted(k for k in not_whole if expects_integer(k)) == []


@pytest.mark.parametrize("ref", ["x" * 5000, "../../etc/passwd", "a\nb", "/dev/zero"], ids=["long", "traversal", "newline", "device"])
def test_a_hostile_run_reference_is_not_found_and_reads_nothing(ref, sandbox):
    for command in ("history", "logs"):
        r = assert_refused(sandbox, [command, ref], "no run named or with job id ", code=2)
        assert len(r.err) < 400
