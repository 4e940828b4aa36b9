"""What the ranks exchange to agree a stop at a step boundary, and what they learn (torch-free).

Four numbers per rank, reduced with MAX over all ranks: whether a stop was requested, whether
SIGTERM came, whether the warning signal came, and minus the first signal's time (so MAX keeps the
earliest). lmtrain.preemption.agreement sends them through a gloo all-reduce; the scale harness
(lmtrain.simulate) through its own collective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NO_TIME = -1e300


@dataclass
class AgreedStop:
    """What every rank learned from the agreement collective (the same on all ranks)."""

    step: int
    term: bool
    warning: bool
    signal_time: float | None
    checkpoint_path: str | None = None
    checkpoint_held_s: float | None = None  # training held by the stop's save (its staging, when staged)
    checkpoint_done_at: float | None = None  # the stop's checkpoint durable (COMPLETE)


def flags_of(controller: Any) -> list[float]:
    """This rank's four numbers (``controller``: the attempt's lmtrain.preemption.controller.Preemption)."""
    stop, rec = controller.stop, controller.signals.record
    first = rec.first_at if rec.first_at is not None else (stop.requested_at if stop.requested else None)
    return [float(stop.requested), float(rec.term_at is not None), float(rec.warning_at is not None),
            -first if first is not None else NO_TIME]


def agreed_from(reduced: list[float], step: int) -> AgreedStop | None:
    """The stop all ranks agree on from the reduced numbers; None: nobody asked to stop."""
    requested, term, warning, neg_first = reduced
    if requested <= 0:
        return None
    return AgreedStop(step=step, term=term > 0, warning=warning > 0,
                      signal_time=-neg_first if neg_first > NO_TIME / 10 else None)
