import subprocess
import sys


def _leaves_out(modules: str, heavy: tuple[str, ...]) -> None:
    """Importing ``modules`` in a fresh interpreter loads none of ``heavy``."""
    code = (f"import sys, {modules}\n"
            f"heavy = [m for m in {heavy!r} if m in sys.modules]\n"
            "print(heavy); sys.exit(1 if heavy else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_import_launcher_cli_leaves_torch_and_lightning_out():
    _leaves_out("launcher.cli, lmcore.job.plan, launcher.submit.submission, launcher.planning.resolve",
                ("torch", "lightning", "transformers", "deepspeed"))


def test_the_read_only_commands_leave_pydantic_out():
    """status, logs and history answer at 10,000 runs within their bench (bench/status_latency.py):
    pydantic's import alone is 0.2-0.3 s of it (a module-level import of the plan in history_rows
    made plain status 0.40 s against its 0.25 s goal)."""
    _leaves_out("launcher.cli, launcher.commands.status, launcher.commands.logs, launcher.commands.history",
                ("pydantic", "torch"))


def test_forwarding_a_read_only_command_leaves_pydantic_out():
    """`--remote P status` from a workstation: the lean path (launcher.remote.read) and the warm
    client's side stay off the profile models (launcher.spec.profiles: 0.3-0.4 s of imports)."""
    _leaves_out("launcher.cli, launcher.remote.read, launcher.remote.warm", ("pydantic", "torch", "launcher.spec.profiles"))
