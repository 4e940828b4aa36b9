"""Reading lmtrain's checkpoint directories without torch: which step directories are complete,
the newest one, its meta.json. The runtime (lmtrain.checkpoint.manager) writes them and re-exports these
readers; the launcher uses them to plan a resume (world size, strategy) before queue time is
spent. The layout and the write protocol are described in lmtrain.checkpoint.manager.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.atomic import write_private
from lmcore.digests import ALGORITHM, file_digest
from lmcore.job.parallelism import Parallelism

log = logging.getLogger("lmtrain.checkpoint.manager")

STEP_RE = re.compile(r"step-(\d+)")  # matched with fullmatch


def step_dir_name(step: int) -> str:
    """The name of the checkpoint directory of ``step`` (``step-S``): STEP_RE reads it back."""
    return f"step-{step}"


def temporary_dir_name(step: int) -> str:
    """The directory checkpoint ``step`` is written into before its rename to ``step-S``."""
    return f".step-{step}.tmp"


def is_temporary_dir_name(name: str) -> bool:
    return name.startswith(".step-") and name.endswith(".tmp")


def step_of(path: Path) -> int:
    """The step a ``step-S`` directory holds."""
    m = STEP_RE.fullmatch(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint directory (step-<N>)")
    return int(m.group(1))

LIGHTNING_NAME = "lightning.ckpt"
COMPLETE_NAME = "COMPLETE"
CORRUPT_NAME = "CORRUPT"  # written into a step directory whose files failed their checksums
LATEST_NAME = "latest"
# The checksum of every file in COMPLETE's manifest: xxHash's XXH3-128, computed while the file is
# written (lmtrain.checkpoint.checksums) at memory speed (a cryptographic hash would hold a stop-time save).
CHECKSUM_ALGORITHM = ALGORITHM  # lmcore.digests: the manifest names it
# How much of a checkpoint `--resume` reads on the login node to check its checksums before
# submitting (about 4 s at 2 GB/s); a larger one is checked by the job's ranks as they load it,
# each its share in parallel, falling back the same way.
LOGIN_VERIFY_BYTES = 8 << 30
def checkpoint_bytes(params: int, parallelism: Parallelism, precision: str) -> int:
    """The size of one checkpoint (all ranks together), estimated from the parameter count: what
    ``lmlaunch doctor`` plans room for and what a save checks is free before its first one."""
    return params * parallelism.checkpoint_bytes_per_param(precision)


# A rank's own file: rank-R.pt, shard-rank-R.bin, DeepSpeed's zero_pp_rank_R_..., DCP's __R_0.distcp;
# not DeepSpeed's mp_rank_00_model_states.pt, which every rank of a model-parallel rank reads
_RANK_FILE = re.compile(r"(?:^|[^a-z])(?<!mp_)rank[-_](\d+)|^__(\d+)_\d+\.distcp$")


def rank_of_file(rel: str) -> int | None:
    """The rank a checkpoint file belongs to, by its name (None: a file every rank may read)."""
    m = _RANK_FILE.search(rel.rsplit("/", 1)[-1])
    return None if m is None else int(m.group(1) if m.group(1) is not None else m.group(2))


def incomplete_reason(path: Path, *, rank: int | None = None, files: bool = True) -> str | None:
    """Why the step directory ``path`` is not a complete checkpoint (None: it is). Complete means
    COMPLETE is there, no CORRUPT marker (a load found a file unlike its checksum) and, when
    COMPLETE has a manifest, every file it names is there at its size. (A COMPLETE without a
    manifest, as older lmtrain wrote, is trusted as it is.) Sizes only: checksums are verified
    where the files are read (:func:`verify`). With ``rank``: as that rank sees it, the other ranks'
    own files left out (each rank looks at the files it reads: at R ranks, R stats each, not R x R;
    rank 0 chose the checkpoint having looked at every one, docs/scale.md). ``files=False``: the
    markers only, no file of the manifest stat'ed (what `status` shows, at any number of ranks)."""
    marker = path / COMPLETE_NAME
    try:
        text = marker.read_text()
    except OSError:
        return f"no {COMPLETE_NAME} marker (its save did not finish)"
    try:
        corrupt = json.loads((path / CORRUPT_NAME).read_text())
    except FileNotFoundError:
        corrupt = None
    except (OSError, ValueError):
        corrupt = {"reason": f"{CORRUPT_NAME} marker is unreadable"}
    if corrupt is not None:
        return f"its files failed their checksums: {corrupt.get('reason', '?')}"
    if not files:
        return None
    try:
        files = json.loads(text).get("files")
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(files, dict):
        return None
    for rel, size in files.items():
        if rank is not None and (owner := rank_of_file(rel)) is not None and owner != rank:
            continue
        try:
            actual = (path / rel).stat().st_size
        except OSError:
            return f"{rel} is missing (its manifest in {COMPLETE_NAME} names it)"
        if actual != size:
            return f"{rel} is {actual:,} bytes, its manifest in {COMPLETE_NAME} says {size:,}"
    return None


