"""Where a thread is, in the words of the hang doctor's report (private; see ``docs/debugging.md``).

A stack (a live thread's frames, or an exception's traceback) is read from its innermost frame
outwards. The first frame that is not the standard library decides what the thread is doing:

- a distkit wait (``collectives._wait``, the barrier's ``_wait_released``), a frame of
  ``torch.distributed``'s collectives, or of ``DistributedDataParallel``: it **waits** for the other
  ranks, and stays there forever if they never come;
- autograd's ``backward``: it waits in DDP's gradient all-reduce when the process has a DDP module,
  and computes otherwise;
- a distkit wait that has its own liveness check and deadline (the ranks that wait for the main
  process in ``main_process_first``, or for rank 0 to commit a checkpoint): **exempt**;
- anything else (user code, data loading, a sleep, torch compute): **busy**.

The line shown is the innermost frame of the user's code, or of distkit's Trainer when that is more
inner (``trainer.fit`` is the user's line for every step). Everything here only reads frames: the
thread being described is blocked in C (a collective releases the GIL) or runs on between two
bytecodes, and is never changed.
"""

from __future__ import annotations

import ast
import functools
import gc
import linecache
import os
import re
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from types import CodeType, FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []

WAIT = "wait"
EXEMPT = "exempt"
BUSY = "busy"

_DOCTOR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_DISTKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TRAINER_DIR = os.path.join(_DISTKIT_DIR, "trainer") + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIRS = tuple(
    sorted({os.path.abspath(sysconfig.get_paths()[name]) + os.sep for name in ("stdlib", "platstdlib")})
)

# torch files whose frames mean "inside a collective" (relative to the torch package).
_TORCH_COLLECTIVE_FILES = frozenset(
    {
        "distributed/distributed_c10d.py",
        "distributed/c10d_logger.py",
        "distributed/_functional_collectives.py",
        "distributed/utils.py",  # DDP's parameter broadcast and shape check at construction
        "nn/parallel/distributed.py",  # DDP's forward: bucket rebuild, buffer broadcast
    }
)
_DDP_FILE = "nn/parallel/distributed.py"
_BACKWARD = frozenset(
    {
        ("autograd/__init__.py", "backward"),
        ("autograd/graph.py", "_engine_run_backward"),
        ("_tensor.py", "backward"),
    }
)
# The tables below name distkit's functions by module and qualified name (``_Section.follow``), not
# by file name: a file that moves into a package keeps its module path through the
# facade's re-export, and tests/test_hang.py checks that every entry names a function that exists,
# so a move cannot silently turn a bounded wait into a reported hang.
# distkit's own waits: (module, function) -> the helper named in the report.
_DISTKIT_WAITS = {
    ("distkit.collectives", "_wait"): None,
    ("distkit.runtime._barrier", "_wait_released"): "barrier",
}
# distkit waits with their own liveness check and deadline: never a hang on their own.
_DISTKIT_EXEMPT = {
    (
        "distkit.coordination",
        "_Section.follow",
    ): "waiting for the main process to finish its block (its heartbeat is watched)",
    ("distkit.checkpoint._commit", "_Handshake.settle_other"): "waiting for rank 0 to commit the checkpoint",
}
# distkit's packages that call the helpers (rather than being one): in a process of distkit's own
# (the bench's ranks), the innermost frame of these is the line a report shows.
_CALLERS = ("distkit.bench.", "distkit.checkpoint.", "distkit.testing.", "distkit.trainer.")
# Thin wrappers of the Trainer whose caller is the more useful line.
_TRAINER_PASSTHROUGH = frozenset({"distkit.trainer.precision"})
# distkit's decorators around public functions: the function inside is the entry a report names.
_WRAPPERS = frozenset({"distkit._utils.slips"})
# distkit's objects that a public function returns, named in a report by that function.
_ENTRY_NAMES = {
    ("distkit.coordination", "_FirstSection.__enter__"): "main_process_first",
    ("distkit.coordination", "_FirstSection.__exit__"): "main_process_first",
}
# distkit's collectives that send from one rank: every rank must name the same ``src``.
_WITH_SRC = frozenset({"broadcast_object", "scatter_object"})
# Local names a hand-written loop commonly counts its steps in.
_STEP_NAMES = ("step", "global_step", "iter_num", "iteration", "it")

