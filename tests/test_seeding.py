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

# DataLoader workers start from the rank's own forkserver, which distkit.testing preloads with torch
# (milliseconds a worker once it runs). Not "fork": a worker forked from a rank can hang for good
# when one of the rank's gloo threads takes an interpreter lock at that moment (docs/testing.md).
WORKER_START_METHOD = "forkserver"


@pytest.fixture
def isolated_rng() -> Iterator[None]:
    """Put back this process's RNG states, deterministic flags and default loader seed."""
    rng = distkit.capture_rng_state()
    loader_seed, per_rank = seeding._loader_seed, seeding._per_rank
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    environ = dict(os.environ)
    yield
    distkit.restore_rng_state(rng)
    seeding._loader_seed, seeding._per_rank = loader_seed, per_rank
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
        multiprocessing_context=WORKER_START_METHOD,
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


# --- per-rank randomness: seed_everything(seed, per_rank=True) ---------------------------------


def _hand_seeded_draws(seed: int) -> tuple[float, float, float]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return _draws()


def test_per_rank_seed_follows_the_documented_derivation_and_keeps_the_loader_seed(
    isolated_rng,
) -> None:
    # A world of one is rank 0: its generators get derive_seed(seed, 5, 0) % 2**32, not the seed.
    applied = distkit.seed_everything(7, per_rank=True)
    assert applied == derive_seed(7, 5, 0) % 2**32 != 7
    draws = _draws()
    assert draws == _hand_seeded_draws(applied)
    assert draws != _hand_seeded_draws(7)
    assert _order() == _order(seed=7)  # loaders default to the common seed, never the rank's
    assert seeding._per_rank == (7, 0)
    assert distkit.seed_everything(7) == 7 and seeding._per_rank is None
    with pytest.raises(ValueError, match=r"seed must be in \[0, 4294967295\], got -3"):
        distkit.seed_everything(-3, per_rank=True)


class Augmented(torch.utils.data.Dataset):
    """Samples with a random 'augmentation' from each library: data streams made visible."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), *_draws()], dtype=torch.float64)


def per_rank_run(seed: int, per_rank: bool) -> dict[str, object]:
    """One rank's training-step draws and data, after seed_everything(seed, per_rank=per_rank)."""
    try:
        applied = distkit.seed_everything(seed, per_rank=per_rank)
        dropout = torch.nn.functional.dropout(torch.ones(256), p=0.5)
        library_draws = _draws()
        # The samplers and loaders made next take their default seed from seed_everything: it
        # must be the common seed on every rank (they also check, collectively, that it is).
        indices = list(distkit.distributed_sampler(list(range(30))))
        in_process = [b.clone() for b in distkit.distributed_dataloader(Augmented(), 3)]
        in_workers = [
            b.clone()
            for b in distkit.distributed_dataloader(
                Augmented(), 3, num_workers=2, multiprocessing_context=WORKER_START_METHOD
            )
        ]
        # A DataLoader of the user's own with distkit.seed_worker: each rank's workers their own.
        own = torch.utils.data.DataLoader(
            Augmented(),
            batch_size=3,
            num_workers=2,
            worker_init_fn=distkit.seed_worker,
            generator=torch.Generator().manual_seed(seed),
            multiprocessing_context=WORKER_START_METHOD,
        )
        own_draws = torch.cat(list(own))[:, 1:]
        return {
            "applied": applied,
            "rank": distkit.get_rank(),
            "dropout": dropout,
            "draws": library_draws,
            "indices": indices,
            "in_process": in_process,
            "in_workers": in_workers,
            "own_workers": own_draws,
            "loader_seed": seeding._default_loader_seed(),
        }
    finally:
        # Pooled ranks serve other tests: leave no default loader seed or per-rank record behind.
        seeding._loader_seed, seeding._per_rank = None, None