def _complete(path: Path) -> dict[str, Any]:
    """COMPLETE's JSON ({} when it is missing, unreadable or not an object)."""
    try:
        data = json.loads((path / COMPLETE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def manifest_checksums(path: Path) -> dict[str, str] | None:
    """COMPLETE's checksums of the step directory ``path`` (relative path -> digest); None when it
    has none (older lmtrain) or they are of another algorithm."""
    sums = _complete(path).get("checksums")
    if not isinstance(sums, dict) or sums.get("algorithm") != CHECKSUM_ALGORITHM:
        return None
    files = sums.get("files")
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else None


def verify(path: Path, rels: list[str] | None = None) -> list[str]:
    """Check the files ``rels`` of the step directory ``path`` (default: all of them) against
    COMPLETE's checksums: what is wrong, one line per file (empty: nothing). A checkpoint without
    checksums has nothing to check here."""
    sums = manifest_checksums(path)
    if sums is None:
        return []
    problems = []
    for rel in sums if rels is None else rels:
        expected = sums.get(rel)
        if expected is None:
            continue
        try:
            actual = file_digest(path / rel)
        except OSError as exc:
            problems.append(f"{rel}: unreadable ({exc.strerror or exc})")
            continue
        if actual != expected:
            problems.append(f"{rel}: {CHECKSUM_ALGORITHM} {actual} differs from the {expected} written")
    return problems


def newest_intact(found: list[CompleteCheckpoint],
                  passed_over: Callable[[CompleteCheckpoint, list[str]], None]) -> CompleteCheckpoint | None:
    """The newest of ``found`` whose files all match their checksums; each newer one, with what is
    wrong, goes to ``passed_over`` (export and eval read a whole checkpoint: they check all of it)."""
    for ckpt in reversed(found):
        problems = verify(ckpt.path)
        if not problems:
            return ckpt
        passed_over(ckpt, problems)
    return None


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a resume starts from (None: no usable one), the one line why, and whether
    the checkpoint directory has any step directory at all (usable or not)."""

    chosen: CompleteCheckpoint | None
    why: str
    step_dirs: bool


def choose_for_resume(ckpt_dir: str | Path, *, verify_up_to: int = LOGIN_VERIFY_BYTES) -> ResumeChoice:
    """The newest complete checkpoint whose files match their checksums, checked here newest first
    while ``verify_up_to`` bytes allow; each newer one that does not is said with what is wrong.
    Past that budget the choice is the newest complete one not yet read, and the line says that its
    ranks check it as they load it. No usable checkpoint: ``chosen`` is None and ``why`` says why."""
    scanned = scan(ckpt_dir)
    found, skipped = scanned
    if not found:
        return ResumeChoice(None, describe_choice(ckpt_dir, scanned=scanned), bool(skipped))
    budget, failed = verify_up_to, []
    for ckpt in reversed(found):
        size = ckpt.size_bytes()
        if manifest_checksums(ckpt.path) is None:
            how = "written without checksums (an older lmtrain): its sizes were checked"
        elif size > budget:
            how = (f"its {size / 1e9:.1f} GB are checked against their checksums by the ranks as they load it; "
                   "a file that differs makes it fall back to the previous one")
        else:
            budget -= size
            problems = verify(ckpt.path)
            if problems:
                failed.append(f"passed over {ckpt.path.name}: its files do not hold what was written "
                              f"({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''})")
                continue
            how = "its files match their checksums"
        why = "the newest whose files match" if failed else None
        return ResumeChoice(ckpt, describe_choice(ckpt_dir, ckpt, scanned=scanned, why=why, more=(*failed, how)), True)
    return ResumeChoice(None, "no checkpoint whose files match their checksums (" + "; ".join(failed) + ")", True)


def shares(path: Path, world_size: int) -> list[list[str]]:
    """COMPLETE's checksummed files of ``path`` split among ``world_size`` readers by bytes
    (largest first, each to the reader with the fewest bytes so far): rank r verifies
    ``shares(...)[r]``, all ranks in parallel. Deterministic: every rank computes the same split."""
    sums = manifest_checksums(path) or {}
    sizes = _complete(path).get("files") or {}
    out: list[list[str]] = [[] for _ in range(max(1, world_size))]
    load = [0] * len(out)
    for rel in sorted(sums, key=lambda r: (-int(sizes.get(r, 0)), r)):
        i = load.index(min(load))
        out[i].append(rel)
        load[i] += int(sizes.get(rel, 0))
    return out


def mark_corrupt(path: Path, problems: list[str]) -> None:
    """Make the step directory ``path`` incomplete for every reader from now on: a CORRUPT marker
    (written atomically) naming what failed. Its files are left as they are; like any incomplete
    step directory it is pruned once a newer checkpoint is complete (the ledger keeps what failed)."""
    text = json.dumps({"reason": "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""),
                       "problems": problems}, indent=1) + "\n"
    write_private(path / CORRUPT_NAME, text)


def is_complete(path: Path, *, rank: int | None = None) -> bool:
    """:func:`incomplete_reason` finds nothing wrong with ``path`` (as ``rank`` sees it)."""
    return incomplete_reason(path, rank=rank) is None


@dataclass(frozen=True)
class CompleteCheckpoint:
    step: int
    path: Path

    @property
    def lightning_path(self) -> Path:
        return self.path / LIGHTNING_NAME

    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads((self.path / "meta.json").read_text())
        return meta

    def size_bytes(self) -> int:
        """The checkpoint's bytes, from its COMPLETE manifest (one small read); by walking the
        directory when the manifest is missing (older lmtrain)."""
        try:
            files = json.loads((self.path / COMPLETE_NAME).read_text()).get("files")
        except (OSError, json.JSONDecodeError, AttributeError):
            files = None
        if isinstance(files, dict):
            return sum(int(size) for size in files.values())
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def rank_state(self, rank: int) -> dict[str, Any] | None:
        p = self.path / f"rank-{rank}.pt"
        if not p.exists():
            return None
        import torch  # the runtime's call only: the launcher never reads rank states

        state: dict[str, Any] = torch.load(p, map_location="cpu", weights_only=True)
        return state


@dataclass(frozen=True)
class Skipped:
    """A step directory that is not a complete checkpoint, and why."""

    step: int
    path: Path
    reason: str


def scan(ckpt_dir: str | Path) -> tuple[list[CompleteCheckpoint], list[Skipped]]:
    """Every step directory of ``ckpt_dir``: the complete checkpoints and the skipped ones (with
    why), each oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return [], []
    found, skipped = [], []
    for child in root.iterdir():
        m = STEP_RE.fullmatch(child.name)
        if not (m and child.is_dir()):
            continue
        reason = incomplete_reason(child)
        if reason is None:
            found.append(CompleteCheckpoint(step=int(m.group(1)), path=child))
        else:
            skipped.append(Skipped(step=int(m.group(1)), path=child, reason=reason))
    return sorted(found, key=lambda c: c.step), sorted(skipped, key=lambda s: s.step)


_warned: set[tuple[Path, str]] = set()


def complete_checkpoints(ckpt_dir: str | Path) -> list[CompleteCheckpoint]:
    """Every complete checkpoint, oldest first. Directories without COMPLETE are ignored; one whose
    files do not match its manifest is ignored with a warning (once per process)."""
    found, skipped = scan(ckpt_dir)
    for s in skipped:
        if (s.path / COMPLETE_NAME).is_file() and (s.path, s.reason) not in _warned:
            _warned.add((s.path, s.reason))
            log.warning("%s has COMPLETE but its files do not match its manifest (%s): ignored", s.path, s.reason)
    return found


def newest_complete(ckpt_dir: str | Path, *, files: bool = True) -> CompleteCheckpoint | None:
    """The newest complete checkpoint, looking from the newest step down and stopping at the first
    complete one (older ones are not looked at). ``files=False``: by its markers only
    (:func:`incomplete_reason`)."""
    root = Path(ckpt_dir)
    try:
        steps = sorted(((int(m.group(1)), child) for child in root.iterdir() if (m := STEP_RE.fullmatch(child.name))),
                       key=lambda pair: -pair[0])
    except OSError:
        return None
    for step, child in steps:
        if child.is_dir() and incomplete_reason(child, files=files) is None:
            return CompleteCheckpoint(step=step, path=child)
    return None


def describe_choice(ckpt_dir: str | Path, chosen: CompleteCheckpoint | None = None, *,
                    scanned: tuple[list[CompleteCheckpoint], list[Skipped]] | None = None,
                    why: str | None = None, more: tuple[str, ...] = ()) -> str:
    """Which checkpoint a resume or an export uses and why, in one line: ``chosen`` (default: the
    newest complete one) and every newer step directory that was passed over, with its reason.
    ``scanned``: :func:`scan`'s result when the caller has it already; ``why`` replaces the
    reason the choice gives itself, ``more`` follows the passed-over ones."""
    found, skipped = scanned if scanned is not None else scan(ckpt_dir)
    if chosen is None:
        if not found:
            return "no complete checkpoint" + (f" ({_passed_over(skipped)})" if skipped else "")
        chosen = found[-1]
    why = why or ("the newest complete checkpoint" if found and chosen.step == found[-1].step else "as asked")
    passed = _passed_over([s for s in skipped if s.step > chosen.step])
    return f"step-{chosen.step} (" + "; ".join([why, *([passed] if passed else []), *more]) + ")"


def _passed_over(skipped: list[Skipped]) -> str:
    if not skipped:
        return ""
    shown = "; ".join(f"skipped {s.path.name}: {s.reason}" for s in reversed(skipped[-3:]))
    return shown + (f"; and {len(skipped) - 3} older incomplete" if len(skipped) > 3 else "")
