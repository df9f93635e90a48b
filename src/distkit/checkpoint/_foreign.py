"""What a path holds when it is not a distkit checkpoint (private): other tools' layouts, by their files.

A directory without ``manifest.json`` is one of three things, and an error must say which (issue 28):
a checkpoint another tool wrote (a ``torch.distributed.checkpoint`` directory as torchtitan writes
them, an Accelerate ``save_state`` directory, a Lightning sharded ``.ckpt`` directory), a distkit
save that did not finish (only the files distkit writes, without the manifest that commits them),
or files that are no checkpoint at all. A file is recognized as a Lightning checkpoint by the keys
its pickle names, read without unpickling anything. Each layout comes with the command that loads
or converts it; :class:`~distkit.checkpoint.ForeignCheckpointError` carries both.

Only names are looked at for a directory (what a listing gives, local or object store); a file is
opened only when it is local and regular.
"""

from __future__ import annotations

import os
import pickletools
import re
import stat
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from distkit._utils.secrets import redact_url
from distkit.checkpoint._errors import CheckpointCorruptError, ForeignCheckpointError
from distkit.checkpoint._format import _DCP_METADATA_FILE, _MANIFEST_FILE, _STATE_FILE, _STEP_RE, _is_own_file
from distkit.errors import DistkitError

# The files of Accelerate's save_state (accelerate/utils/constants.py and checkpointing.py): the
# models (model.safetensors, or pytorch_model.bin with safe_serialization=False; a suffix _<i> for
# the i-th model; pytorch_model_fsdp* under FSDP), optimizer.bin, scheduler.bin, sampler.bin,
# dl_state_dict.bin, scaler.pt, the RNG states of each process and the registered custom objects.
_ACCELERATE_FILE_RE = re.compile(
    r"^(model(_\d+)?\.safetensors|pytorch_model(_fsdp)?(_\d+)?\.bin|optimizer(_\d+)?\.bin"
    r"|scheduler(_\d+)?\.bin|sampler(_\d+)?\.bin|dl_state_dict(_\d+)?\.bin|scaler\.pt"
    r"|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|pytorch_model_fsdp_\d+|optimizer_\d+)$"
)
# Lightning's FSDP strategy with state_dict_type="sharded" writes a DCP directory plus this file
# (lightning/fabric/utilities/load.py, _METADATA_FILENAME).
_LIGHTNING_SHARDED_META = "meta.pt"
# Sharded Hugging Face weights (save_pretrained, accelerate's save_model, torchtitan's HF export).
_HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# The keys Lightning's dump_checkpoint writes (lightning/pytorch/trainer/connectors/checkpoint_connector.py).
_LIGHTNING_VERSION_KEY = "pytorch-lightning_version"
_LIGHTNING_KEYS = frozenset({"optimizer_states", "global_step", "loops", "lr_schedulers"})
# A Lightning checkpoint's pickle (data.pkl in the zip torch.save writes) holds keys and tensor
# references, not tensor data: a few MB at most. A bigger one is not scanned.
_MAX_SCANNED_PICKLE = 64 << 20
_STRING_OPCODES = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING"}
)
# Names of step directories that other tools write: torchtitan's step-<N>, Accelerate's
# automatic checkpoint_<N> (a count of saves, not a step), and step_<N> as Accelerate's examples write.
_NUMBERED_RE = re.compile(r"(\d+)(?:\.ckpt)?$")


@dataclass(frozen=True)
class _Layout:
    """A checkpoint layout of another tool (or none), and how to load or convert a path that has it."""

    kind: str
    description: str

    def fix(self, path: str) -> str:
        shown = redact_url(path)
        if self.kind == "dcp":
            return (
                f"distkit loads it as it is: distkit.load_checkpoint({shown!r}, {{'model': model, "
                f"'optimizer': optimizer}}) or Trainer(resume={shown!r}) (see docs/checkpoints.md, "
                f"'Checkpoints from other tools')"
            )
        if self.kind in ("accelerate", "lightning"):
            return (
                f"convert it once into a distkit checkpoint: `distkit checkpoint import {shown} DEST` "
                f"(or distkit.import_checkpoint), then load DEST: Trainer(resume='DEST') or "
                f"distkit.load_checkpoint('DEST', state)"
            )
        if self.kind == "lightning-sharded":
            return (
                f"consolidate it with Lightning first: `python -m lightning.pytorch.utilities."
                f"consolidate_checkpoint {shown} --output_file model.ckpt`, then `distkit checkpoint "
                f"import model.ckpt DEST`"
            )
        if self.kind == "hf-sharded":
            return (
                "distkit does not import sharded Hugging Face weights; load them with transformers' "
                "from_pretrained or the safetensors package, then save the model with "
                "distkit.save_checkpoint"
            )
        return (
            f"a distkit checkpoint is a directory holding {_MANIFEST_FILE} and {_STATE_FILE} (`distkit "
            f"checkpoint list DIR` shows a CheckpointManager directory's checkpoints); distkit also "
            f"loads torch.distributed.checkpoint directories and imports Accelerate and Lightning "
            f"checkpoints (docs/checkpoints.md, 'Checkpoints from other tools')"
        )

    def error(self, path: str) -> ForeignCheckpointError:
        return ForeignCheckpointError(path, self.kind, self.description, self.fix(path))


