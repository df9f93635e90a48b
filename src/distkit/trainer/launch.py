"""Start local DDP processes for ``python train.py`` through torch's own elastic launcher.

When ``fit`` runs outside any launcher and the plan wants N processes, it sends itself, the model
and the data to N workers started by :func:`torch.distributed.launcher.api.elastic_launch` (the
machinery behind ``torchrun --standalone``): a c10d rendezvous on 127.0.0.1 with a free port,
workers started with ``spawn``, and torch's ``ChildFailedError`` (first failing rank's traceback
first) when a worker fails. Inside each worker ``fit`` finds torchrun's variables and joins the job.
"""

from __future__ import annotations

import os
import pickle
import uuid
from typing import Any

import torch

from distkit import runtime
from distkit.errors import DistkitError
from distkit.trainer.strategies import LOCAL_RUN_PREFIX

__all__: list[str] = []

# How long the workers may take to meet at the rendezvous. Local workers start within seconds;
# a minute covers a loaded machine importing torch N times at once.
_RENDEZVOUS_TIMEOUT_S = 60


def serialize(what: str, payload: tuple[Any, ...]) -> bytes:
    """Pickle what the workers need, with an error that says which object cannot travel.

    Plain pickle copies tensors into the bytes. Handing tensors to ``multiprocessing`` directly
    would move them to shared memory, and every worker would then train the same parameters.
    """
    try:
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise DistkitError(
            f"fit() starts its own processes and sends them {what}, but something in it cannot be "
            f"pickled: {err}. Define models, datasets, loss and metric functions at module level (no "
            f"lambdas, no local classes), pass an optimizer factory instead of an object holding "
            f"unpicklable state, or start the script under `torchrun --nproc_per_node=N`, which needs "
            f"no pickling."
        ) from err


def launch(nprocs: int, payload: bytes) -> dict[int, Any]:
    """Run :func:`_worker` on ``nprocs`` local processes; return each rank's return value.

    Local to this process (it becomes the launcher agent); raises torch's ``ChildFailedError``
    when a worker fails.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"{LOCAL_RUN_PREFIX}{uuid.uuid4().hex[:12]}",
        # As `torchrun --standalone`: a c10d rendezvous whose store picks a free port, bound to the
        # loopback address so that nothing outside this machine can join.
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"timeout": _RENDEZVOUS_TIMEOUT_S},
        local_addr="127.0.0.1",
        max_restarts=0,
        start_method="spawn",
    )
    return elastic_launch(config, _worker)(payload)


def _worker(payload: bytes) -> bytes:
    # Each worker is a fresh interpreter; torchrun would set OMP_NUM_THREADS=1 here so that N
    # processes do not each start one thread per core. Share the cores instead, unless the user
    # chose a number.
    if "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    from distkit.trainer.trainer import _Preempted

    trainer, model, args, kwargs = pickle.loads(payload)
    preempted = False
    try:
        trainer.fit(model, *args, **kwargs)
    except _Preempted:
        preempted = True
    outcome = trainer._outcome(preempted) if runtime.is_main_process() else None
    return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
