import subprocess
import sys


def test_import_launcher_cli_leaves_torch_and_lightning_out():
    code = (
        "import sys, launcher.cli, launcher.core.plan, launcher.submit, launcher.resolve\n"
        "heavy = [m for m in ('torch', 'lightning', 'transformers', 'deepspeed') if m in sys.modules]\n"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
