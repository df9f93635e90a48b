"""Run under a launcher: writes this rank's view of the job to <out_dir>/rank<R>.json."""

import json
import sys
from pathlib import Path

import distkit

before = {"rank": distkit.get_rank(), "world_size": distkit.get_world_size()}
env = distkit.init()
view = {
    "before_init": before,
    "launcher": env.launcher,
    "rank": distkit.get_rank(),
    "world_size": distkit.get_world_size(),
    "local_rank": distkit.get_local_rank(),
    "local_world_size": distkit.get_local_world_size(),
    "node_rank": distkit.get_node_rank(),
    "is_main_process": distkit.is_main_process(),
    "is_local_main_process": distkit.is_local_main_process(),
    "is_distributed": distkit.is_distributed(),
    "device": str(distkit.get_device()),
    "ranks_seen": distkit.all_gather_object(distkit.get_rank()),
    "mean": distkit.reduce_metrics({"x": float(distkit.get_rank())})["x"],
}
distkit.barrier(timeout_s=60)
Path(sys.argv[1], f"rank{env.rank}.json").write_text(json.dumps(view))
distkit.shutdown()
