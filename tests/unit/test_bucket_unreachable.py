"""A run's bucket that cannot be reached (checkpoint.dir s3://, a gateway nobody listens for on
127.0.0.1): the upload of the newest checkpoint fails and the attempt's end line says so, and
`history` shows it; a move then copies the checkpoint over SSH and says why; `lmlaunch eval`
refuses to guess which checkpoints there are. Real refused connections, no gateway needed (the
tests against the real one are in tests/integration/test_s3_checkpoints.py and
test_several_clusters.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from waiting import HANG_S

from launcher.commands.eval import _bucket_steps
from launcher.monitor.history_rows import _ledger_notes
from launcher.monitor.status_rows import _bucket_note
from launcher.runs.shared_bucket import holds_newest
from lmcore.errors import UserError


def _credentials(tmp_path: Path) -> Path:
    path = tmp_path / "s3.json"
    path.write_text(json.dumps({"endpoint": "http://127.0.0.1:9", "access_key": "AK", "secret_key": "not-a-secret",
                                "bucket": "lmlaunch"}))
    path.chmod(0o600)
    return path


def _plan(store: str | None, creds: Path | None) -> SimpleNamespace:
    return SimpleNamespace(paths=SimpleNamespace(checkpoint_store=store, checkpoint_dir="/nonexistent",
                                                 checkpoint_store_credentials=str(creds) if creds else None))


def _checkpoint(root: Path, step: int) -> Path:
    d = root / f"step-{step}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": step}))
    (d / "COMPLETE").write_text("")
    return d


def test_an_upload_to_a_gateway_that_is_not_there_is_in_the_end_line_and_history(tmp_path):
    from lmtrain.checkpoint.store_mirror import StoreMirror

    mirror = StoreMirror(_plan("s3://lmlaunch/runs/x", _credentials(tmp_path)), keep_last=2)
    assert mirror.fate() is None  # nothing queued: nothing to say
    mirror.submit(_checkpoint(tmp_path, 8))
    assert mirror.close(wait_s=HANG_S)
    fate = mirror.fate()
    assert fate is not None and (fate["step"], fate["store"], fate["uploaded"]) == (8, "s3://lmlaunch/runs/x", False)
    assert "127.0.0.1:9" in fate["error"] and "not-a-secret" not in json.dumps(fate), fate
    notes = _ledger_notes([{"event": "end", "attempt": 1, "reason": "preempted", "bucket": fate},
                           {"event": "end", "attempt": 2, "reason": "completed",
                            "bucket": {"step": 16, "store": "s3://lmlaunch/runs/x", "uploaded": True}}])
    assert len(notes) == 1 and notes[0].startswith("attempt 1: its last checkpoint step-8 is not in s3://lmlaunch/runs/x ("), notes
    assert notes[0].endswith("): on that cluster's disk only; the next attempt there uploads it"), notes
    said = _bucket_note({"event": "end", "reason": "preempted", "bucket": fate})  # status, until an attempt uploads it
    assert said.startswith("checkpoint step-8 is not in s3://lmlaunch/runs/x (") and said.endswith("the next attempt uploads it")
    assert _bucket_note({"event": "end", "bucket": {"step": 16, "uploaded": True}}) == _bucket_note(None) == ""


def test_a_move_copies_the_checkpoint_unless_the_bucket_is_known_to_hold_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert holds_newest(run_dir, _plan(None, None), "step-8").name is None  # no bucket: copied, nothing said
    missing = holds_newest(run_dir, _plan("s3://lmlaunch/r", tmp_path / "none.json"), "step-8")
    assert missing.name is None and missing.said == ("the credentials of s3://lmlaunch/r cannot be read here: its "
                                                     "checkpoint is copied")
    refused = holds_newest(run_dir, _plan("s3://lmlaunch/r", _credentials(tmp_path)), "step-8")
    assert refused.name is None and refused.said.startswith("cannot list s3://lmlaunch/r (") \
        and refused.said.endswith("): its checkpoint is copied"), refused


def test_eval_of_a_run_whose_bucket_cannot_be_listed_is_refused_and_names_it(tmp_path):
    plan = _plan("s3://lmlaunch/r", _credentials(tmp_path))
    with pytest.raises(UserError, match=r"cannot list the run's checkpoints in s3://lmlaunch/r: .*127\.0\.0\.1:9"):
        _bucket_steps(plan)  # type: ignore[arg-type]
    loose = _credentials(tmp_path)
    os.chmod(loose, 0o644)
    with pytest.raises(UserError, match="mode 644; it must be readable by its owner only"):
        _bucket_steps(plan)  # type: ignore[arg-type]
    assert _bucket_steps(_plan(None, None)) == []  # type: ignore[arg-type]


def test_the_upload_process_outlasts_slurms_signals_and_never_its_rank(tmp_path):
    """The process that uploads a rank's checkpoints (lmcore.objects.upload_process) ignores the
    signals SLURM sends every process of a job (the rank decides what a stop means and waits for the
    upload it needs), answers each request, and exits when its rank dies: never left behind."""
    import signal
    import subprocess
    import sys

    from waiting import process_cpu, until

    from lmcore.objects.upload_process import UploadProcess

    creds = _credentials(tmp_path)
    uploader = UploadProcess("s3://lmlaunch/runs/x", creds)
    uploader.start()
    assert uploader.proc is not None
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        os.kill(uploader.proc.pid, sig)
    got = uploader.upload(_checkpoint(tmp_path, 4), "step-4", {}, keep_last=2)
    assert got["ok"] is False and "127.0.0.1:9" in got["error"] and "not-a-secret" not in json.dumps(got), got
    assert uploader.proc.poll() is None
    uploader.close()

    rank = subprocess.run(  # a rank that starts its uploader and dies without a word
        [sys.executable, "-c", "import os, sys; from lmcore.objects.upload_process import UploadProcess; "
         f"u = UploadProcess('s3://lmlaunch/runs/x', {str(creds)!r}); u.start(); print(u.proc.pid, flush=True); "
         "os.kill(os.getpid(), 9)"], capture_output=True, text=True, timeout=HANG_S)
    child = int(rank.stdout.split()[0])

    def gone() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] == "Z"
        except OSError:
            return True

    until(gone, progress=process_cpu(child), what=f"the dead rank's upload process {child} to exit")
