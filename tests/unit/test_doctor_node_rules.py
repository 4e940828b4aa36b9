"""The pure parts of `lmlaunch doctor --on-nodes [--exclude-bad]`: the median rule, interface
selection in NCCL's and gloo's syntax, the all-reduce threshold, which failures exclude a node,
the excluded-nodes record, and how the plan and the dry run carry the exclusion."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.context import Context
from launcher.doctor import nodes as doctor_nodes
from launcher.doctor.checks import FAIL, OK, WARN
from launcher.spec import excluded_nodes
from lmcore.errors import UserError
from lmcore.node_facts import AllReduce, NodeFacts, select_interfaces

REPO = Path(__file__).resolve().parents[2]
IFACES = ("docker0", "eth0", "eth1", "ib0", "lo")


def facts(node: str, rank: int = 0, *, gemm: float | None = 100.0, mem: float | None = 30.0,
          write: float | None = 400.0, env: dict[str, str] | None = None, ar: AllReduce | None = None,
          errors: dict[str, str] | None = None) -> NodeFacts:
    return NodeFacts(node=node, rank=rank, device="cpu (1 threads)", gemm_gflops=gemm, mem_gbps=mem,
                     write_mbps=write, write_path="/ckpt", interfaces=IFACES, ifname_env=env or {},
                     allreduce=ar, errors=errors or {})


def by_name(checks):
    return {c.name: c for c in checks}


# --------------------------------------------------------------------------- median rule
def test_a_node_below_half_the_median_fails_naming_node_and_figure():
    checks = by_name(doctor_nodes.judge_vs_median("gemm_gflops", {"n1": 100.0, "n2": 98.0, "n3": 40.0}))
    slow = checks["GEMM n3"]
    assert slow.status == FAIL
    assert slow.message == "n3: GEMM 40.0 GFLOP/s is below 0.5 x the median 98.0 GFLOP/s of 3 nodes"
    assert slow.figures == {"node": "n3", "gemm_gflops": 40.0, "median": 98.0, "factor": 0.5, "nodes": 3}
    assert checks["GEMM n1"].status == checks["GEMM n2"].status == OK


def test_a_node_just_above_half_the_median_passes():
    checks = by_name(doctor_nodes.judge_vs_median("mem_gbps", {"n1": 30.0, "n2": 30.0, "n3": 15.5}))
    assert checks["memory copy n3"].status == OK


def test_two_nodes_one_five_times_slower_the_slow_one_fails():
    # the local cluster's case: n2's slurmd held to 20% of a core (18.8 vs 101.7 GFLOP/s measured)
    checks = by_name(doctor_nodes.judge_vs_median("gemm_gflops", {"n1": 101.7, "n2": 18.8}))
    assert checks["GEMM n2"].status == FAIL and checks["GEMM n1"].status == OK


def test_a_slow_checkpoint_write_is_a_warning_and_missing_figures_are_left_out():
    checks = by_name(doctor_nodes.judge_vs_median("write_mbps", {"n1": 400.0, "n2": 390.0, "n3": 50.0, "n4": None}))
    assert checks["checkpoint write+fsync n3"].status == WARN
    assert "below 0.25 x the median" in checks["checkpoint write+fsync n3"].message
    # a shared disk's noise is not a slow node: 0.37x of the other node (seen under load) passes
    two = by_name(doctor_nodes.judge_vs_median("write_mbps", {"n1": 237.0, "n2": 649.0}))
    assert two["checkpoint write+fsync n1"].status == OK, two
    assert "checkpoint write+fsync n4" not in checks
    assert doctor_nodes.judge_vs_median("write_mbps", {"n1": None}) == []


def test_a_failed_measurement_is_a_failure_naming_node_and_error():
    checks = by_name(doctor_nodes.judge_nodes([facts("n1", errors={"write_mbps": "PermissionError: [Errno 13]"},
                                                     write=None, ar=AllReduce("gloo", 1, 1, None, None, skipped="x"))],
                                              ["n1"], 1.0))
    c = checks["checkpoint write+fsync n1"]
    assert c.status == FAIL and c.message == "n1: checkpoint write+fsync failed: PermissionError: [Errno 13]"


def test_a_node_that_gave_no_figures_is_named_with_its_last_line():
    ar = AllReduce("gloo", 2, 1 << 24, None, None, error="timeout")
    checks = by_name(doctor_nodes.judge_nodes([facts("n1", ar=ar)], ["n1", "n2"], 1.0,
                                              {"n2": "ModuleNotFoundError: No module named 'torch'"}))
    assert checks["probe n2"].status == FAIL
    assert "ModuleNotFoundError" in checks["probe n2"].message


# --------------------------------------------------------------------------- interfaces
@pytest.mark.parametrize("value, selected, ok", [
    ("eth", ("eth0", "eth1"), True),                 # prefix
    ("ib,eth", ("eth0", "eth1", "ib0"), True),       # comma list of prefixes
    ("=eth0", ("eth0",), True),                      # exact
    ("=eth", (), False),                             # exact: "eth" is no interface
    ("^lo,docker", ("eth0", "eth1", "ib0"), True),   # exclusion by prefix
    ("^=eth", IFACES, True),                         # exact exclusion of a name that is not there
    ("^e,i,d,l", (), False),                         # everything excluded
    ("nosuch", (), False),
    ("nosuch,ib", ("ib0",), True),                   # NCCL ignores a prefix that matches nothing
])
def test_nccl_socket_ifname_syntax(value, selected, ok):
    v = select_interfaces("NCCL_SOCKET_IFNAME", value, IFACES)
    assert (v.selected, v.ok) == (selected, ok), v


def test_nccl_no_match_names_the_variable_and_the_nodes_interfaces():
    v = select_interfaces("NCCL_SOCKET_IFNAME", "=bond0", IFACES)
    assert not v.ok and v.missing == ("bond0",)
    assert v.why == "NCCL_SOCKET_IFNAME==bond0: no interface matches bond0 (the node has docker0, eth0, eth1, ib0, lo)"


def test_gloo_names_are_exact_and_each_must_exist():
    assert select_interfaces("GLOO_SOCKET_IFNAME", "lo", IFACES).ok
    assert not select_interfaces("GLOO_SOCKET_IFNAME", "eth", IFACES).ok  # no prefixes in gloo
    v = select_interfaces("GLOO_SOCKET_IFNAME", "eth0,nosuch0", IFACES)
    assert not v.ok and v.missing == ("nosuch0",) and "no such interface nosuch0" in v.why


def test_interface_checks_name_node_and_variable():
    checks = doctor_nodes.judge_interfaces(facts("n7", env={"GLOO_SOCKET_IFNAME": "nosuch0",
                                                            "NCCL_SOCKET_IFNAME": "^lo"}))
    got = {c.name: c.status for c in checks}
    assert got == {"NCCL_SOCKET_IFNAME n7": OK, "GLOO_SOCKET_IFNAME n7": FAIL}
    gloo = next(c for c in checks if c.status == FAIL)
    assert gloo.message.startswith("n7: GLOO_SOCKET_IFNAME=nosuch0: no such interface nosuch0")


# --------------------------------------------------------------------------- all-reduce threshold
def _ar(busbw: float | None, **kw) -> list[NodeFacts]:
    ar = AllReduce("gloo", 2, 1 << 24, 0.02 if busbw else None, busbw, **kw)
    return [facts("n2", 1, ar=ar), facts("n1", 0, ar=ar)]


def test_allreduce_below_the_profile_minimum_fails_with_both_figures():
    c = doctor_nodes.judge_allreduce(_ar(0.4), 1.0)
    assert c.status == FAIL and "bus bandwidth 0.40 GB/s is below the profile's min_allreduce_busbw_gbps 1" in c.message
    assert c.figures["busbw_gbps"] == 0.4 and c.figures["min_busbw_gbps"] == 1.0


def test_allreduce_at_or_above_the_minimum_passes_and_zero_turns_it_off():
    assert doctor_nodes.judge_allreduce(_ar(1.2), 1.0).status == OK
    assert doctor_nodes.judge_allreduce(_ar(0.01), 0.0).status == OK


def test_allreduce_skipped_or_broken():
    assert doctor_nodes.judge_allreduce(_ar(None, skipped="n1: GLOO_SOCKET_IFNAME ..."), 1.0).status == FAIL
    assert doctor_nodes.judge_allreduce(_ar(None, error="RuntimeError: Connection reset"), 1.0).status == FAIL
    one = [facts("n1", ar=AllReduce("gloo", 1, 1 << 24, None, None, skipped="one node: no network to measure"))]
    assert doctor_nodes.judge_allreduce(one, 1.0).status == WARN
    assert doctor_nodes.judge_allreduce([facts("n1")], 1.0).status == FAIL


# --------------------------------------------------------------------------- which nodes are bad
def test_bad_nodes_are_the_slow_ones_with_every_reason():
    ar = AllReduce("gloo", 3, 1 << 24, 0.01, 3.0)
    checks = doctor_nodes.judge_nodes([facts("n1", 0, ar=ar), facts("n2", 1, gemm=20.0, mem=5.0, ar=ar),
                                       facts("n3", 2, ar=ar)], ["n1", "n2", "n3"], 1.0)
    bad = doctor_nodes.bad_nodes(checks, ["n1", "n2", "n3"])
    assert list(bad) == ["n2"]
    assert bad["n2"] == ("GEMM 20.0 GFLOP/s is below 0.5 x the median 100.0 GFLOP/s of 3 nodes; "
                         "memory copy 5.0 GB/s is below 0.5 x the median 30.0 GB/s of 3 nodes")


def test_a_failure_every_node_shares_excludes_no_node():
    ar = AllReduce("gloo", 2, 1 << 24, None, None, skipped="blocked")
    env = {"GLOO_SOCKET_IFNAME": "nosuch0"}
    checks = doctor_nodes.judge_nodes([facts("n1", 0, env=env, ar=ar), facts("n2", 1, env=env, ar=ar)],
                                      ["n1", "n2"], 1.0)
    assert sum(c.status == FAIL for c in checks) == 3  # both interfaces and the all-reduce
    assert doctor_nodes.bad_nodes(checks, ["n1", "n2"]) == {}
    # ... unless only some nodes lack it
    checks = doctor_nodes.judge_nodes([facts("n1", 0, ar=ar), facts("n2", 1, env=env, ar=ar)], ["n1", "n2"], 1.0)
    assert list(doctor_nodes.bad_nodes(checks, ["n1", "n2"])) == ["n2"]


# --------------------------------------------------------------------------- the record
def _rec(**nodes: str) -> dict[str, excluded_nodes.Exclusion]:
    return {n: excluded_nodes.Exclusion(n, r, since=1.0) for n, r in nodes.items()}


def test_merge_adds_failed_nodes_and_clears_nodes_that_pass_now():
    m = excluded_nodes.merge(_rec(n2="slow", n5="old"), {"n3": "GEMM low"}, ["n1", "n2", "n3"], now=9.0, job_id="7")
    assert m.added == ("n3",) and m.cleared == ("n2",) and m.kept == ("n5",)  # n5 was not probed: kept
    assert list(m.record) == ["n3", "n5"] and m.record["n3"].since == 9.0 and m.record["n3"].job_id == "7"


def test_merge_without_exclude_bad_only_clears_and_refreshes():
    m = excluded_nodes.merge(_rec(n2="slow"), {"n2": "slower", "n3": "GEMM low"}, ["n1", "n2", "n3"], now=9.0,
                             add=False)
    assert m.added == () and list(m.record) == ["n2"] and m.record["n2"].reason == "slower"


def test_a_node_both_failed_and_listed_as_probed_stays_excluded():
    m = excluded_nodes.merge(_rec(n2="slow"), {"n2": "still slow"}, ["n1", "n2"], now=2.0)
    assert m.cleared == () and m.record["n2"].reason == "still slow"


def test_record_round_trip_private_and_empty_removes_it(tmp_path):
    path = tmp_path / "home" / "excluded-nodes" / "local.json"
    excluded_nodes.save(path, _rec(n2="GEMM 18.8 GFLOP/s is below 0.5 x the median"))
    assert (path.stat().st_mode & 0o777) == 0o600
    assert excluded_nodes.load(path) == _rec(n2="GEMM 18.8 GFLOP/s is below 0.5 x the median")
    excluded_nodes.save(path, {})
    assert not path.exists() and excluded_nodes.load(path) == {}


def test_a_damaged_record_is_a_clear_error_naming_the_file(tmp_path):
    path = tmp_path / "local.json"
    path.write_text('{"version": 1, "nodes": {"n2": {"node": "n2"}}}')
    with pytest.raises(UserError, match=r"local.json: not a record of excluded nodes .*delete it"):
        excluded_nodes.load(path)


# --------------------------------------------------------------------------- plan, script, dry run
def _dry_run(tmp_path: Path, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    env = {"LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "LMLAUNCH_HOME": str(tmp_path / "home"),
           "HOME": str(tmp_path), "USER": "u", "PATH": "/usr/bin"}
    # --offline: the controller is not asked (the live 2-node cluster would refuse a 2-node job without n2)
    code = main(["submit", str(REPO / "jobs" / "tiny-cpu.yaml"), "--dry-run", "--offline", *extra],
                Context(stdout=out, stderr=io.StringIO(), environ=env))
    return code, out.getvalue()


def test_the_dry_run_excludes_recorded_nodes_with_the_reason(tmp_path):
    code, text = _dry_run(tmp_path)
    assert code == 0 and "--exclude" not in text
    excluded_nodes.save(tmp_path / "home" / "excluded-nodes" / "local.json",
                        {"n2": excluded_nodes.Exclusion("n2", "GEMM 18.8 GFLOP/s is below 0.5 x the median "
                                                        "60.2 GFLOP/s of 2 nodes", since=0.0, job_id="41")})
    code, text = _dry_run(tmp_path)
    assert code == 0
    assert "#SBATCH --exclude=n2" in text.splitlines()
    note = next(line for line in text.splitlines() if line.startswith("# note: node n2 is excluded"))
    assert "GEMM 18.8 GFLOP/s is below 0.5 x the median" in note and "job 41" in note
    code, text = _dry_run(tmp_path, "--json")
    assert json.loads(text)["plan"]["slurm"]["exclude"] == "n2"


def test_another_profiles_record_is_not_applied(tmp_path):
    excluded_nodes.save(tmp_path / "home" / "excluded-nodes" / "h100-ib.json",
                        {"n2": excluded_nodes.Exclusion("n2", "slow", since=0.0)})
    code, text = _dry_run(tmp_path)
    assert code == 0 and "--exclude" not in text


# --------------------------------------------------------------------------- the probe job's command
def test_probe_runs_one_task_per_node_like_the_run_and_quotes_the_environment(tmp_path):
    from launcher.planning.resolve import resolve

    env = {"LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "LMLAUNCH_HOME": str(tmp_path / "home"),
           "HOME": str(tmp_path), "USER": "u"}
    plan = resolve(str(REPO / "jobs" / "tiny-cpu.yaml"), ["env.vars.NCCL_SOCKET_IFNAME=^lo;rm -rf /",
                                                          "resources.account=acct"], None, env,
                   python="/venv/bin/python").plan
    args = doctor_nodes.srun_args(plan, "tiny-node-probe", tmp_path)
    assert args[:9] == ["srun", "--job-name=tiny-node-probe", "--partition=low", "--nodes=2", "--ntasks-per-node=1",
                        "--cpus-per-task=1", "--time=5", "--label", "--kill-on-bad-exit=0"]
    assert "--account=acct" in args and args[-3:-1] == ["bash", "-c"]
    script = args[-1]
    assert "export NCCL_SOCKET_IFNAME='^lo;rm -rf /'" in script.splitlines()
    assert "PYTHONPATH" not in script  # the probe is this lmlaunch's code, not a run's snapshot
    assert script.splitlines()[-1].startswith("exec /venv/bin/python -m lmtrain.health.node_probe --workdir ")


def test_srun_label_output_is_parsed_per_task():
    f = facts("n2", 1)
    text = "\n".join(["0: LMLAUNCH_PROBE_NODE n1 77", "1: LMLAUNCH_PROBE_NODE n2 77",
                      "1: " + doctor_nodes.MARK + json.dumps(f.to_json()),
                      "0: Traceback (most recent call last):", "0: ImportError: libcuda.so.1",
                      "srun: error: n1: task 0: Exited with exit code 1"])
    allocated, got, silent, job_id = doctor_nodes.parse_output(text)
    assert allocated == ["n1", "n2"] and got == [f] and job_id == "77"
    assert silent == {"n1": "ImportError: libcuda.so.1"}


def test_a_compute_figure_is_the_best_of_its_passes_each_started_together():
    """A healthy node starved for one pass by another process is not slow (run N: one 1-s GEMM
    measured 1.6 against its peer's 33.7 GFLOP/s); a failing measurement is an error, no figure."""
    from lmtrain.health import node_probe

    met: list[str] = []
    figures = iter([12.0, 30.5, 3.0])
    errors: dict[str, str] = {}
    best = node_probe._best_of(lambda: met.append("barrier"), "gemm_gflops", errors,
                               lambda s: met.append(f"pass {s}") or next(figures), 1 / 3)
    assert best == 30.5 and errors == {}
    assert met == ["barrier", "pass 0.3333333333333333"] * node_probe.COMPUTE_PASSES

    def broken(_seconds):
        raise RuntimeError("no BLAS")

    assert node_probe._best_of(lambda: None, "mem_gbps", errors, broken, 0.1) is None
    assert errors == {"mem_gbps": "RuntimeError: no BLAS"}
