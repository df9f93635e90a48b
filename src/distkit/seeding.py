"""Seeds, per-stream seed derivation, DataLoader worker seeding, and RNG state capture/restore.

Every random stream distkit sets up is derived from one integer seed by :func:`derive_seed`, a
documented, hash-free formula in pure Python (SplitMix64 steps), so the same (seed, rank, worker,
epoch) gives the same stream on any machine, with or without numpy, and distinct keys give distinct
streams. Nothing is passed through environment variables.

RNG states are kept as tensors and plain lists only, so a checkpoint that holds them loads with
``torch.load(weights_only=True)`` (numpy's own state tuple would be refused).
"""

from __future__ import annotations

import ctypes
import os
import random
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "capture_rng_state",
    "derive_seed",
    "restore_rng_state",
    "seed_everything",
    "seed_worker",
]

_T = TypeVar("_T")

_MASK64 = (1 << 64) - 1
# numpy's legacy global RNG takes scalar seeds in [0, 2**32 - 1] only; seed_everything seeds it with
# the user's seed as is, so that is the range every library accepts.
_MAX_SEED = (1 << 32) - 1

# Stream kinds: the first key after the seed, so that streams of different kinds never share keys.
_STREAM_SHUFFLE = 0
_STREAM_WORKER = 1
_STREAM_BATCH = 2
_STREAM_LOADER = 3
_STREAM_REST_BATCH = 4  # a batch of the rest of an epoch resumed on another number of ranks
_STREAM_RANK = 5  # rank r's own generators under seed_everything(seed, per_rank=True)

# Per-library sub-keys: python's `random` and numpy both use MT19937 seeded through init_by_array,
# so one integer would give them the same sequence; each library gets its own derived seed.
_PYTHON, _NUMPY, _TORCH = 0, 1, 2

# The seed given to seed_everything(seed, workers=True): the default seed of distkit loaders made
# afterwards in this process. A module global, not an environment variable, so it never leaks into
# child processes or other jobs.
_loader_seed: int | None = None
# (seed, rank) of the last seed_everything(seed, per_rank=True) in this process, else None: what a
# process started by fit() needs to give each of its ranks its own streams (see
# _restore_process_seeding).
_per_rank: tuple[int, int] | None = None


def _splitmix64(x: int) -> int:
    # SplitMix64 (Steele, Lea, Flood 2014): a bijection on 64-bit integers with good avalanche.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *keys: int) -> int:
    """A 64-bit seed for the stream named by ``keys``, derived from ``seed``.

    Local: no communication. The formula, in pure Python (``M = 2**64 - 1``)::

        h = splitmix64(seed & M)
        for k in keys:
            h = splitmix64(h ^ (k & M))

    where ``splitmix64`` is the SplitMix64 output function. Every step is a bijection, so two key
    tuples of the same length that differ only in their last key never give the same seed.

    Args:
        seed: The job's seed.
        keys: Non-negative integers naming the stream, e.g. ``(kind, rank, worker, epoch)``.

    Returns:
        An integer in ``[0, 2**64)``.

    Example:
        >>> derive_seed(42, 1, 0, 0, 0) == derive_seed(42, 1, 0, 0, 0) != derive_seed(42, 1, 1, 0, 0)
        True
    """
    h = _splitmix64(seed & _MASK64)
    for key in keys:
        h = _splitmix64(h ^ (key & _MASK64))
    return h


def _numpy() -> Any:
    # numpy is optional at run time (torch does not need it).
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _apply_stream_seed(stream_seed: int) -> None:
    """Seed python's ``random``, numpy's global RNG (when installed) and torch's CPU generator from
    one stream seed, each through its own :func:`derive_seed` sub-key (0, 1 and 2). Local."""
    random.seed(derive_seed(stream_seed, _PYTHON))
    np = _numpy()
    if np is not None:
        np_seed = derive_seed(stream_seed, _NUMPY)
        # Two 32-bit words: numpy's legacy seeding takes arrays of uint32, not 64-bit integers.
        np.random.seed([np_seed & 0xFFFFFFFF, np_seed >> 32])
    # The CPU generator only: data streams never touch (or initialise) CUDA.
    torch.default_generator.manual_seed(derive_seed(stream_seed, _TORCH))


