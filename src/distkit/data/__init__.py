"""Distributed samplers and DataLoaders: seeded by default, exact evaluation, mid-epoch resume.

Three guarantees, each tested on real process groups:

- **Every rank sees the same number of batches.** Training pads by wrapping (``drop_last=False``)
  or drops the tail (``drop_last=True``), as ``DistributedSampler`` does, so no rank waits in a
  collective for a rank that ran out of data. Evaluation never pads: every sample is seen exactly
  once, and batches are laid out so that every rank still gets the same number of batches whenever
  ``batch_size >= 2``.
- **Every batch has its own random stream**, derived from (seed, rank, epoch, batch) and applied
  around fetching and collating it, in a worker or in the training process alike. A batch's content,
  random augmentations included, therefore does not depend on the number of workers or on what was
  loaded before it, which is what makes mid-epoch resume exact.
- **Epochs advance by themselves, and never apart.** A pass run to its end moves to the next epoch,
  so ``set_epoch`` is optional; a pass left early (``next(iter(loader))`` on one rank, a ``break``)
  leaves the epoch as it was, so a rank that looks at a batch alone stays on the others' split. The
  two cases no rank can align by itself (a full extra pass on some ranks; every rank stopping each
  epoch after a few steps) raise a ``DistkitError`` naming the fix.

The formulas are in ``docs/data.md``.
"""

from __future__ import annotations

# The code lives in private modules of this package, one concern each; this is their public face.
#   _checks.py   argument checks shared by the sampler and the loader
#   _epochs.py   which passes move to the next epoch; the cases no rank can settle alone
#   _split.py    the split formulas: epoch order, each rank's share, evaluation layout, resume
#   _sampler.py  DistributedSplitSampler, distributed_sampler
#   _loader.py   DistributedLoader, distributed_dataloader
#   _stream.py   StreamLoader, ShardFiles: iterable and streaming data
#   _share.py    split_between_processes: this rank's share of a list, tensor or dict
#   _gather.py   gather_for_metrics
#   _profile.py  DataLoaderProfile, profile_dataloader
# scale_lr and linear_warmup live in distkit.optim; importable from here as before.
from distkit.data._gather import gather_for_metrics
from distkit.data._loader import DistributedLoader, distributed_dataloader
from distkit.data._profile import DataLoaderProfile, profile_dataloader
from distkit.data._sampler import DistributedSplitSampler, distributed_sampler
from distkit.data._share import split_between_processes
from distkit.data._stream import ShardFiles, StreamLoader
from distkit.optim import linear_warmup, scale_lr

__all__ = [
    "DataLoaderProfile",
    "DistributedLoader",
    "DistributedSplitSampler",
    "ShardFiles",
    "StreamLoader",
    "distributed_dataloader",
    "distributed_sampler",
    "gather_for_metrics",
    "linear_warmup",
    "profile_dataloader",
    "scale_lr",
    "split_between_processes",
]
