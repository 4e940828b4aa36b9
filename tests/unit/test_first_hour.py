"""What a new user meets first, in-process through the real CLI: `--version`, usage errors that
show the command's own usage with a hint where another CLI's habit shows, `--json` that is JSON on
success and on failure (every shipped spec), and validate refusing what would fail at run time
(the sequence length against the model's positions; a data path that is a raw file, not prepared,
or missing where this machine would see it)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from launcher.cli import main, usage_hint
from launcher.context import Context
from launcher.planning.data_check import position_checks, store_path_checks
from lmcore.job.spec import DataSource

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "jobs").glob("*.yaml"))
TINY = str(REPO / "jobs" / "tiny-cpu.yaml")


@pytest.fixture(autouse=True)
def _own_registry(tmp_path, monkeypatch):
    """A registry and runs root of the test's own: a run of the user's named as a spec here (the demo's
    tiny-cpu) would make the dry run refuse the name, as submit does."""
    monkeypatch.setenv("LMLAUNCH_HOME", str(tmp_path / "lmhome"))
    monkeypatch.setenv("LMLAUNCH_RUNS_ROOT", str(tmp_path / "lmruns"))


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), Context(stdout=out, stderr=err, environ=dict(os.environ)))
    return code, out.getvalue(), err.getvalue()


def test_version_names_lmlaunch_its_python_and_the_packages_a_bug_report_needs(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"], Context(stdout=io.StringIO(), stderr=io.StringIO(), environ={}))
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.startswith("lmlaunch 0.") and "python 3." in out and "torch 2." in out and "lightning " in out, out


@pytest.mark.parametrize(("words", "hint"), [
    (["validate", "j.yaml", "--trainer.max_steps=10"], "overrides are written without dashes: trainer.max_steps=10"),
    (["submit", "j.yaml", "--trainer.max_steps", "10"], "as key=value: trainer.max_steps=10"),
    (["submit", "j.yaml", "++optim.lr=1e-3"], "without dashes: optim.lr=1e-3"),
    (["submit", "j.yaml", "--dry-run"], None), (["status", "--all"], None), (["logs", "-f", "x.y"], None),
])
def test_a_habit_of_another_cli_gets_a_hint(words, hint):
    got = usage_hint(words)
    assert (got is None) if hint is None else (got is not None and hint in got), got


def test_a_subcommands_usage_error_prints_that_subcommands_usage_and_the_hint():
    code, out, err = cli("validate", TINY, "--trainer.max_steps=10")
    assert code == 2 and out == ""
    assert err.startswith("usage: lmlaunch validate") and "lmlaunch validate: error: unrecognized arguments" in err, err
    assert "hint: overrides are written without dashes: trainer.max_steps=10" in err, err
    code, _, err = cli("data", "prepare", "x", "--no-such-flag")
    assert code == 2 and err.startswith("usage: lmlaunch data prepare"), err  # the innermost command's usage
    code, out, err = cli("status", "--json", "--no-such-flag")
    assert code == 2 and err.startswith("usage: lmlaunch status")
    error = json.loads(out)["error"]
    assert json.loads(out)["ok"] is False and error["kind"] == "usage" and error["exit_code"] == 2, out


@pytest.mark.parametrize("spec", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_validate_json_is_json_for_every_shipped_spec(spec):
    code, out, err = cli("validate", str(spec), "--json")
    got = json.loads(out)
    assert code == 0 and got["ok"] is True, err
    topo = got["topology"] if "topology" in got else got["clusters"][0]["topology"]
    assert topo["world_size"] == topo["nodes"] * topo["tasks_per_node"]
    assert topo["parallelism"]["world_size"] == topo["world_size"] and topo["data_parallel_size"] >= 1


def test_validate_json_of_an_invalid_spec_is_json_naming_every_problem():
    code, out, err = cli("validate", TINY, "trainer.max_steps=-1", "data.micro_batch_size=0", "--json")
    got = json.loads(out)
    assert code == 4 and got["ok"] is False and got["error"]["kind"] == "invalid", out
    assert len(got["error"]["problems"]) == 2 and "trainer.max_steps" in out and "data.micro_batch_size" in out, out
    assert err.startswith("error: "), err  # the terminal still says it
    code, out, _ = cli("validate", "/no/such/spec.yaml", "--json")  # an argument naming nothing: a usage error
    assert code == 2 and json.loads(out)["error"]["kind"] == "usage"


def test_a_sequence_longer_than_learned_positions_is_refused_naming_both_keys():
    code, out, err = cli("validate", TINY, "data.seq_len=4096")
    assert code == 4 and out == ""
    assert "data.seq_len 4096 is longer than the model's 128 learned positions" in err, err
    assert "set data.seq_len: 128 or less, or model.config.n_positions: 4096 or more" in err, err
    assert "memory" not in err  # root cause first: not the consequence (activations for 4096 tokens)


def test_positions_a_learned_table_refuses_computed_positions_note():
    learned = {"learned": 102 - 2, "configured": 100, "key": "max_position_embeddings"}  # OPT: offset 2
    problems, notes = position_checks(101, learned)
    assert problems and "model.config.max_position_embeddings: 101 or more" in problems[0] and not notes
    assert position_checks(100, learned) == ([], [])
    problems, notes = position_checks(4096, {"learned": None, "configured": 2048, "key": "max_position_embeddings"})
    assert not problems and "computed (rotary or ALiBi), so it runs" in notes[0]
    assert position_checks(4096, {}) == ([], [])  # facts unknown (a CLI-only install): nothing claimed


def test_a_data_path_that_is_a_raw_file_unprepared_or_missing_here_is_refused(tmp_path):
    raw = tmp_path / "corpus.jsonl"
    raw.write_text('{"text": "hello"}\n')
    code, _, err = cli("validate", TINY, f"data.path={raw}")
    assert code == 4 and "a raw text file, not a prepared store" in err and f"lmlaunch data prepare {raw} --out DIR" in err
    code, _, err = cli("validate", TINY, f"data.path={tmp_path}")
    assert code == 4 and "meta.json is missing: not a prepared data directory" in err, err
    code, _, err = cli("validate", TINY, f"data.path={tmp_path / 'typo'}")
    assert code == 4 and "no such directory here" in err and "--on-cluster" in err, err


def test_a_missing_store_is_a_note_where_the_nodes_may_see_it_or_an_earlier_job_makes_it(tmp_path):
    def store(path: Path) -> list:
        return [("data.path", DataSource(path=str(path), weight=1.0), None)]

    elsewhere = Path("/no-such-top-directory-here/data/tiny")
    problems, notes = store_path_checks(store(elsewhere), seen_here=True, later=False)
    assert not problems and "its filesystem is not visible from here" in notes[0]
    problems, notes = store_path_checks(store(tmp_path / "later"), seen_here=True, later=True)
    assert not problems and "made by the job this one runs after" in notes[0]
    problems, notes = store_path_checks(store(tmp_path / "later"), seen_here=False, later=False)
    assert not problems and notes  # SLURM over SSH or slurmrestd: the login node's paths, not these
    problems, _ = store_path_checks(store(tmp_path / "later"), seen_here=True, later=False)
    assert problems and "no such directory here" in problems[0]


def test_logs_of_a_rank_the_run_never_had_is_refused_with_its_ranks(tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from monitor_synth import T0, make_run

    run_dir = make_run(tmp_path, "r2", attempts=[{"job_id": "101", "start_step": 0, "end_step": 20, "t0": T0 - 100,
                                                  "t1": T0, "reason": "completed"}], log_lines={1: ["hello from rank 0"]})
    (run_dir / "plan.json").write_text(json.dumps({"topology": {"world_size": 2}}))
    out, err = io.StringIO(), io.StringIO()
    env = {"LMLAUNCH_HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    code = main(["logs", "r2", "--rank", "5"], Context(stdout=out, stderr=err, environ=env))
    assert code == 2 and "--rank 5: run 'r2' has ranks 0 to 1 (world_size 2)" in err.getvalue(), err.getvalue()
    code = main(["logs", "r2", "--rank", "0"], Context(stdout=out, stderr=err, environ=env))
    assert code == 0 and "hello from rank 0" in out.getvalue()


def test_status_watch_of_a_run_ends_when_the_run_has_ended():
    from argparse import Namespace

    from launcher.commands.status import _ended
    from launcher.monitor.status_rows import StatusRow

    def row(group: str) -> StatusRow:
        return StatusRow(name="r", job_id="1", state=group.upper(), group=group, reason=None, requeued=False,
                         nodes=2, elapsed=None, time_limit=None, attempt=1, step=None, max_steps=None, loss=None,
                         tokens_per_s=None, mfu=None, checkpoint_step=None, checkpoint_age_s=None, eta_s=None,
                         heartbeat_age_s=None, run_dir="/r", job_ids=["1"])

    named, every = Namespace(run="r"), Namespace(run=None)
    assert _ended(named, [row("completed")]) and _ended(named, [row("failed"), row("cancelled")])  # a sweep's points
    assert not _ended(named, [row("completed"), row("running")]) and not _ended(named, [row("queued")])
    assert not _ended(named, [row("unknown")])  # SLURM did not answer: keep watching
    assert not _ended(every, [row("completed")])  # every run: until Ctrl-C


def test_examples_writes_every_shipped_spec_and_never_overwrites_a_changed_one(tmp_path):
    code, out, err = cli("examples", str(tmp_path))
    written = sorted(p.relative_to(tmp_path / "jobs") for p in (tmp_path / "jobs").rglob("*.yaml"))
    assert code == 0 and written == sorted(p.relative_to(REPO / "jobs") for p in (REPO / "jobs").rglob("*.yaml")), err
    assert f"lmlaunch data prepare --shipped-corpus --out {tmp_path / 'data' / 'prepared' / 'tiny'}" in out
    assert cli("examples", str(tmp_path))[0] == 0  # the same files again: nothing to refuse
    mine = tmp_path / "jobs" / "tiny-cpu.yaml"
    mine.write_text(mine.read_text() + "# mine\n")
    code, _, err = cli("examples", str(tmp_path))
    assert code == 2 and "differ from the examples" in err and mine.read_text().endswith("# mine\n"), err
    assert cli("examples", str(tmp_path), "--force")[0] == 0 and not mine.read_text().endswith("# mine\n")


def test_more_nodes_than_the_partition_has_spares_included_is_refused_at_validate(tmp_path):
    import yaml

    from launcher.spec.profile_draft import ClusterFacts, partitions

    facts = ClusterFacts(partitions=[{"PartitionName": "p", "TotalNodes": "4", "MaxNodes": "UNLIMITED"},
                                     {"PartitionName": "q", "TotalNodes": "8", "MaxNodes": "2"},
                                     {"PartitionName": "r"}], nodes=[], config={})
    assert [p.size for p in partitions(facts)] == [4, 2, None]  # profile init: TotalNodes, or a lower MaxNodes
    local = yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())
    local["partitions"]["low"]["nodes"] = 2
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(local))
    env = {**os.environ, "LMLAUNCH_PROFILES_DIR": str(tmp_path)}
    out, err = io.StringIO(), io.StringIO()
    code = main(["submit", TINY, "resources.spare_nodes=1", "--dry-run"], Context(stdout=out, stderr=err, environ=env))
    assert code == 4 and "#SBATCH" not in out.getvalue(), out.getvalue()
    assert ("resources.nodes(2) + resources.spare_nodes(1) = 3 is above the 2 node(s) of partition 'low' "
            "(profile 'local')") in err.getvalue(), err.getvalue()
    code = main(["validate", TINY], Context(stdout=out, stderr=err, environ=env))
    assert code == 0  # 2 nodes fit


def test_more_memory_a_node_than_the_profiles_nodes_have_is_refused_at_validate(tmp_path):
    """resources.mem, or the profile's mem_per_gpu x GPUs, against its mem_per_node (what `profile
    init` reads off RealMemory): SLURM would queue the job and never start it."""
    code, _, err = cli("validate", TINY, "resources.mem=8G")
    assert code == 4 and ("resources.mem(8G) is above the 4G a node of profile 'local' has (mem_per_node): SLURM "
                          "would never start the job; ask 4G or less") in err, err
    assert cli("validate", TINY, "resources.mem=4G")[0] == 0
    import yaml

    h100 = yaml.safe_load((REPO / "cluster_profiles" / "h100-ib.yaml").read_text())
    h100["mem_per_node"] = "1000G"  # below mem_per_gpu(220G) x 8
    (tmp_path / "h100-ib.yaml").write_text(yaml.safe_dump(h100))
    out, err = io.StringIO(), io.StringIO()
    code = main(["validate", str(REPO / "jobs" / "llama-1b-zero2.yaml"), "--cluster", "h100-ib"],
                Context(stdout=out, stderr=err, environ={**os.environ, "LMLAUNCH_PROFILES_DIR": str(tmp_path)}))
    assert code == 4 and ("the job's memory per node, mem_per_gpu(220G) x gpus_per_node(8) = 1802240M, is above the "
                          "1000G a node of profile 'h100-ib' has") in err.getvalue(), err.getvalue()


def test_the_dry_run_makes_the_checks_submit_makes_on_the_run_name_and_says_what_resume_starts_from(tmp_path):
    env = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "LMLAUNCH_HOME": str(tmp_path / "home")}

    def dry(*extra: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = main(["submit", TINY, "name=again", "--dry-run", *extra], Context(stdout=out, stderr=err, environ=env))
        return code, out.getvalue(), err.getvalue()

    assert dry()[0] == 0
    code, _, err = dry("--resume")
    assert code == 2 and "there is no run directory" in err, err
    (tmp_path / "runs" / "again").mkdir(parents=True)
    (tmp_path / "runs" / "again" / "spec.yaml").write_text("name: again\n")
    code, out, err = dry()
    assert code == 2 and "run 'again' already exists" in err and "--resume" in err and not out, err
    code, out, err = dry("--resume")
    said = "run 'again' has no checkpoint and never trained past step 0: it starts at step 0"
    assert code == 0 and out.startswith(f"# {said}\n# the cluster"), out[:300]  # never trained: nothing to lose
    assert "\n# lmlaunch plan" in out  # (the controller's answer, where it answers: tests/integration/test_submit_local.py)
    code, out, err = dry("--resume", "--json")
    assert code == 0 and json.loads(out)["opening"] == [said], out[:300]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_long_work_says_what_runs_on_a_terminal_and_nothing_in_a_pipe_or_under_json():
    err = _Terminal()
    code = main(["validate", TINY], Context(stdout=io.StringIO(), stderr=err, environ=dict(os.environ)))
    assert code == 0 and "validating" in err.getvalue() and "its memory" in err.getvalue()  # then erased
    err = _Terminal()
    code = main(["validate", TINY, "--json"], Context(stdout=io.StringIO(), stderr=err, environ=dict(os.environ)))
    assert code == 0 and err.getvalue() == ""  # --json: quiet
    code, _, err_text = cli("validate", TINY)  # a pipe
    assert code == 0 and "validating" not in err_text


def test_data_prepare_says_how_far_it_is_on_a_terminal_only(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich's width: each status on one line
    corpus = tmp_path / "c.txt"
    corpus.write_text("some words to tokenize\n" * 200)
    err = _Terminal()
    code = main(["data", "prepare", str(corpus), "--out", str(tmp_path / "store")],
                Context(stdout=io.StringIO(), stderr=err, environ=dict(os.environ)))
    said = " ".join(err.getvalue().split())  # as rich wrapped it
    assert code == 0 and f"preparing {tmp_path / 'store'}: " in said, said
    assert "tokens in this shard" in said, said  # the batches' counts, as they are written
    code, out, err_text = cli("data", "prepare", str(corpus), "--out", str(tmp_path / "again"))  # a pipe
    assert code == 0 and out.startswith("ok: ") and "preparing" not in err_text


def _json_commands() -> list[tuple[list[str], int]]:
    """Every (sub)command with --json, found in the parsers: its words and its required positionals."""
    import argparse

    from launcher.cli import build_parser

    def walk(p: argparse.ArgumentParser, path: list[str]):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from walk(sub, [*path, name])
        if any("--json" in a.option_strings for a in p._actions):
            yield path, sum(1 for a in p._actions if not a.option_strings and a.nargs not in ("?", "*")
                            and not isinstance(a, argparse._SubParsersAction))

    return list(walk(build_parser(), []))


def test_every_command_with_json_prints_json_when_it_fails(tmp_path):
    commands = _json_commands()
    assert len(commands) >= 15 and ["validate"] in [c for c, _ in commands]
    env = {**os.environ, "LMLAUNCH_HOME": str(tmp_path / "home"), "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs")}
    for words, positionals in commands:
        out, err = io.StringIO(), io.StringIO()
        code = main([*words, *["/no/such/thing"] * positionals, "--json"], Context(stdout=out, stderr=err, environ=env))
        got = json.loads(out.getvalue())  # JSON whether it worked or not
        if positionals:  # a spec, run or file that is not there
            assert code == 2 and got["ok"] is False and got["error"]["exit_code"] == 2, (words, out.getvalue())
            assert err.getvalue().startswith("error: "), (words, err.getvalue())
        else:
            assert code == 0, (words, err.getvalue())


@pytest.mark.parametrize("command", ["validate", "submit", "status", "logs", "doctor"])
def test_the_main_commands_help_ends_with_examples_that_parse(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"], Context(stdout=io.StringIO(), stderr=io.StringIO(), environ={}))
    text = capsys.readouterr().out
    assert done.value.code == 0 and "\nexamples:\n" in text, text
    from launcher.cli import _parse, build_parser

    for line in text.split("\nexamples:\n")[1].splitlines():
        words = line.split("#")[0].split()
        assert words[:2] == ["lmlaunch", command] and _parse(build_parser(only=command), words[1:]).command == command


def test_a_spec_without_gpus_per_node_on_a_gpu_profile_is_planned_on_its_gpus(tmp_path):
    import yaml

    spec = yaml.safe_load((REPO / "jobs" / "tiny-cpu.yaml").read_text())  # the demo's small model, on h100-ib
    for key in ("gpus_per_node", "tasks_per_node", "cpus_per_task"):
        del spec["resources"][key]
    spec["resources"]["nodes"], spec["cluster"], spec["trainer"]["global_batch_size"] = 1, "h100-ib", 64
    spec["data"]["path"] = str(REPO / "data" / "prepared" / "tiny")
    path = tmp_path / "nogpus.yaml"
    path.write_text(yaml.safe_dump(spec))
    code, out, err = cli("submit", str(path), "--dry-run", "--json")
    plan = json.loads(out)["plan"]
    assert code == 0 and plan["topology"]["accelerator"] == "gpu" and plan["topology"]["tasks_per_node"] == 8, err
    assert "#SBATCH --gres=gpu:8" in json.loads(out)["script"]
    assert any("the GPUs per node of profile 'h100-ib' (the spec leaves it out" in n for n in plan["notes"])
    code, out, _ = cli("submit", str(path), "resources.gpus_per_node=0", "resources.tasks_per_node=4", "--dry-run",
                       "--json")
    assert code == 0 and json.loads(out)["plan"]["topology"]["accelerator"] == "cpu"  # said explicitly: a CPU job
    code, _, err = cli("validate", str(path), "resources.tasks_per_node=2")
    assert code == 4 and "with resources.gpus_per_node left out: profile 'h100-ib' has 8 GPUs per node" in err, err


@pytest.mark.parametrize(("said", "keys"), [
    ("allocation failure: Requested reservation is invalid", "slurm.sbatch.reservation"),
    ("Invalid account or account/partition combination specified", "resources.account, resources.partition"),
    ("Invalid qos specification", "resources.qos"), ("allocation failure: Invalid partition name specified",
                                                     "resources.partition"),
    ("allocation failure: Invalid feature specification", "resources.constraint"),
    ("sbatch: error: Invalid generic resource (gres) specification", "resources.gpus_per_node"),
    ("Requested time limit is invalid (missing or exceeds some limit)", "resources.time"),
    ("Memory specification can not be satisfied", "resources.mem"), ("Socket timed out", None)])
def test_a_refusal_by_the_controller_names_the_keys_its_words_concern(said, keys):
    """SLURM's own words (sbatch's, or --test-only's in the dry run) mapped to the spec's keys."""
    from launcher.submit.shape_check import keys_of

    assert keys_of(said) == (f"; it concerns {keys}" if keys else "")

