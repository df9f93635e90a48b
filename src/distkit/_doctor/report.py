"""The hang doctor's roll-call report: one text from every rank's answer, and the file it goes to.

An answer is a plain dict (it travels as JSON through the job's store): ``rank``, ``host``, ``pid``,
the :class:`~distkit._doctor.where.Location` fields (``kind``, ``op``, ``file``, ``line``, ``context``,
``step``, ``stack``), ``seqs`` (operations issued per process group) and ``note``. Besides the
location kinds, ``kind`` may be ``"failed"`` (this rank's collective raised, ``note`` says what),
``"raised"`` (the rank is ending with an exception of its own, ``note`` says which, ``file`` and
``line`` where), ``"left"`` (the rank ran ``distkit.shutdown()``), ``"gone"`` (its process has exited)
or ``"silent"`` (alive, or on another host, but it did not answer).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from typing import Any

from distkit._doctor.where import RANK_TEST
from distkit._utils.secrets import redact_text

__all__: list[str] = []

_WAITING = ("wait", "exempt", "failed")
_ABSENT = ("left", "gone", "silent")


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks [1, 2]``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def location_text(answer: Mapping[str, Any]) -> str:
    """``train.py:88 (in `if rank == 0:`, step 124)``, or ``""`` when the answer has no line."""
    if not answer.get("file"):
        return ""
    extras = [part for part in (answer.get("context"), answer.get("step")) if part]
    suffix = f" ({'; '.join(extras)})" if extras else ""
    return f"{answer['file']}:{answer['line']}{suffix}"


def state_text(answer: Mapping[str, Any]) -> str:
    """What a rank is doing, in a few words."""
    kind, op, note = answer.get("kind"), answer.get("op", ""), answer.get("note") or ""
    if kind in ("wait", "exempt"):
        return f"waiting in {op}"
    if kind == "failed":
        return f"failed in {op}: {note}"
    if kind == "raised":
        return f"raised {note if len(note) <= 80 else note[:77] + '...'}"
    if kind == "busy":
        return f"busy in {op} (not in a collective)"
    if kind == "left":
        return "left the job: distkit.shutdown() ran there (its script ended or called sys.exit)"
    if kind == "gone":
        return f"gone: {note}"
    return f"no answer: {note}"


def doing_text(answer: Mapping[str, Any]) -> str:
    """What a rank is doing, after its name: ``rank 1 is waiting in ...``, ``rank 1 has left ...``."""
    kind = answer.get("kind")
    if kind == "left":
        return "has left the job: distkit.shutdown() ran there (its script ended or called sys.exit)"
    if kind == "silent":
        return f"did not answer: {answer.get('note') or ''}"
    if kind in ("failed", "raised"):
        return state_text(answer)
    return f"is {state_text(answer)}"


def cause(answers: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The report's first line when a rank ended the job by failing: it raised, or its process
    died. ``None`` when no rank did (the job is stuck, or a rank left without an error)."""
    raised = [rank for rank in sorted(answers) if answers[rank].get("kind") == "raised"]
    gone = [rank for rank in sorted(answers) if answers[rank].get("kind") == "gone"]
    if raised:
        first = min(raised, key=lambda rank: float(answers[rank].get("time") or 0.0))
        answer = answers[first]
        place = location_text(answer)
        return (
            f"distkit: rank {first} failed: it raised {answer.get('note')}"
            f"{' at ' + place if place else ''}. That is the cause; the other ranks only waited for "
            f"it. Where each rank is:"
        )
    if gone:
        return (
            f"distkit: {ranks_text(gone)} died: {answers[gone[0]].get('note')}. That is the cause; the "
            f"other ranks only waited for it. Where each rank is:"
        )
    return None


def _group_key(answer: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        answer.get("kind"),
        answer.get("op"),
        answer.get("file"),
        answer.get("line"),
        answer.get("context"),
    )


