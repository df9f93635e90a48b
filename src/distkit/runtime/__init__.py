"""Process-group setup and teardown, rank queries, a barrier with a deadline, rank-aware output.

Every query works in three situations with one code path for the caller: before :func:`init`
(read from the launcher's environment), after it, and in a world of one (no launcher at all).
"""

# The code lives in private modules of this package, one concern each; this is their public face
# (and, re-exported with `as`, the private helpers distkit's other modules share).
#   _state.py    the process-wide state beside torch's process group; exit codes, default timeout
#   _ranks.py    rank queries, the one-rank decorators, rank-aware output (local)
#   _join.py     init() and shutdown(): device, backend, the store, the ranks' claims
#   _barrier.py  the barrier with a deadline that names the missing ranks
from distkit.runtime._barrier import barrier
from distkit.runtime._join import (
    _cpu_group as _cpu_group,
    _on_failure as _on_failure,
    _require_runtime as _require_runtime,
    _resolve_backend as _resolve_backend,
    _store as _store,
    _watch_fit as _watch_fit,
    init,
    shutdown,
)
from distkit.runtime._ranks import (
    RankLoggerAdapter,
    _rank_label as _rank_label,
    get_device,
    get_env,
    get_local_rank,
    get_local_world_size,
    get_logger,
    get_node_rank,
    get_rank,
    get_world_size,
    is_distributed,
    is_initialized,
    is_local_main_process,
    is_main_process,
    local_main_process_only,
    main_process_only,
    rank_zero_print,
)
from distkit.runtime._state import (
    DEFAULT_TIMEOUT_S,
    HANG_EXIT_CODE,
    PEER_FAILED_EXIT_CODE,
    _abandon as _abandon,
    _current as _current,
    _doctor as _doctor,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HANG_EXIT_CODE",
    "PEER_FAILED_EXIT_CODE",
    "RankLoggerAdapter",
    "barrier",
    "get_device",
    "get_env",
    "get_local_rank",
    "get_local_world_size",
    "get_logger",
    "get_node_rank",
    "get_rank",
    "get_world_size",
    "init",
    "is_distributed",
    "is_initialized",
    "is_local_main_process",
    "is_main_process",
    "local_main_process_only",
    "main_process_only",
    "rank_zero_print",
    "shutdown",
]