# numpy's legacy MT19937 state struct: uint32_t key[624] then int pos (numpy/random/src/mt19937/
# mt19937.h, unchanged since numpy 1.17). Copied raw, it saves and restores in about 2 us, against
# about 60 us each for np.random.get_state()/set_state() (2-core CPU here).
_MT_STATE_BYTES = 624 * 4 + 4
# (raw MT19937 bytes, np.random.get_state()) of the last state _run_on_stream put back: while the
# training process does not touch numpy's global RNG, the next batch reuses it instead of calling
# get_state() again.
_numpy_saved: tuple[bytes, Any] | None = None


def _save_numpy(np: Any) -> tuple[Any, bytes | None, int]:
    global _numpy_saved
    get_bit_generator = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25
    bit_generator: Any = get_bit_generator() if get_bit_generator is not None else None
    if type(bit_generator) is not np.random.MT19937:  # another bit generator: the portable way
        return np.random.get_state(), None, 0
    address = bit_generator.ctypes.state_address
    raw = ctypes.string_at(address, _MT_STATE_BYTES)
    # Valid only without a cached Gaussian: consuming one changes the state but not the raw bytes.
    if _numpy_saved is not None and _numpy_saved[0] == raw and _numpy_saved[1][3] == 0:
        return _numpy_saved[1], raw, address
    state = np.random.get_state()
    # Check the layout against numpy's own view before ever writing raw bytes back.
    expected = state[1].astype("<u4").tobytes() + int(state[2]).to_bytes(4, "little", signed=True)
    if raw != expected:
        return state, None, 0
    _numpy_saved = (raw, state)
    return state, raw, address


def _restore_numpy(np: Any, state: Any, raw: bytes | None, address: int) -> None:
    if raw is not None and state[3] == 0:
        np.random.seed(0)  # clears any Gaussian the block cached (the saved state had none)
        ctypes.memmove(address, raw, _MT_STATE_BYTES)
    else:
        np.random.set_state(state)


def _run_on_stream(stream_seed: int, fn: Callable[[], _T]) -> _T:
    """``fn()`` on the stream ``stream_seed``, then python's, numpy's and torch's CPU RNG states
    put back, so the caller's own streams (dropout, init) are not disturbed. Local."""
    python_state = random.getstate()
    np = _numpy()
    numpy_saved = _save_numpy(np) if np is not None else None
    torch_state = torch.get_rng_state()
    _apply_stream_seed(stream_seed)
    try:
        return fn()
    finally:
        random.setstate(python_state)
        if numpy_saved is not None:
            _restore_numpy(np, *numpy_saved)
        torch.set_rng_state(torch_state)


def _check_seed(seed: object, *, name: str = "seed", limit: int = _MASK64) -> int:
    """``seed`` as an int in ``[0, limit]``, or a ``TypeError``/``ValueError`` saying what to pass."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{name} must be an int, got {type(seed).__name__} {seed!r}.")
    if not 0 <= seed <= limit:
        raise ValueError(f"{name} must be in [0, {limit}], got {seed}.")
    return seed


def _rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s generators under ``seed_everything(seed, per_rank=True)``. Local.

    ``derive_seed(seed, 5, rank) % 2**32``: a 32-bit value, so numpy's scalar seeding takes it as
    python and torch do.
    """
    return derive_seed(seed, _STREAM_RANK, rank) & _MAX_SEED


def _seed_generators(seed: int) -> None:
    """``random.seed``, ``numpy.random.seed`` (when installed) and ``torch.manual_seed``. Local."""
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily, without initialising CUDA)