def build(
    header: str,
    answers: Mapping[int, Mapping[str, Any]],
    *,
    group_labels: Mapping[str, str],
    hints: Sequence[str] = (),
) -> tuple[str, str]:
    """The report (a few lines) and the details for the file (every rank's stack).

    Ranks at the same place share a line; then the diagnosis: which ranks are not where the largest
    group of waiting ranks waits (the issue's "rank 1 is not where rank 0 waits"), collectives
    issued per group when they differ between ranks, and ``hints``.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank in sorted(answers):
        groups.setdefault(_group_key(answers[rank]), []).append(rank)
    rows = []
    for ranks in groups.values():
        first = answers[ranks[0]]
        steps: list[str] = sorted({answers[r]["step"] for r in ranks if answers[r].get("step")})
        shown = dict(first)
        shown["step"] = steps[0] if len(steps) == 1 else (", ".join(steps) if steps else None)
        rows.append((f"ranks {ranks}", state_text(first), location_text(shown)))
    width_ranks = max(len(r[0]) for r in rows)
    width_state = max(len(r[1]) for r in rows)
    lines = [header]
    for ranks_col, state, where in rows:
        lines.append(f"  {ranks_col:<{width_ranks}}   {state:<{width_state}}   {where}".rstrip())
    lines.extend(f"  {line}" for line in _diagnosis(answers, groups, group_labels))
    lines.extend(f"  {hint}" for hint in hints)
    details = ["", "Where each rank's watched thread is (outermost frame first):"]
    for rank in sorted(answers):
        answer = answers[rank]
        who = f"pid {answer.get('pid', '?')} on {answer.get('host', '?')}"
        details.append(f"--- rank {rank} ({who}): {state_text(answer)} ---")
        details.extend(f"  {frame}" for frame in answer.get("stack") or ["(no stack)"])
    return "\n".join(lines), "\n".join(details)


def _diagnosis(
    answers: Mapping[int, Mapping[str, Any]],
    groups: Mapping[tuple[Any, ...], list[int]],
    group_labels: Mapping[str, str],
) -> list[str]:
    lines = []
    waiting = [ranks for key, ranks in groups.items() if key[0] in _WAITING]
    # Where ranks wait, whatever their state there: a rank whose collective already failed and one
    # still waiting in it (asked a moment earlier) are at the same place.
    places: dict[tuple[Any, ...], list[int]] = {}
    for ranks in waiting:
        places.setdefault(_group_key(answers[ranks[0]])[1:], []).extend(ranks)
    if places:
        # The largest group of waiting ranks is where the job is; on a tie, the one with rank 0.
        largest = max(places.values(), key=lambda ranks: (len(ranks), -min(ranks)))
        reference = sorted(largest)
        others = [rank for rank in sorted(answers) if rank not in reference]
        if others:
            verb_others = "is" if len(others) == 1 else "are"
            verb_reference = "waits" if len(reference) == 1 else "wait"
            elsewhere = []
            for ranks in groups.values():
                if ranks[0] in others:
                    place = location_text({**answers[ranks[0]], "step": None, "context": None})
                    if place and place not in elsewhere:
                        elsewhere.append(place)
            here = location_text({**answers[reference[0]], "step": None, "context": None})
            # Ranks that ended have no place (the line below names them); ranks at the same line
            # in another call of it (another src) are told apart by the header.
            if elsewhere and here and elsewhere != [here]:
                lines.append(
                    f"{ranks_text(others)} {verb_others} not where {ranks_text(reference)} "
                    f"{verb_reference}: look at {', '.join(elsewhere)} ... {here}."
                )
        hinted = False
        tests = {_if_test(answers[ranks[0]].get("context")) for ranks in waiting} - {None}
        branches = [
            test
            for test in tests
            if {f"in `{test}`", f"in the `else:` of `{test}`"}
            <= {answers[ranks[0]].get("context") for ranks in waiting}
        ]
        if branches:
            lines.append(
                f"The branches of `{branches[0]}` call collectives in a different order: every rank must "
                f"call the same collectives, in the same order."
            )
            hinted = True
        for ranks in waiting if not hinted else []:
            context = answers[ranks[0]].get("context") or ""
            if RANK_TEST.search(context) and len(ranks) < len(answers):
                test = context.split("`")[1] if "`" in context else context
                lines.append(
                    f"A collective {context} runs on some ranks only: every rank must call it, in the "
                    f"same order (call it on every rank, or move it out of `{test}`)."
                )
                hinted = True
                break
        ddp = [
            r for ranks in waiting for r in ranks if str(answers[r].get("op", "")).startswith("Distributed")
        ]
        rest = [r for ranks in waiting for r in ranks if r not in ddp]
        if ddp and rest and not hinted:
            verb = "runs" if len(ddp) == 1 else "run"
            lines.append(
                f"{ranks_text(ddp)} {verb} a DDP step that {ranks_text(rest)} did not: with unevenly "
                f"sharded data a rank gets more batches than the others (give every rank as many: "
                f"distkit.distributed_dataloader, or a DistributedSampler with drop_last=True)."
            )
    seq_names = sorted({name for answer in answers.values() for name in (answer.get("seqs") or {})})
    for name in seq_names:
        counts = {
            rank: answers[rank]["seqs"][name]
            for rank in sorted(answers)
            if name in (answers[rank].get("seqs") or {})
        }
        if len(set(counts.values())) > 1:
            shown = ", ".join(f"rank {rank}: {count}" for rank, count in counts.items())
            label = group_labels.get(name, f"group {name!r}")
            lines.append(f"Collectives issued so far on {label}: {shown}.")
    raised = [rank for rank in sorted(answers) if answers[rank].get("kind") == "raised"]
    if raised:
        lines.append(
            f"{ranks_text(raised)}'s traceback is in its own output (above, or in its launcher's log)."
        )
    absent = [rank for rank in sorted(answers) if answers[rank].get("kind") in ("gone", "left")]
    if absent:
        lines.append(
            f"{ranks_text(absent)} ended while the others wait: its launcher's log (torchrun, srun, "
            f"the distkit.testing failure) has its exit code and last output."
        )
    return lines


def _if_test(context: str | None) -> str | None:
    """``if rank == 0:`` from ``in `if rank == 0:` `` or ``in the `else:` of `if rank == 0:` ``."""
    if not context or "`" not in context:
        return None
    return context.rstrip("`").rsplit("`", 1)[-1]


def default_name() -> str:
    """``distkit-hang-report-20261122-160325.txt`` (UTC), so that a restarted job keeps the first."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"distkit-hang-report-{stamp}.txt"


def write(directory: str, text: str) -> tuple[str | None, str | None]:
    """Write ``text`` to a new file in ``directory``; returns ``(path, None)`` or ``(None, why)``."""
    try:
        os.makedirs(directory, exist_ok=True)
        base = os.path.join(directory, default_name())
        path, n = base, 1
        while os.path.exists(path):
            path = f"{base[:-4]}-{n}.txt"
            n += 1
        # The owner's only, as the run's other files: stacks and errors can name private paths.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        with open(fd, "w", encoding="utf-8") as handle:
            handle.write(redact_text(text) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return os.path.abspath(path), None
    except OSError as err:
        return None, f"{type(err).__name__}: {err}"