def _shown_names(names: Iterable[str], limit: int = 4) -> str:
    ordered = sorted(names)
    more = f", ... ({len(ordered)} files)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more


def _identify_directory(names: set[str] | frozenset[str]) -> _Layout | None:
    """The layout of a directory holding ``names`` (files and sub-directories) and no distkit manifest,
    or ``None`` when it holds nothing another tool is known to write."""
    if _MANIFEST_FILE in names:
        return None
    if _DCP_METADATA_FILE in names and _LIGHTNING_SHARDED_META in names:
        return _Layout(
            "lightning-sharded",
            f"a Lightning FSDP checkpoint saved with state_dict_type='sharded' ({_DCP_METADATA_FILE}, "
            f"{_LIGHTNING_SHARDED_META})",
        )
    if _DCP_METADATA_FILE in names and _STATE_FILE not in names:
        shards = sum(1 for name in names if name.endswith(".distcp"))
        return _Layout(
            "dcp",
            f"a torch.distributed.checkpoint directory without a distkit manifest, as torchtitan and "
            f"dcp.save write them ({_DCP_METADATA_FILE} and {shards} .distcp file(s))",
        )
    accelerate = [name for name in names if _ACCELERATE_FILE_RE.match(name)]
    if accelerate:
        return _Layout("accelerate", f"an Accelerate save_state directory ({_shown_names(accelerate)})")
    index = [name for name in _HF_INDEX_FILES if name in names]
    if index:
        return _Layout("hf-sharded", f"sharded Hugging Face weights ({index[0]})")
    return None


def _looks_unfinished(names: set[str] | frozenset[str]) -> bool:
    """Whether a directory without a manifest holds what a distkit save in progress writes, and only
    that: ``state.pt`` (an object store's put before the manifest's) or a sharded save's DCP files
    beside it, or DCP shards without their ``.metadata`` (written last by DCP)."""
    return bool(names) and all(_is_own_file(name) for name in names)


def _unknown(names: set[str] | frozenset[str]) -> _Layout:
    return _Layout(
        "unknown", f"a directory of other files ({_shown_names(names)}), no checkpoint distkit knows"
    )


def _manager_directory(
    path: str,
    names: set[str] | frozenset[str],
    *,
    complete: Callable[[str], bool],
    run: tuple[str, set[str]] | None = None,
) -> ForeignCheckpointError | None:
    """The error for a :class:`CheckpointManager` directory (``step_<N>`` sub-directories) at ``path``
    passed where one checkpoint is needed, naming its highest complete step's checkpoint (``complete``
    tells, by name, whether a sub-directory holds a manifest); ``None`` for another directory.
    ``run``: the directory that was passed and its names, when it is a Trainer run's
    ``default_root_dir`` whose ``checkpoints`` sub-directory is ``path``."""
    steps = sorted((int(found.group(1)), name) for name in names if (found := _STEP_RE.match(name)))
    if not steps:
        return None
    shown = redact_url(path)
    listed = _shown_names(name for _, name in steps)
    holding = f"{len(steps)} step checkpoint(s) ({listed})"
    # A save killed before its manifest leaves a step directory: never the one to recommend.
    finished = [name for _, name in steps if complete(name)]
    unfinished = [name for _, name in steps if finished and _step_of(name) > _step_of(finished[-1])]
    if not finished:
        holding += f", none of them complete (no {_MANIFEST_FILE}: saves that did not finish)"
    elif unfinished:
        holding += f"; {_shown_names(unfinished)} did not finish (no {_MANIFEST_FILE})"
    newest = f"{shown.rstrip('/')}/{(finished or [steps[-1][1]])[-1]}"
    fix = (
        f"pass one of them, e.g. the highest complete step's: distkit.load_checkpoint({newest!r}, state), "
        f"Trainer(resume={newest!r}) or `distkit checkpoint inspect {newest}`. "
        f"CheckpointManager({shown!r}).restore(state) restores the newest complete one (as "
        f"Trainer(resume='auto') does from its own checkpoints), and `distkit checkpoint list {shown}` "
        f"lists them"
    )
    if run is None:
        layout = f"a CheckpointManager directory holding {holding}"
        message = f"{shown} is not one checkpoint: it is {layout}. {fix[:1].upper()}{fix[1:]}."
        return ForeignCheckpointError(path, "manager", layout, fix, message=message, suggested=newest)
    given, given_names = redact_url(run[0]), run[1]
    layout = (
        f"a Trainer run directory ({_shown_names(given_names)}) whose checkpoints are in {shown}, {holding}"
    )
    fix += f"; Trainer(default_root_dir={given!r}, resume='auto') continues that run"
    message = f"{given} is not one checkpoint: it looks like {layout}. {fix[:1].upper()}{fix[1:]}."
    return ForeignCheckpointError(run[0], "manager", layout, fix, message=message, suggested=newest)