def seed_everything(
    seed: int, *, workers: bool = True, deterministic: bool = False, per_rank: bool = False
) -> int:
    """Seed python's ``random``, numpy (when installed) and torch on the CPU and every CUDA device.

    Local: no communication. Call it on every rank with the same seed: ranks then start from the
    same model weights, while distkit loaders still give each rank (and each worker) its own data
    stream (see :func:`derive_seed` and ``docs/data.md``). Works the same without a process group.

    ``random.seed(seed)``, ``numpy.random.seed(seed)`` and ``torch.manual_seed(seed)`` are called as
    is, so code seeded by hand with the same number draws the same values. No environment variable
    is read or written (``deterministic=True`` aside, see below).

    With ``per_rank=True`` (nanoGPT's ``seed + rank``, done without its pitfalls) each rank's
    generators get their own seed, so dropout and other draws in the training step differ across
    ranks, while the data order stays that of the common ``seed`` on every rank. Rank ``r`` calls
    the three seeding functions above with ``derive_seed(seed, 5, r) % 2**32`` instead of ``seed``
    (a hash rather than ``seed + r``: with ``seed + r``, rank 1 of a run with seed 42 draws what rank
    0 of a run with seed 43 draws, so a seed sweep reuses streams, and ``seed + r`` can exceed
    numpy's limit). The rank is the launcher's (``RANK``), so it may be called before
    :func:`distkit.init`; without a launcher it is 0. Ranks then also initialise models
    differently: build the model before calling it (as ``Trainer`` does), or rely on DDP, which
    copies rank 0's weights to every rank; FSDP does not.

    Args:
        seed: An int in ``[0, 2**32 - 1]`` (numpy's limit for a scalar seed).
        workers: Make ``seed`` the default seed of distkit loaders and samplers made afterwards in
            this process (their shuffling and their worker and per-batch streams). With ``False``
            they keep their own default, 0, so the data order stays fixed while the model seed varies.
            Under ``per_rank=True`` too, the loaders' default is the common ``seed``, never the rank's.
        deterministic: Also call ``torch.use_deterministic_algorithms(True)``, set
            ``torch.backends.cudnn.deterministic = True`` and ``cudnn.benchmark = False``, and set
            ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless already set (cuBLAS reads only that variable;
            torch documents it as required for deterministic cuBLAS). ``False`` changes none of these.
        per_rank: Give each rank's generators their own seed, derived from ``(seed, rank)`` as
            above. ``False``: every rank gets ``seed`` itself.

    Returns:
        The seed given to this process's generators: ``seed``, or with ``per_rank=True`` this rank's
        derived seed.

    Raises:
        TypeError: ``seed`` is not an int.
        ValueError: ``seed`` is outside ``[0, 2**32 - 1]``.

    Example:
        >>> import torch, distkit
        >>> distkit.seed_everything(7)
        7
        >>> a = torch.rand(1); _ = torch.manual_seed(7); bool(torch.rand(1) == a)
        True
        >>> from distkit.seeding import derive_seed
        >>> distkit.seed_everything(7, per_rank=True) == derive_seed(7, 5, distkit.get_rank()) % 2**32
        True
    """
    global _loader_seed, _per_rank
    _check_seed(seed, limit=_MAX_SEED)
    if per_rank:
        from distkit.runtime import get_rank  # as in seed_worker: imported only when a rank is needed

        rank = get_rank()
        applied = _rank_seed(seed, rank)
        _per_rank = (seed, rank)
    else:
        applied = seed
        _per_rank = None
    _seed_generators(applied)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    # The common seed, per_rank or not: data order and data streams never depend on the rank's seed.
    _loader_seed = seed if workers else None
    return applied


def _default_loader_seed() -> int:
    """The seed distkit loaders use when given none: ``seed_everything(seed, workers=True)``'s, else 0."""
    return 0 if _loader_seed is None else _loader_seed


def _capture_process_seeding() -> dict[str, Any]:
    """This process's seeding, for a process started with ``spawn`` to carry on from. Local.

    A spawned process starts with fresh generators (torch seeds its CPU generator at random, python
    and numpy from the OS), distkit's default loader seed 0 and torch's default determinism
    settings; a ``torchrun`` rank running the same script instead has whatever the script set up and
    drew before that point. This is that state: every RNG state (:func:`capture_rng_state`), the
    default loader seed of :func:`seed_everything`, and the determinism switches it sets. Nothing
    here depends on the rank: every rank of a torchrun job seeded alike and drew alike, except after
    ``seed_everything(seed, per_rank=True)``, whose ``(seed, rank)`` is kept for
    :func:`_restore_process_seeding` to give the other ranks their own streams. Tensors and plain
    data, so it pickles.
    """
    return {
        "rng": capture_rng_state(),
        # CUDA generators are captured only once CUDA is initialised; before that, a seeded script's
        # torch.manual_seed (seed_everything's) has queued its seed for them: initial_seed().
        "torch_initial_seed": torch.initial_seed(),
        "loader_seed": _loader_seed,
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        "per_rank": _per_rank,
    }