Frames = list[tuple[CodeType, int, FrameType | None]]


@dataclass
class Location:
    """What one thread is doing, as the report shows it (JSON-ready through :meth:`to_dict`)."""

    kind: str  # WAIT, EXEMPT or BUSY
    op: str  # "distkit.CheckpointManager.save -> all_gather_object", "user code", ...
    file: str | None = None  # shown path (relative to the working directory when inside it)
    line: int | None = None
    function: str | None = None
    context: str | None = None  # "in `if distkit.is_main_process():`"
    step: str | None = None  # "step 124"
    helper: str | None = None  # the distkit collective whose wait is on the stack
    helper_src: int | None = None  # the rank that the helper's data comes from, when it names one
    backward: bool = False  # in autograd's backward (a wait only when DDP is in the process)
    internal: bool = False  # the line shown is distkit's own code, not the user's (a bench worker)
    stack: list[str] = field(default_factory=list)  # outermost first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The hang doctor's own modules: their frames (a thread asking where it is) are never shown.
_DOCTOR_FILES = frozenset(os.path.join(_DOCTOR_DIR, name) for name in ("doctor.py", "where.py", "report.py"))


def thread_frames(ident: int | None) -> Frames:
    """The frames of thread ``ident``, innermost first, without the doctor's own (empty if gone)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _DOCTOR_FILES:
        frame = frame.f_back
    frames: Frames = []
    while frame is not None:
        frames.append((frame.f_code, frame.f_lineno, frame))
        frame = frame.f_back
    return frames


def traceback_frames(tb: TracebackType | None) -> Frames:
    """The frames of a traceback, innermost (where it was raised) first."""
    frames: Frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno, tb.tb_frame))
        tb = tb.tb_next
    frames.reverse()
    return frames


@functools.lru_cache(maxsize=4096)
def _category(filename: str) -> str:
    if filename.startswith("<frozen"):
        return "stdlib"
    if filename.startswith("<"):
        return "user"  # <string>, <stdin>: code the user ran
    path = os.path.abspath(filename)
    if path.startswith(_TRAINER_DIR):
        return "trainer"
    if path.startswith(_DISTKIT_DIR):
        return "distkit"
    if path.startswith(_TORCH_DIR):
        return "torch"
    if path.startswith(_STDLIB_DIRS) and "-packages" + os.sep not in path:
        return "stdlib"
    return "user"


@functools.lru_cache(maxsize=4096)
def _module(filename: str) -> str:
    """The dotted module of a file inside distkit (``"distkit.checkpoint._commit"``); ``""`` outside."""
    path = os.path.abspath(filename)
    if not path.startswith(_DISTKIT_DIR):
        return ""
    parts = ["distkit", *os.path.splitext(path[len(_DISTKIT_DIR) :])[0].split(os.sep)]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _key(code: CodeType) -> tuple[str, str]:
    return _module(code.co_filename), _qualname(code)


@functools.lru_cache(maxsize=4096)
def _torch_relative(filename: str) -> str:
    return os.path.abspath(filename)[len(_TORCH_DIR) :].replace(os.sep, "/")


def short_path(filename: str) -> str:
    """``filename`` as the report shows it: package-relative for distkit and torch, else relative
    to the working directory when inside it, else absolute."""
    if filename.startswith("<"):
        return filename
    path = os.path.abspath(filename)
    for root, name in ((_DISTKIT_DIR, "distkit"), (_TORCH_DIR, "torch")):
        if path.startswith(root):
            return f"{name}/{path[len(root) :]}".replace(os.sep, "/")
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def _qualname(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+


def _decisive(frames: Frames) -> tuple[int, str] | None:
    """Index and category of the frame that says what the thread does (see the module docs)."""
    for index, (code, _, _) in enumerate(frames):
        category = _category(code.co_filename)
        if category == "stdlib":
            continue
        if category == "distkit":
            key = _key(code)
            if key in _DISTKIT_WAITS:
                return index, "distkit-wait"
            if key in _DISTKIT_EXEMPT:
                return index, "exempt"
            return index, "distkit-busy"
        if category == "torch":
            relative = _torch_relative(code.co_filename)
            if relative in _TORCH_COLLECTIVE_FILES:
                return index, "torch-collective"
            if (relative, code.co_name) in _BACKWARD:
                return index, "backward"
            return index, "torch-busy"
        return index, "code-busy"
    return None


def quick_kind(frames: Frames) -> str:
    """WAIT, EXEMPT, BUSY, or ``"backward"`` (decided later): the watchdog's cheap per-sample test."""
    decisive = _decisive(frames)
    if decisive is None:
        return BUSY
    category = decisive[1]
    if category in ("distkit-wait", "torch-collective"):
        return WAIT
    if category == "exempt":
        return EXEMPT
    if category == "backward":
        return "backward"
    return BUSY


