"""Site sbatch/srun options (lmcore.job.site_options): a profile's and a spec's `slurm` section
reach the job script (#SBATCH lines, the tasks' srun line) and the dry run; the spec's override the
profile's and null drops one; an option lmlaunch plans itself is refused naming the key that owns
it, with the file, key path and line; names and values follow full-match rules (nothing can bend the
script); an option that is not among SLURM's documented ones is a note with the closest name."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.context import Context
from lmcore.job import site_options

REPO = Path(__file__).resolve().parents[2]
ENVIRON = {"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/home/u", "USER": "u", "PATH": "/usr/bin"}


def lm(*argv: str, profiles: Path | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    environ = {**ENVIRON, **({"LMLAUNCH_PROFILES_DIR": str(profiles)} if profiles else {})}
    code = main(list(argv), Context(stdout=out, stderr=err, environ=environ, python="/venv/bin/python"))
    return code, out.getvalue(), err.getvalue()


def _dry(*overrides: str, profiles: Path | None = None) -> dict:
    code, out, err = lm("submit", str(REPO / "jobs" / "tiny-cpu.yaml"), *overrides, "--dry-run", "--offline", "--json",
                        profiles=profiles)  # the plan; the controller (it knows no reservation r1) is not asked
    assert code == 0, out + err
    return json.loads(out)


def _profile_with(tmp_path: Path, text: str) -> Path:
    """A profiles directory whose local.yaml is the shipped one ending with ``text``."""
    root = tmp_path / "profiles"
    root.mkdir()
    shutil.copy(REPO / "cluster_profiles" / "local.yaml", root / "local.yaml")
    with open(root / "local.yaml", "a") as f:
        f.write(text)
    return root


def test_site_options_reach_the_script_and_the_tasks_srun_line():
    dry = _dry("slurm.sbatch={reservation: r1, hint: nomultithread, mail-type: 'END,FAIL', nice: 10, contiguous: true}",
               "slurm.srun={mpi: pmix, cpu-bind: cores}")
    script = dry["script"]
    for line in ("#SBATCH --reservation=r1", "#SBATCH --hint=nomultithread", "#SBATCH --mail-type=END,FAIL",
                 "#SBATCH --nice=10", "#SBATCH --contiguous"):
        assert line in script.splitlines(), script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert " --cpu-bind=cores --mpi=pmix " in srun, srun
    assert dry["plan"]["slurm"]["site_options"] == {"contiguous": True, "hint": "nomultithread", "mail-type": "END,FAIL",
                                                    "nice": "10", "reservation": "r1"}
    assert "--mpi=pmix" in dry["plan"]["srun_args"]
    assert not any("documented options" in n for n in dry["plan"]["notes"])  # all of them are SLURM's own


def test_the_spec_overrides_the_profiles_options_and_null_drops_one(tmp_path):
    root = _profile_with(tmp_path, "slurm:\n  sbatch: {reservation: site-res, hint: compute_bound}\n  srun: {mpi: pmix}\n")
    plain = _dry(profiles=root)
    assert plain["plan"]["slurm"]["site_options"] == {"hint": "compute_bound", "reservation": "site-res"}
    assert "--mpi=pmix" in plain["plan"]["srun_args"]
    mine = _dry("slurm.sbatch={hint: nomultithread, reservation: null}", "slurm.srun={mpi: null}", profiles=root)
    assert mine["plan"]["slurm"]["site_options"] == {"hint": "nomultithread"}
    assert not any(a.startswith("--mpi") for a in mine["plan"]["srun_args"])
    assert "--reservation" not in mine["script"]


@pytest.mark.parametrize("kind,option,owner", [
    ("sbatch", "time", "resources.time"),
    ("sbatch", "nodes", "resources.nodes"),
    ("sbatch", "partition", "resources.partition"),
    ("sbatch", "signal", "preemption.warning_signal"),
    ("sbatch", "requeue", "every job requeues itself"),
    ("sbatch", "output", "the run directory's logs"),
    ("sbatch", "array", "lmlaunch sweep"),
    ("sbatch", "dependency", "--after"),
    ("sbatch", "gres", "resources.gpus_per_node"),
    ("sbatch", "job-name", "name"),
    ("srun", "ntasks-per-node", "resources.tasks_per_node"),
    ("srun", "overlap", "lmlaunch stacks"),
    ("srun", "container-image", "the profile's container"),
])
def test_an_option_lmlaunch_plans_itself_is_refused_naming_the_key_that_owns_it(tmp_path, kind, option, owner):
    spec = tmp_path / "job.yaml"
    spec.write_text((REPO / "jobs" / "tiny-cpu.yaml").read_text() + f"slurm:\n  {kind}:\n    reservation: r1\n    {option}: x\n")
    if kind == "srun":
        spec.write_text(spec.read_text().replace("    reservation: r1\n", "    mpi: pmix\n"))
    code, out, err = lm("validate", str(spec))
    assert code == 4, out + err
    line = len(spec.read_text().splitlines())
    assert f"slurm.{kind}.{option} (line {line}): lmlaunch plans --{option} itself; set it through" in err, err
    assert owner in err, err


def test_a_profile_may_not_set_a_planned_option_either(tmp_path):
    root = _profile_with(tmp_path, "slurm:\n  sbatch:\n    ntasks: 4\n")
    code, out, err = lm("validate", str(REPO / "jobs" / "tiny-cpu.yaml"), profiles=root)
    assert code == 4 and "local.yaml" in err and "slurm.sbatch.ntasks" in err and "lmlaunch plans --ntasks itself" in err, err


@pytest.mark.parametrize("value", ["a b", "x;rm -rf /", "$(id)", "'q'", "a\nb", "`id`", "", "a\"b"])
def test_a_value_that_could_bend_the_script_is_refused(value):
    with pytest.raises(ValueError, match="is not an sbatch/srun option value"):
        site_options.check_value(value, may_drop=False)
    code, out, err = lm("validate", str(REPO / "jobs" / "tiny-cpu.yaml"), f"slurm.sbatch={json.dumps({'comment': value})}")
    assert code == 4 and "slurm.sbatch.comment" in err, err


@pytest.mark.parametrize("name", ["--hint", "Hint", "mail_type", "h", "a--b", "x=y", "hint ", "-"])
def test_a_name_that_is_not_a_long_options_name_is_refused(name):
    with pytest.raises(ValueError, match="is not an sbatch/srun option name"):
        site_options.check_name("sbatch", name)


def test_false_or_a_profiles_null_is_not_a_value():
    with pytest.raises(ValueError, match="False is not a value"):
        site_options.check_value(False, may_drop=True)
    with pytest.raises(ValueError, match="None is not a value"):
        site_options.check_value(None, may_drop=False)
    assert site_options.check_value(None, may_drop=True) is None
    assert site_options.check_value(3, may_drop=False) == "3"


def test_an_option_slurm_does_not_document_is_a_note_with_the_closest_name():
    dry = _dry("slurm.sbatch={reservaton: r1}", "slurm.srun={container-workdir: /w}")
    notes = dry["plan"]["notes"]
    assert any(n.startswith("slurm.sbatch.reservaton: --reservaton is not among sbatch's documented options of "
                            "SLURM 22.05 (did you mean reservation?)") and "sbatch --test-only" in n for n in notes), notes
    assert any(n.startswith("slurm.srun.container-workdir: --container-workdir is not among srun's") for n in notes), notes


def test_the_node_probe_runs_where_the_job_would_with_the_sites_options(tmp_path):
    from launcher.doctor import nodes as doctor_nodes
    from launcher.planning.resolve import resolve

    env = {**ENVIRON, "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "LMLAUNCH_HOME": str(tmp_path / "home")}
    plan = resolve(str(REPO / "jobs" / "tiny-cpu.yaml"),
                   ["slurm.sbatch={reservation: r1, hint: nomultithread, mail-type: END, ignore-pbs: true}",
                    "slurm.srun={mpi: pmix}"], None, env, python="/venv/bin/python").plan
    args = doctor_nodes.srun_args(plan, "probe", tmp_path)
    assert {"--reservation=r1", "--hint=nomultithread", "--mpi=pmix"} <= set(args)
    assert not any(a.startswith(("--mail-type", "--ignore-pbs")) for a in args)  # no mail about a probe; sbatch-only
