"""Shell completion generated from the argument parsers (argcomplete), tried in the real shells:
bash and fish complete for real (the script sourced, the shell asked as on a Tab), zsh's script
loads under compinit and the answers in its format are checked; run names come from the registry,
specs are YAML files, --cluster completes the profiles. The old hand-written lists are gone, so
nothing can go stale."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import HANG_S

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the environment's lmlaunch entry point


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    from launcher.runs.registry import registry_dir

    home = tmp_path / "home"
    environ = {**os.environ, "LMLAUNCH_HOME": str(home), "PATH": f"{BIN}:{os.environ['PATH']}"}
    d = registry_dir(environ)
    d.mkdir(parents=True)
    for name in ("alpha-1", "alpha-2", "beta"):
        (d / f"{name}.json").write_text("{}")
    return environ


def _bash(env: dict[str, str], line: str, cwd: Path) -> list[str]:
    script = f'''eval "$(lmlaunch completion bash)"
COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}; COMP_TYPE=9
read -ra COMP_WORDS <<< "$COMP_LINE"; [[ "$COMP_LINE" == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))
_python_argcomplete lmlaunch "${{COMP_WORDS[-1]}}" "${{COMP_WORDS[-2]}}"
printf '%s\\n' "${{COMPREPLY[@]}}"'''
    out = subprocess.run(["bash", "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    return [w.strip() for w in out.stdout.splitlines() if w.strip()]


def test_bash_completes_commands_options_run_names_specs_and_profiles(env, tmp_path):
    (tmp_path / "job.yaml").write_text("name: x\n")
    (tmp_path / "notes.txt").write_text("")
    assert _bash(env, "lmlaunch sta", tmp_path) == ["status", "stacks"]
    assert _bash(env, "lmlaunch status --w", tmp_path) == ["--watch"]
    assert _bash(env, "lmlaunch logs alp", tmp_path) == ["alpha-1", "alpha-2"]
    assert _bash(env, "lmlaunch submit j", tmp_path) == ["job.yaml"]  # YAML only: notes.txt is not offered
    assert _bash(env, "lmlaunch validate job.yaml --cluster lo", tmp_path) == ["local"]
    assert _bash(env, "lmlaunch completion ", tmp_path)[-3:] == ["bash", "zsh", "fish"]  # after -h, --help
    assert _bash(env, "lmlaunch examples x --fo", tmp_path) == ["--force"]  # a command added since: no list to update


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed (scripts/setup.sh installs it)")
def test_fish_completes_from_the_same_parsers(env, tmp_path):
    out = subprocess.run(["fish", "-c", "lmlaunch completion fish | source; complete -C 'lmlaunch sta'; "
                          "complete -C 'lmlaunch history al'; complete -C 'lmlaunch logs x --ra'"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    words = [line.split("\t")[0] for line in out.stdout.splitlines()]
    assert out.returncode == 0 and words == ["stacks", "status", "alpha-1", "alpha-2", "--rank"], out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed (scripts/setup.sh installs it)")
def test_zshs_script_loads_under_compinit_and_is_answered_in_its_format(env, tmp_path):
    out = subprocess.run(["zsh", "-c", 'autoload -U compinit; compinit -u -d "$PWD/.zcompdump"; '
                          'eval "$(lmlaunch completion zsh)" && print -r -- ${_comps[lmlaunch]}'],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.strip() == "_python_argcomplete", out.stdout + out.stderr
    read, write = os.pipe()
    line = "lmlaunch logs alp"
    ask = {**env, "_ARGCOMPLETE": "1", "_ARGCOMPLETE_SHELL": "zsh", "COMP_LINE": line, "COMP_POINT": str(len(line)),
           "_ARGCOMPLETE_SUPPRESS_SPACE": "1"}
    proc = subprocess.run(["bash", "-c", f"lmlaunch 8>&{write}"], env=ask, cwd=tmp_path, pass_fds=(write,),
                          capture_output=True, timeout=HANG_S)
    os.close(write)
    answer = os.read(read, 65536).decode()
    os.close(read)
    words = [w.split(":")[0] for w in answer.split("\013") if w]  # the script's IFS; "value:description" each
    assert proc.returncode == 0 and words == ["alpha-1", "alpha-2"], answer