def _shown_index(frames: Frames) -> int | None:
    """The frame the report points at: the innermost of the user's code or the Trainer's.

    Code run from ``python -c`` (a ``<string>`` frame) that only calls into distkit is distkit's
    own process (the bench's ranks): its innermost distkit frame that is no wait is shown instead.
    """
    fallback = caller = None
    for index, (code, _, _) in enumerate(frames):
        category = _category(code.co_filename)
        if category == "user" and code.co_filename.startswith("<") and caller is not None:
            return caller
        if category == "user":
            return index
        if category == "trainer" and _module(code.co_filename) not in _TRAINER_PASSTHROUGH:
            return index
        if fallback is None and category != "stdlib":
            fallback = index
        if caller is None and category == "distkit" and _module(code.co_filename).startswith(_CALLERS):
            caller = index  # distkit code that uses the helpers (the bench, checkpoints): the caller
    return fallback


def _distkit_entry(frames: Frames, shown: int | None, decisive: int) -> str | None:
    """The distkit function that the shown frame called (``CheckpointManager.save``)."""
    start = shown - 1 if shown is not None else len(frames) - 1
    for index in range(start, decisive - 1, -1):
        code = frames[index][0]
        if _category(code.co_filename) == "distkit" and _module(code.co_filename) not in _WRAPPERS:
            return _ENTRY_NAMES.get(_key(code), _qualname(code))
    return None


def _helper(frames: Frames, decisive: int) -> tuple[str | None, int | None]:
    """The public distkit collective around a distkit wait (``all_gather_object``, ``barrier``),
    and the ``src`` it was given when it has one (``broadcast_object``, ``scatter_object``)."""
    code = frames[decisive][0]
    named = _DISTKIT_WAITS.get(_key(code))
    if named:
        return named, None
    for outer_code, _, frame in frames[decisive + 1 :]:
        if _category(outer_code.co_filename) != "distkit":
            break
        if not outer_code.co_name.startswith("_"):
            src = frame.f_locals.get("src") if frame is not None and outer_code.co_name in _WITH_SRC else None
            return outer_code.co_name, src if type(src) is int else None
    return None, None


def _torch_op(frames: Frames, decisive: int) -> str:
    """``torch.distributed.all_reduce``, or what DDP is doing, from the torch frames of a collective."""
    c10d_name = None
    ddp_name = None
    for code, _, _ in frames[decisive:]:
        if _category(code.co_filename) != "torch":
            break
        relative = _torch_relative(code.co_filename)
        if relative == "distributed/distributed_c10d.py":
            c10d_name = code.co_name
        elif relative == _DDP_FILE:
            ddp_name = code.co_name
    if ddp_name is not None:
        if ddp_name == "__init__":
            return "DistributedDataParallel construction (parameter broadcast)"
        if ddp_name in ("forward", "_pre_forward", "_post_forward", "_run_ddp_forward"):
            return "DistributedDataParallel forward (bucket rebuild or buffer broadcast)"
        return f"DistributedDataParallel.{ddp_name}"
    if c10d_name is not None:
        return f"torch.distributed.{c10d_name}"
    return "torch.distributed"


