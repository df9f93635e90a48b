"""Seeding: seed_everything, the documented stream formula, worker seeding, RNG capture/restore."""

from __future__ import annotations

import os
import pickle
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import distkit
from distkit import seeding
from distkit.seeding import derive_seed

# DataLoader workers forked from the rank (test ranks come from a forkserver, whose children would
# otherwise start workers through a forkserver too: seconds per worker).
FORK = "fork"


@pytest.fixture
def isolated_rng() -> Iterator[None]:
    """Put back this process's RNG states, deterministic flags and default loader seed."""
    rng = distkit.capture_rng_state()
    loader_seed = seeding._loader_seed
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    environ = dict(os.environ)
    yield
    distkit.restore_rng_state(rng)
    seeding._loader_seed = loader_seed
    torch.use_deterministic_algorithms(flags[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[1], flags[2]
    os.environ.clear()
    os.environ.update(environ)


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(()).item()


def test_seed_everything_seeds_python_numpy_and_torch_as_seeding_each_by_hand(isolated_rng) -> None:
    assert distkit.seed_everything(1234) == 1234
    seeded = _draws()
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    assert _draws() == seeded
    distkit.seed_everything(1235)
    assert _draws() != seeded


def test_seed_everything_writes_no_environment_variable_by_default(isolated_rng) -> None:
    before = dict(os.environ)
    distkit.seed_everything(3)
    distkit.seed_everything(4, workers=False)
    assert dict(os.environ) == before


def test_deterministic_mode_sets_torch_cudnn_and_cublas_settings(isolated_rng) -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    distkit.seed_everything(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"  # a user's own choice is kept
    distkit.seed_everything(0, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize(
    ("seed", "error", "message"),
    [
        (-1, ValueError, r"seed must be in \[0, 4294967295\], got -1"),
        (2**32, ValueError, r"seed must be in \[0, 4294967295\], got 4294967296"),
        (1.5, TypeError, "seed must be an int, got float 1.5"),
        (True, TypeError, "seed must be an int, got bool True"),
        ("7", TypeError, "seed must be an int, got str '7'"),
    ],
)
def test_bad_seeds_are_rejected_saying_what_to_pass(
    isolated_rng, seed: object, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        distkit.seed_everything(seed)  # type: ignore[arg-type]


def _order(**kwargs: object) -> list[int]:
    loader = distkit.distributed_dataloader(list(range(16)), 16, **kwargs)
    return next(iter(loader)).tolist()


def test_workers_flag_makes_the_seed_the_default_of_distkit_loaders(isolated_rng) -> None:
    distkit.seed_everything(21)
    assert _order() == _order(seed=21)
    distkit.seed_everything(22)
    assert _order() == _order(seed=22) != _order(seed=21)
    distkit.seed_everything(23, workers=False)  # the data order stays put while the model seed varies
    assert _order() == _order(seed=0)


def test_derive_seed_follows_the_documented_formula_and_separates_streams() -> None:
    mask = 2**64 - 1

    def splitmix64(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    h = splitmix64(42)
    for key in (1, 3, 2, 5):
        h = splitmix64(h ^ key)
    assert derive_seed(42, 1, 3, 2, 5) == h
    # SplitMix64's published first output for state 0 pins the constants.
    assert derive_seed(0) == 0xE220A8397B1DCDAF
    streams = {
        derive_seed(seed, kind, rank, worker, epoch)
        for seed in range(3)
        for kind in range(3)
        for rank in range(8)
        for worker in range(8)
        for epoch in range(8)
    }
    assert len(streams) == 3 * 3 * 8 * 8 * 8
    assert all(0 <= s < 2**64 for s in streams)


class Draws(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        worker = torch.utils.data.get_worker_info().id
        return torch.tensor([float(distkit.get_rank()), float(worker), *_draws()], dtype=torch.float64)


def user_loader_draws(use_seed_worker: bool) -> torch.Tensor:
    distkit.seed_everything(9)  # the same on every rank, as it should be
    loader = torch.utils.data.DataLoader(
        Draws(),
        batch_size=2,
        num_workers=2,
        worker_init_fn=distkit.seed_worker if use_seed_worker else None,
        multiprocessing_context=FORK,
    )
    return torch.cat([batch for _ in range(2) for batch in loader])


def test_seed_worker_gives_each_rank_worker_and_epoch_its_own_stream(ranks) -> None:
    seeded = torch.cat(ranks.run(user_loader_draws, True, world_size=2))
    assert set(seeded[:, 0].tolist()) == {0.0, 1.0} and set(seeded[:, 1].tolist()) == {0.0, 1.0}
    for column in (2, 3, 4):  # python, numpy, torch
        assert seeded[:, column].unique().numel() == seeded.shape[0]
    # The bug it fixes: torch's own worker seeding repeats every augmentation on every rank.
    plain = ranks.run(user_loader_draws, False, world_size=2)
    assert torch.equal(plain[0][:, 2:], plain[1][:, 2:])
    # Reproducible: the same seed gives the same streams again.
    assert torch.equal(torch.cat(ranks.run(user_loader_draws, True, world_size=2)), seeded)


def test_rng_state_round_trips_through_a_weights_only_checkpoint(isolated_rng, tmp_path: Path) -> None:
    distkit.seed_everything(5)
    torch.save(distkit.capture_rng_state(), tmp_path / "rng.pt")
    expected = _draws()
    distkit.seed_everything(6)
    distkit.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == expected


def test_process_seeding_carries_generators_loader_seed_and_determinism_to_a_fresh_process(
    isolated_rng,
) -> None:
    # What fit() sends to the processes it spawns: they must start where a torchrun rank that ran
    # the same script would, not from fresh generators and loader seed 0.
    distkit.seed_everything(11, deterministic=True)
    _draws()  # the script draws (model init...) before fit
    state = pickle.loads(pickle.dumps(seeding._capture_process_seeding()))
    expected = _draws()
    # A fresh interpreter: random generators, no default loader seed, default settings.
    random.seed()
    np.random.seed()
    torch.seed()
    seeding._loader_seed = None
    torch.use_deterministic_algorithms(False)
    seeding._restore_process_seeding(state)
    assert _draws() == expected
    assert seeding._default_loader_seed() == 11
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


class GaussianNoise(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 9

    def __getitem__(self, i: int) -> torch.Tensor:
        # One Gaussian per sample, 3 per batch: numpy ends each batch with one cached.
        return torch.tensor(np.random.normal()) + random.gauss(0, 1) + torch.randn(())


def _same_numpy_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


@pytest.mark.parametrize("cached_gaussian", [False, True])
def test_loading_in_the_training_process_leaves_its_rng_states_exactly(
    isolated_rng, cached_gaussian: bool
) -> None:
    loader = distkit.distributed_dataloader(GaussianNoise(), 3, seed=0)
    np.random.seed(1)
    first = [batch for batch in loader]
    for _ in range(3):  # the second pass onwards may reuse the saved numpy state
        np.random.normal(size=1 if cached_gaussian else 2)  # an odd count leaves a Gaussian cached
        random.gauss(0, 1)
        before = (np.random.get_state(), random.getstate(), torch.get_rng_state())
        batches = [batch for batch in loader]
        assert _same_numpy_state(np.random.get_state(), before[0])
        assert random.getstate() == before[1] and torch.equal(torch.get_rng_state(), before[2])
        assert not any(torch.equal(a, b) for a, b in zip(first, batches, strict=True))  # new epochs
    loader.set_epoch(0)
    assert all(torch.equal(a, b) for a, b in zip(first, loader, strict=True))