def _restore_process_seeding(state: dict[str, Any]) -> None:
    """Make this (spawned) process's seeding what :func:`_capture_process_seeding` captured. Local.

    Touches no CUDA device: CUDA generator states and seeds are queued until CUDA initialises.

    After ``seed_everything(seed, per_rank=True)`` in the launching process (rank 0 there, having no
    launcher), the rank it was seeded as continues its generators exactly, and every other rank
    starts from its own per-rank seed, as its ``seed_everything`` call would have left it under
    torchrun: the same streams as torchrun's when the script draws nothing between that call and
    ``fit`` (the usual order: model built first, then seeded), distinct per rank in any case.
    """
    global _loader_seed, _per_rank
    restore_rng_state(state["rng"])
    if "cuda" not in state["rng"] and not torch.cuda._is_in_bad_fork():
        # As torch.manual_seed does: lazily, so the worker picks its device first.
        torch.cuda.manual_seed_all(state["torch_initial_seed"])
    _loader_seed = state["loader_seed"]
    _per_rank = state.get("per_rank")  # absent from a state captured by an older distkit
    if _per_rank is not None:
        from distkit.runtime import get_rank

        seed, seeded_rank = _per_rank
        rank = get_rank()
        if rank != seeded_rank:
            # The draws the launching process made since seeding cannot be replayed on another
            # rank's stream; this rank starts its stream where seed_everything would have put it.
            _seed_generators(_rank_seed(seed, rank))
            _per_rank = (seed, rank)
    enabled, warn_only = state["deterministic"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = state["cudnn"]


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` for DataLoaders you make: a distinct stream for every rank, worker and pass.

    Local: runs inside a DataLoader worker process. torch already seeds each worker from a base
    seed it draws from the loader's ``generator`` (or torch's global RNG) at every new pass, but that
    base seed is the same on every rank after ``seed_everything``, so every rank's workers draw the
    same augmentations. This function reseeds python's ``random``, numpy and torch in the worker from
    ``derive_seed(base_seed, 1, rank, worker_id, 0)`` (the worker formula of ``docs/data.md`` with
    the base seed standing for the job seed and the pass). Without a process group the rank is 0.

    Loaders made by :func:`distkit.distributed_dataloader` seed their workers themselves.

    Args:
        worker_id: The worker's index, as torch passes it.

    Example:
        >>> import torch, distkit
        >>> loader = torch.utils.data.DataLoader(
        ...     range(8), num_workers=2, worker_init_fn=distkit.seed_worker,
        ...     generator=torch.Generator().manual_seed(0))
    """
    from torch.utils.data import get_worker_info

    from distkit.runtime import get_rank

    info = get_worker_info()
    # Outside a worker (called by hand) there is no base seed; torch's initial seed stands in.
    base_seed = torch.initial_seed() if info is None else info.seed - info.id
    _apply_stream_seed(derive_seed(base_seed, _STREAM_WORKER, get_rank(), worker_id, 0))


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy (when installed), torch CPU and every CUDA device.

    Local: no communication; each rank captures its own streams.

    Returns:
        A dict of tensors and plain lists, safe for ``torch.load(weights_only=True)``.

    Example:
        >>> state = capture_rng_state()
        >>> a = torch.rand(1); restore_rng_state(state); bool(torch.rand(1) == a)
        True
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back RNG states captured by :func:`capture_rng_state`. Local.

    Missing parts (numpy absent when captured, no CUDA) are left as they are.

    Example:
        >>> restore_rng_state(capture_rng_state())
    """
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(int(x) for x in internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state(
                (kind, keys.numpy().astype("uint32"), int(pos), int(has_gauss), float(cached))
            )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