def locate(frames: Frames, *, has_ddp: Callable[[], bool] | None = None) -> Location:
    """Describe the thread whose frames (innermost first) are given.

    ``has_ddp`` tells whether the process trains a DDP module; it is called only when the thread is
    in autograd's backward, to tell DDP's gradient all-reduce from plain computation.
    """
    stack = [
        f"{short_path(code.co_filename)}:{line} in {code.co_name}"
        for code, line, _ in reversed(frames)
        if _category(code.co_filename) != "stdlib"
    ][-40:]
    shown = _shown_index(frames)
    where: dict[str, Any] = {}
    if shown is not None:
        code, line, _ = frames[shown]
        where = {
            "internal": _category(code.co_filename) == "distkit",
            "file": short_path(code.co_filename),
            "line": line,
            "function": code.co_name,
            # The `if` around the user's own line; the Trainer's branches would only be noise.
            "context": enclosing_if(code.co_filename, line)
            if _category(code.co_filename) == "user"
            else None,
        }
    decisive = _decisive(frames)
    if decisive is None:
        return Location(BUSY, "no Python code (idle or in C)", stack=stack, **where)
    index, category = decisive
    entry = _distkit_entry(frames, shown, index)
    if category == "distkit-wait":
        helper, src = _helper(frames, index)
        called = helper if src is None else f"{helper}(src={src})"
        op = f"distkit.{called}" if entry is None or entry == helper else f"distkit.{entry} -> {called}"
        return Location(WAIT, op, helper=helper, helper_src=src, stack=stack, **where)
    if category == "exempt":
        code = frames[index][0]
        why = _DISTKIT_EXEMPT[_key(code)]
        return Location(EXEMPT, f"distkit.{entry or _qualname(code)} ({why})", stack=stack, **where)
    if category == "torch-collective":
        op = _torch_op(frames, index)
        if entry is not None and not op.startswith("DistributedDataParallel"):
            op = f"distkit.{entry} -> {op}"
        return Location(WAIT, op, stack=stack, **where)
    if category == "backward":
        if has_ddp is not None and has_ddp():
            return Location(
                WAIT, "DistributedDataParallel backward all-reduce", backward=True, stack=stack, **where
            )
        return Location(BUSY, "autograd backward", backward=True, stack=stack, **where)
    if category == "distkit-busy":
        return Location(BUSY, f"distkit.{entry or _qualname(frames[index][0])}", stack=stack, **where)
    if category == "torch-busy":
        relative = _torch_relative(frames[index][0].co_filename)
        what = (
            "loading data (torch DataLoader)" if relative.startswith("utils/data/") else f"torch ({relative})"
        )
        return Location(BUSY, what, stack=stack, **where)
    code = frames[index][0]
    op = "the Trainer's own code" if _category(code.co_filename) == "trainer" else "user code"
    return Location(BUSY, op, stack=stack, **where)


def step_of(frames: Frames) -> str | None:
    """``"step 124"`` from a step counter in the shown frame's locals (hand-written loops)."""
    shown = _shown_index(frames)
    if shown is None or frames[shown][2] is None:
        return None
    frame = frames[shown][2]
    try:
        local_vars = frame.f_locals  # type: ignore[union-attr]
        for name in _STEP_NAMES:
            value = local_vars.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return f"{name} {value}"
    except Exception:  # a frame that is being torn down
        return None
    return None


# -- DDP in this process --------------------------------------------------------------------------


