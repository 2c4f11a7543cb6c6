"""The queue service's protocol: the requests a rollout instance leader sends, the replies
it gets, the refusals, and the checks of a request's fields (their messages name the
field). :class:`~libra_hpc.scheduler.service.QueueService` answers it;
scheduler/mpi_service.py carries it over MPI.

Requests and replies are plain dicts; lease ids are ints.

``{"op": "ask", "instance": int, "max": int}``
    → ``{"ok": True, "turns": [turn, ...], "active": int}``: up to ``min(max, max_batch)``
    turns queued on that instance, then on the other instances of its bucket (so a dead
    instance's queue is drained by its siblings). A turn is ``{"lease", "tid",
    "prompt_id", "turn" (tool returns so far), "bucket", "migrated" (its KV cache must be
    recomputed here), "prev_instance" (where its previous turn ran; None for the first),
    "lease_s" (seconds the lease lasts without a report or heartbeat)}``. ``active`` is
    the number of unfinished trajectories. Asking also renews the instance's leases.
``{"op": "tool_return", "lease": int, "tool": str, "output": str, "exit_code": int|None,
"timed_out": bool, "tokens": int}`` (``exit_code`` defaults to None, a tool without a
process; ``timed_out`` to False), or, classified where the tool ran (the output stays
there; same thresholds and markers, :class:`~libra_hpc.scheduler.state.Classifier`),
``{"op": "tool_return", "lease": int, "tool": str, "size": str, "status": str, "tokens": int}``
    → ``{"ok": True, "tid", "bucket", "instance", "migrated", "reason"}``: the turn that
    ended in a tool call generated ``tokens`` output tokens; the tool's outcome is
    classified into a ToolState (or taken as given) and the next turn is placed and queued.
``{"op": "finish", "lease": int, "tokens": int}``
    → ``{"ok": True, "tid", "turns": int}``: the last turn generated ``tokens`` tokens
    and the trajectory is complete (exactly once; see
    :meth:`~libra_hpc.scheduler.service.QueueService.drain_finished`).
``{"op": "heartbeat", "instance": int}`` → ``{"ok": True, "leases": int}``: every lease
    the instance holds now lasts ``lease_s`` from ``now``; ``leases`` is how many it holds.
``{"op": "stats"}`` → ``{"ok": True, "stats": {...}}`` (see
    :meth:`~libra_hpc.scheduler.service.QueueService.stats`).
``{"op": "batch", "requests": [request, ...]}`` → ``{"ok": True, "replies": [reply, ...]}``:
    up to :data:`MAX_BATCH_REQUESTS` requests (no nested batch) answered in order, each
    exactly as if sent alone: one message for the reports of every turn that ended in an
    engine step, plus the instance's next ask.

Every refusal is ``{"ok": False, "reason": str, "error": str}`` and is counted under
``reason``: ``malformed`` (not a dict, unknown op, missing or ill-typed field),
``unknown_instance``, ``unknown_lease`` (never issued), ``late_report`` (the lease
expired and its turn was re-queued, or it ended too long ago to remember how),
``duplicate_report`` (the lease was already used by a report). A refused report changes
nothing, so nothing is generated twice into the training batch.
"""

from __future__ import annotations

from typing import NoReturn

OPS = ("ask", "tool_return", "finish", "heartbeat", "stats", "batch")
MAX_BATCH_REQUESTS = 1024
MAX_TURN_TOKENS = 1 << 24
"""Most output tokens one turn may report. A larger value is refused as malformed: it would
enter the causal tree's statistics (and its saved file) and overflow float arithmetic at
the next placement."""
REASONS = ("malformed", "unknown_instance", "unknown_lease", "late_report", "duplicate_report")


class Reject(Exception):
    """A request refused: ``reason`` is the counter it goes under (:data:`REASONS`),
    ``error`` the message the asker reads."""

    def __init__(self, reason: str, error: str):
        super().__init__(error)
        self.reason = reason
        self.error = error


def check_tool_return(message: dict) -> NoReturn:
    """Raise the refusal that names the first ill-typed field of a tool_return."""
    op = "tool_return"
    str_field(message, "tool", op)
    int_field(message, "tokens", op, minimum=0, maximum=MAX_TURN_TOKENS)
    int_field(message, "lease", op)
    if "output" not in message and "size" in message:
        str_field(message, "size", op)
        str_field(message, "status", op)
        raise AssertionError(f"tool_return fields judged ill-typed, then passed every check: {message!r}")
    str_field(message, "output", op)
    exit_code = message.get("exit_code")
    if exit_code is not None and (type(exit_code) is not int):
        raise Reject("malformed", f"{op}: field 'exit_code' must be an int or None, got {exit_code!r}")
    timed_out = message.get("timed_out", False)
    if type(timed_out) is not bool:
        raise Reject("malformed", f"{op}: field 'timed_out' must be a bool, got {timed_out!r}")
    raise AssertionError(f"tool_return fields judged ill-typed, then passed every check: {message!r}")


def int_field(message: dict, name: str, op: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """``message[name]``, an int within the bounds; else :class:`Reject` (``malformed``)
    naming the field."""
    value = message.get(name)
    if (type(value) is not int or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        bound = (f" >= {minimum}" if minimum is not None else "") + (f" and <= {maximum}" if maximum is not None else "")
        missing = "missing" if name not in message else f"got {value!r} ({type(value).__name__})"
        raise Reject("malformed", f"{op}: field {name!r} must be an int{bound}, {missing}")
    return value


def str_field(message: dict, name: str, op: str) -> str:
    """``message[name]``, a str, or :class:`Reject` (``malformed``) naming the field."""
    value = message.get(name)
    if type(value) is not str:
        missing = "missing" if name not in message else f"got {type(value).__name__}"
        raise Reject("malformed", f"{op}: field {name!r} must be a str, {missing}")
    return value