def _batches_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_per_rank_gives_ranks_different_dropout_and_the_same_data_order_as_a_common_seed(
    ranks,
) -> None:
    own = ranks.run(per_rank_run, 31, True, world_size=2)
    common = ranks.run(per_rank_run, 31, False, world_size=2)
    # Training-step randomness: one stream per rank with per_rank, one for all without.
    assert not torch.equal(own[0]["dropout"], own[1]["dropout"])
    assert own[0]["draws"] != own[1]["draws"]
    assert torch.equal(common[0]["dropout"], common[1]["dropout"])
    assert common[0]["draws"] == common[1]["draws"]
    for rank in (0, 1):
        # Rank r's generators were seeded with the documented derive_seed(seed, 5, r) % 2**32.
        assert own[rank]["applied"] == derive_seed(31, 5, rank) % 2**32
        assert common[rank]["applied"] == 31
        torch.manual_seed(own[rank]["applied"])
        assert torch.equal(torch.nn.functional.dropout(torch.ones(256), p=0.5), own[rank]["dropout"])
        # Data: the common seed's order, batches and augmentations, with or without workers.
        assert own[rank]["loader_seed"] == common[rank]["loader_seed"] == 31
        assert own[rank]["indices"] == common[rank]["indices"]
        assert _batches_equal(own[rank]["in_process"], common[rank]["in_process"])
        assert _batches_equal(own[rank]["in_workers"], common[rank]["in_workers"])
        # seed_worker on a loader seeded by the user: its own streams per rank, per_rank or not.
        assert torch.equal(own[rank]["own_workers"], common[rank]["own_workers"])
    # The ranks' shares are different samples, and their DataLoader workers draw different values.
    assert set(own[0]["indices"]).isdisjoint(own[1]["indices"])
    assert not torch.equal(own[0]["own_workers"], own[1]["own_workers"])
    # A rerun with the same seed gives the same per-rank streams; another seed, others.
    again = ranks.run(per_rank_run, 31, True, world_size=2)
    for rank in (0, 1):
        assert torch.equal(again[rank]["dropout"], own[rank]["dropout"])
        assert again[rank]["draws"] == own[rank]["draws"]
    other = ranks.run(per_rank_run, 32, True, world_size=2)
    assert not torch.equal(other[0]["dropout"], own[0]["dropout"])


def per_rank_resume(path: str) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Save every rank's per-rank streams in a ResumeState, scramble them, load: the same draws."""
    from distkit.checkpoint import ResumeState

    try:
        distkit.seed_everything(17, per_rank=True)
        _draws()  # somewhere mid-run
        state = ResumeState(epoch=1, global_step=5).state_dict()  # collective: every rank's RNG
        if distkit.is_main_process():
            torch.save(state, path)
        distkit.barrier()
        expected = _draws()
        distkit.seed_everything(99)  # the restarted job seeds again before it resumes
        restored = ResumeState()
        restored.load_state_dict(torch.load(path, weights_only=True))
        assert (restored.epoch, restored.global_step) == (1, 5)
        return expected, _draws()
    finally:
        seeding._loader_seed, seeding._per_rank = None, None


def test_per_rank_streams_round_trip_through_a_resume_state_checkpoint(ranks, tmp_path: Path) -> None:
    results = ranks.run(per_rank_resume, str(tmp_path / "resume.pt"), world_size=2)
    for expected, resumed in results:
        assert resumed == expected
    assert results[0][0] != results[1][0]  # each rank got back its own stream, not rank 0's


def restored_process_draws(state: dict[str, object]) -> tuple[tuple[float, float, float], int]:
    """What a process started by fit() draws first, given the launching process's seeding."""
    try:
        random.seed()  # a fresh interpreter's generators
        np.random.seed()
        torch.seed()
        seeding._loader_seed = seeding._per_rank = None
        seeding._restore_process_seeding(state)
        return _draws(), seeding._default_loader_seed()
    finally:
        seeding._loader_seed, seeding._per_rank = None, None


def seeded_draws(seed: int) -> tuple[tuple[float, float, float], int]:
    """What a torchrun rank draws first after seed_everything(seed, per_rank=True)."""
    try:
        distkit.seed_everything(seed, per_rank=True)
        return _draws(), seeding._default_loader_seed()
    finally:
        seeding._loader_seed, seeding._per_rank = None, None


def test_self_launched_ranks_get_the_per_rank_streams_torchrun_ranks_get(isolated_rng, ranks) -> None:
    # fit() outside a launcher pickles this process's seeding to the ranks it starts. This process
    # is rank 0 of nothing: without care every rank would carry on rank 0's stream.
    distkit.seed_everything(13, per_rank=True)
    state = pickle.loads(pickle.dumps(seeding._capture_process_seeding()))
    launched = ranks.run(restored_process_draws, state, world_size=2)
    torchrun = ranks.run(seeded_draws, 13, world_size=2)
    assert launched == torchrun
    assert launched[0][0] != launched[1][0] and launched[0][1] == launched[1][1] == 13
    # Draws between seeding and fit: rank 0 continues this process's stream exactly, and rank 1
    # starts its own from its per-rank seed (those draws cannot be replayed on another stream).
    _draws()
    state = pickle.loads(pickle.dumps(seeding._capture_process_seeding()))
    expected_rank0 = _draws()
    launched = ranks.run(restored_process_draws, state, world_size=2)
    assert launched[0][0] == expected_rank0
    assert launched[1] == torchrun[1]
