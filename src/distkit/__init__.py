"""distkit: PyTorch training on many processes, correct by default and fast.

``import distkit`` imports torch and distkit's own light helpers only; it probes no device, sets
no environment variable and adds no log handler.

Example:
    >>> import distkit
    >>> env = distkit.init()
    >>> distkit.reduce_metrics({"loss": 0.5})
    {'loss': 0.5}
"""

from distkit.collectives import (
    MetricValue,
    all_gather,
    all_gather_object,
    all_ranks,
    all_reduce,
    any_rank,
    broadcast_object,
    reduce_metrics,
)
from distkit.env import LaunchEnv, detect_env, expand_slurm_nodelist
from distkit.errors import CollectiveTimeoutError, DistkitError, MainProcessError
from distkit.runtime import (
    DEFAULT_TIMEOUT_S,
    RankLoggerAdapter,
    barrier,
    get_device,
    get_env,
    get_local_rank,
    get_local_world_size,
    get_logger,
    get_node_rank,
    get_rank,
    get_world_size,
    init,
    is_distributed,
    is_initialized,
    is_local_main_process,
    is_main_process,
    main_process_only,
    rank_zero_print,
    shutdown,
)

__version__ = "0.1.0"

# Heavier parts load on first use, so `import distkit` stays as light as torch itself.
_LAZY: dict[str, str] = {
    # coordination and storage
    "main_process_first": "distkit.coordination",
    "run_on_main": "distkit.coordination",
    "download": "distkit.storage",
    "upload": "distkit.storage",
    "UploadHandle": "distkit.storage",
    # checkpoints
    "save_checkpoint": "distkit.checkpoint",
    "load_checkpoint": "distkit.checkpoint",
    "CheckpointManager": "distkit.checkpoint",
    # seeding and data
    "capture_rng_state": "distkit.seeding",
    "restore_rng_state": "distkit.seeding",
    "seed_everything": "distkit.seeding",
    "seed_worker": "distkit.seeding",
    "distributed_sampler": "distkit.data",
    "distributed_dataloader": "distkit.data",
    "gather_for_metrics": "distkit.data",
    "profile_dataloader": "distkit.data",
    "scale_lr": "distkit.data",
    "linear_warmup": "distkit.data",
    # monitoring and scaling
    "GPUMonitor": "distkit.monitor",
    "ThroughputMeter": "distkit.monitor",
    "memory_stats": "distkit.monitor",
    "profile_scaling": "distkit.bench",
    # trainer
    "Trainer": "distkit.trainer",
    "Callback": "distkit.trainer",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveTimeoutError",
    "DistkitError",
    "LaunchEnv",
    "MainProcessError",
    "MetricValue",
    "RankLoggerAdapter",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_ranks",
    "all_reduce",
    "any_rank",
    "barrier",
    "broadcast_object",
    "detect_env",
    "expand_slurm_nodelist",
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
    "main_process_only",
    "rank_zero_print",
    "reduce_metrics",
    "shutdown",
    *_LAZY,
]