def ddp_in_frames(frames: Frames) -> bool:
    """Whether a local of the user's or the Trainer's frames is (or holds) a DDP module."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    for code, _, frame in frames:
        if frame is None or _category(code.co_filename) not in ("user", "trainer"):
            continue
        try:
            values = list(frame.f_locals.values())
        except Exception:
            continue
        for value in values:
            if isinstance(value, ddp_type):
                return True
            # One attribute level: self.model, run.wrapped.
            attributes = getattr(value, "__dict__", None)
            # Not a module's: `torch.distributed.reduce_op` warns when merely looked at.
            if (
                isinstance(attributes, dict)
                and not isinstance(value, (type, types.ModuleType))
                and any(isinstance(item, ddp_type) for item in list(attributes.values()))
            ):
                return True
    return False


def ddp_anywhere() -> bool:
    """Whether any live object is a DDP module (slow: walks the garbage collector's objects)."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    return any(isinstance(obj, ddp_type) for obj in gc.get_objects())


# -- collectives issued so far --------------------------------------------------------------------


def group_seqs() -> dict[str, int]:
    """Operations issued so far on each process group this rank is in (torch's sequence numbers)."""
    try:
        pairs = list(dist.distributed_c10d._world.pg_names.items())
    except Exception:  # not initialised, or the registry changed while we read it
        return {}
    seqs: dict[str, int] = {}
    for group, name in pairs:
        try:
            # torch's stub of ProcessGroup lacks this getter; the binding has it.
            seqs[str(name)] = int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
        except Exception:  # a backend that does not count
            continue
    return seqs


def group_label(name: str, *, helper_group: str | None) -> str:
    """How the report names a process group."""
    try:
        default = dist.distributed_c10d._get_default_group()
        if dist.distributed_c10d._world.pg_names.get(default) == name:
            return "the default group"
    except Exception:
        pass
    if name == helper_group:
        return "distkit's helper group"
    return f"group {name!r}"


# -- the `if` around a line -----------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _parsed(filename: str, mtime: float) -> ast.Module | None:
    try:
        with open(filename, encoding="utf-8") as handle:
            return ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _span(body: Iterable[ast.stmt]) -> tuple[int, int] | None:
    statements = list(body)
    if not statements:
        return None
    return statements[0].lineno, statements[-1].end_lineno or statements[-1].lineno


# An `if` whose test looks at the rank: the classic way to run a collective on some ranks only.
RANK_TEST = re.compile(r"rank|main_process|master|is_main|world_size", re.IGNORECASE)


def enclosing_if(filename: str, line: int) -> str | None:
    """```in `if rank == 0:` ``` for the ``if`` of the same function around ``line``: the innermost
    one whose test looks at the rank (``if rank == 0:`` around ``if step % 10 == 0:``), else the
    innermost one."""
    try:
        tree = _parsed(filename, os.stat(filename).st_mtime)
    except OSError:
        return None
    if tree is None:
        return None
    scope_start = 0  # the innermost def or class around the line: an `if` outside it does not apply
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    for node in ast.walk(tree):
        if isinstance(node, scopes) and node.lineno <= line <= (node.end_lineno or node.lineno):
            scope_start = max(scope_start, node.lineno)
    around: list[tuple[ast.If, bool, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or node.lineno <= scope_start:
            continue
        for in_else, span in ((False, _span(node.body)), (True, _span(node.orelse))):
            if span is not None and span[0] <= line <= span[1]:
                text = linecache.getline(filename, node.lineno).strip().split(" #", 1)[0].rstrip()
                around.append((node, in_else, text))
    around.sort(key=lambda found: -found[0].lineno)  # the innermost first
    if not around:
        return None
    node, in_else, text = next((found for found in around if RANK_TEST.search(found[2])), around[0])
    if not text or ("__name__" in text and "__main__" in text):
        return None
    if len(text) > 80:
        text = text[:77] + "..."
    return f"in the `else:` of `{text}`" if in_else else f"in `{text}`"