def _pickle_strings(path: str) -> set[str] | None:
    """The strings named in the pickle of a ``torch.save`` file at ``path`` (local), read opcode by
    opcode without unpickling anything; ``None`` when it is not such a file or cannot be read."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None  # never open a FIFO or a device: opening one can block
        with zipfile.ZipFile(path) as archive:
            records = [info for info in archive.infolist() if info.filename.endswith("data.pkl")]
            if len(records) != 1 or records[0].file_size > _MAX_SCANNED_PICKLE:
                return None
            data = archive.read(records[0])
        return {
            arg
            for opcode, arg, _ in pickletools.genops(data)
            if opcode.name in _STRING_OPCODES and isinstance(arg, str)
        }
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
        return None


def _identify_file(path: str) -> _Layout | None:
    """The layout of the local file at ``path`` when another tool's checkpoint is recognized in it."""
    strings = _pickle_strings(path)
    if strings is None or "state_dict" not in strings:
        return None
    if _LIGHTNING_VERSION_KEY in strings or len(_LIGHTNING_KEYS & strings) >= 2:
        return _Layout(
            "lightning",
            "a Lightning checkpoint (a torch.save'd dict with state_dict, optimizer_states, global_step)",
        )
    return None


def _step_of(name: str) -> int:
    found = _NUMBERED_RE.search(name)
    return int(found.group(1)) if found else -1


def _foreign_checkpoints(listing: Mapping[str, set[str]], top: Iterable[str]) -> list[tuple[str, _Layout]]:
    """Other tools' checkpoints among a directory's entries: its sub-directories (``listing``: name ->
    the names inside) and its files (``top``: Lightning's ``*.ckpt``), newest-looking first."""
    found = []
    for name, files in listing.items():
        layout = _identify_directory(files)
        if layout is not None and layout.kind != "unknown":
            found.append((name, layout))
    for name in top:
        if name.endswith(".ckpt") and name not in listing:
            found.append((name, _Layout("lightning", "a Lightning checkpoint file (*.ckpt)")))
    # last.ckpt is Lightning's newest; otherwise the highest number in the name (step-200 > step-100).
    return sorted(found, key=lambda item: (item[0] == "last.ckpt", _step_of(item[0]), item[0]), reverse=True)


def _without_manifest(
    path: str,
    names: set[str],
    *,
    complete: Callable[[str, str], bool],
    run_checkpoints: tuple[str, set[str]] | None = None,
) -> DistkitError:
    """Why the directory ``path``, holding ``names`` and no manifest, is not a checkpoint distkit can
    load: another tool's checkpoint, a distkit save that did not finish, or something else (issue 28:
    only the second is "a save that did not finish"). ``run_checkpoints``: the path and names of its
    ``checkpoints`` sub-directory, when it has one (a Trainer run's ``default_root_dir``);
    ``complete(directory, name)``: whether the sub-directory ``name`` of ``directory`` holds a
    manifest."""
    layout = _identify_directory(names)
    if layout is not None:
        return layout.error(path)
    if not names:
        return CheckpointCorruptError(
            path, f"it is an empty directory, with no {_MANIFEST_FILE}: nothing was saved in it"
        )
    manager = _manager_directory(path, names, complete=lambda name: complete(path, name))
    if manager is None and run_checkpoints is not None:
        inner = run_checkpoints[0]
        manager = _manager_directory(
            *run_checkpoints, complete=lambda name: complete(inner, name), run=(path, names)
        )
    if manager is not None:
        return manager
    if _looks_unfinished(names):
        return CheckpointCorruptError(
            path,
            f"it has no {_MANIFEST_FILE} (a save that did not finish: it holds only the files a distkit "
            f"save writes before its manifest, {sorted(names)[:5]})",
        )
    return _unknown(names).error(path)
