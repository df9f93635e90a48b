"""Iterable and streaming data through distributed_dataloader: ShardFiles (line and tar shards) and
torch IterableDatasets, split by sample over ranks and workers, the same steps on every rank, exact
evaluation, and mid-epoch resume on the same and on other numbers of ranks (with sample ids)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

import distkit
from distkit.errors import DistkitError
from distkit.testing import Ranks

SHARDS, LINES = 5, 23  # 115 samples: not a multiple of any world size x batch used here


def _line_shards(root: Path) -> list[str]:
    paths = []
    for shard in range(SHARDS):
        path = root / f"shard-{shard}.txt"
        path.write_text("".join(f"s{shard}-{line}\n" for line in range(LINES)))
        paths.append(str(path))
    return paths


def _tar_shards(root: Path) -> list[str]:
    paths = []
    for shard in range(3):
        path = root / f"train-{shard}.tar"
        with tarfile.open(path, "w") as archive:
            for item in range(7):
                key = f"s{shard}-{item}"
                for ext, data in (("txt", key.encode()), ("cls", str(item % 3).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


class Numbers(torch.utils.data.IterableDataset[int]):
    """A torch IterableDataset of its own: the numbers 0..n-1, in order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.n))


def _loader(source: Any, workers: int = 0, **kwargs: Any) -> distkit.StreamLoader:
    options: dict[str, Any] = {"batch_size": 4, "seed": 3, "buffer_size": 16, "num_workers": workers}
    options.update(kwargs)
    if workers:
        options["multiprocessing_context"] = "forkserver"
    return distkit.distributed_dataloader(source, collate_fn=list, **options)


def epoch_batches(paths: list[str], workers: int, **kwargs: Any) -> list[list[str]]:
    return list(_loader(distkit.ShardFiles(paths), workers, **kwargs))


def test_a_stream_is_split_by_sample_the_same_steps_on_every_rank_whatever_the_workers(
    ranks: Ranks, tmp_path: Path
) -> None:
    paths = _line_shards(tmp_path)
    without = ranks.run(epoch_batches, paths, 0)
    with_workers = ranks.run(epoch_batches, paths, 2)
    assert without == with_workers  # the workers change who reads, not what a rank gets
    assert len(without[0]) == len(without[1]) == 115 // 8  # whole global steps only
    seen = [sample for rank in without for batch in rank for sample in batch]
    assert len(seen) == len(set(seen)) == 14 * 8  # no duplicate; 3 samples of the tail dropped
    one = ranks.run(epoch_batches, paths, 0, world_size=1)[0]
    # One process reads the same global stream: its batches of 4 are the ranks' slices in turn.
    interleaved = [batch for pair in zip(without[0], without[1], strict=True) for batch in pair]
    assert one[: len(interleaved)] == interleaved


def test_the_order_is_seeded_and_changes_every_epoch(ranks: Ranks, tmp_path: Path) -> None:
    paths = _line_shards(tmp_path)
    loader = _loader(distkit.ShardFiles(paths))
    first, second = list(loader), list(loader)
    assert first != second and sorted(map(tuple, first)) != sorted(map(tuple, second))
    again = _loader(distkit.ShardFiles(paths))
    assert list(again) == first
    plain = _loader(distkit.ShardFiles(paths), shuffle=False)
    assert [s for b in plain for s in b] == [f"s{i}-{j}" for i in range(SHARDS) for j in range(LINES)][:112]


def evaluation_samples(paths: list[str], workers: int, shuffle: bool = False) -> list[str]:
    loader = _loader(distkit.ShardFiles(paths), workers, evaluation=True, shuffle=shuffle)
    return [sample for batch in loader for sample in batch]


@pytest.mark.parametrize("world_size", [2, 3])
def test_evaluation_on_a_stream_sees_every_sample_once(ranks: Ranks, tmp_path: Path, world_size: int) -> None:
    paths = _line_shards(tmp_path)
    seen = [s for rank in ranks.run(evaluation_samples, paths, 0, world_size=world_size) for s in rank]
    assert sorted(seen) == sorted(f"s{i}-{j}" for i in range(SHARDS) for j in range(LINES))


def evaluation_batches_of_one(n: int) -> list[list[int]]:
    loader = _loader(Numbers(n), evaluation=True, shuffle=False, batch_size=1)
    return [list(batch) for batch in loader]


@pytest.mark.parametrize("n", [23, 24, 5])
def test_evaluation_batches_of_one_come_in_as_many_batches_on_every_rank(ranks: Ranks, n: int) -> None:
    # Was: 11 and 12 batches for 23 samples, so a gather on each batch waited alone on one rank.
    batches = ranks.run(evaluation_batches_of_one, n, world_size=2)
    assert len(batches[0]) == len(batches[1]) == n // 2
    assert sorted(s for rank in batches for batch in rank for s in batch) == list(range(n))


def stop_after(paths: list[str], workers: int, steps: int) -> tuple[list[list[str]], dict[str, Any]]:
    loader = _loader(distkit.ShardFiles(paths), workers)
    taken = []
    for batch in loader:
        taken.append(batch)
        if len(taken) == steps:
            break
    return taken, loader.state_dict()


def go_on(paths: list[str], workers: int, state: dict[str, Any]) -> list[list[str]]:
    loader = _loader(distkit.ShardFiles(paths), workers)
    loader.load_state_dict(state)
    return list(loader)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 1), (1, 2), (2, 3)])
def test_a_mid_epoch_resume_on_any_number_of_ranks_repeats_and_skips_nothing(
    ranks: Ranks, tmp_path: Path, workers: int, before: int, after: int
) -> None:
    paths = _line_shards(tmp_path)
    # The epoch's global stream (shuffled), as one process sees it with the tail kept.
    stream = ranks.run(evaluation_samples, paths, 0, True, world_size=1)[0]
    first = ranks.run(stop_after, paths, workers, 5, world_size=before)
    state = first[0][1]
    assert all(state == rank[1] for rank in first)  # the same position on every rank
    assert state["position"] == 5 * before * 4
    rest = ranks.run(go_on, paths, workers, state, world_size=after)
    done = [s for rank in first for batch in rank[0] for s in batch]
    then = [s for rank in rest for batch in rank for s in batch]
    assert len(set(done + then)) == len(done + then)  # nothing repeated
    # Nothing skipped: together they are the stream's first samples, up to the new tail.
    consumed = state["position"] + (115 - state["position"]) // (after * 4) * (after * 4)
    assert sorted(done + then) == sorted(stream[:consumed])
    if before == after:  # the same world size: the very batches of the uninterrupted run
        whole = ranks.run(epoch_batches, paths, workers, world_size=after)
        assert [rank[0] + later for rank, later in zip(first, rest, strict=True)] == whole


def test_tar_shards_give_webdataset_samples(ranks: Ranks, tmp_path: Path) -> None:
    paths = _tar_shards(tmp_path)
    loader = distkit.distributed_dataloader(distkit.ShardFiles(paths), 3, shuffle=False, collate_fn=list)
    samples = [s for batch in loader for s in batch]
    assert len(samples) == 21
    assert samples[0] == {"__key__": "s0-0", "__shard__": paths[0], "txt": b"s0-0", "cls": b"0"}
    assert [s["__key__"] for s in samples] == [f"s{i}-{j}" for i in range(3) for j in range(7)]


def numbers(n: int, workers: int) -> list[list[int]]:
    loader = distkit.distributed_dataloader(Numbers(n), 4, seed=1, buffer_size=8, num_workers=workers)
    return [batch.tolist() for batch in loader]


def test_a_torch_iterable_dataset_is_split_and_collated(ranks: Ranks) -> None:
    out = ranks.run(numbers, 50, 0)
    assert out == ranks.run(numbers, 50, 2)
    flat = [x for rank in out for batch in rank for x in batch]
    assert len(out[0]) == len(out[1]) == 6 and len(set(flat)) == 48 and set(flat) <= set(range(50))


def test_a_position_saved_with_another_seed_is_refused(tmp_path: Path) -> None:
    paths = _line_shards(tmp_path)
    state = _loader(distkit.ShardFiles(paths)).state_dict()
    other = _loader(distkit.ShardFiles(paths), seed=4)
    with pytest.raises(DistkitError, match="seed=3"):
        other.load_state_dict(state)


def test_a_list_of_paths_stays_a_map_style_dataset_and_shard_files_needs_paths(tmp_path: Path) -> None:
    paths = _line_shards(tmp_path)
    loader = distkit.distributed_dataloader(paths, 2, shuffle=False, collate_fn=list)
    assert isinstance(loader, distkit.DistributedLoader) and next(iter(loader)) == paths[:2]
    with pytest.raises(ValueError, match="non-empty list"):
        distkit.ShardFiles(paths[0])


def _rows(n: int) -> Any:
    for i in range(n):
        yield {"id": i, "text": f"row {i}"}


def hugging_face_stream(n: int, workers: int, evaluation: bool) -> list[int]:
    import datasets

    dataset = datasets.IterableDataset.from_generator(_rows, gen_kwargs={"n": n})
    loader = distkit.distributed_dataloader(
        dataset, 4, seed=2, buffer_size=8, num_workers=workers, evaluation=evaluation
    )
    return [int(i) for batch in loader for i in batch["id"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streaming_hugging_face_dataset_is_read_whole_by_every_worker_and_split(
    ranks: Ranks, workers: int
) -> None:
    train = ranks.run(hugging_face_stream, 30, workers, False)
    assert len(train[0]) == len(train[1]) == 12  # 3 whole steps of 2 x 4; the tail of 6 dropped
    assert len(set(train[0] + train[1])) == 24
    assert train == ranks.run(hugging_face_stream, 30, 0, False)  # workers change nothing
    evaluation = ranks.run(hugging_face_stream, 30, workers, True)
    assert sorted(evaluation[0] + evaluation[1]) == list(range(30))


def gathered_ids(n: int) -> tuple[int, list[int]]:
    import datasets

    dataset = datasets.IterableDataset.from_generator(_rows, gen_kwargs={"n": n})
    loader = distkit.distributed_dataloader(dataset, 4, evaluation=True)
    seen: list[int] = []
    batches = 0
    for batch in loader:
        batches += 1
        seen.extend(distkit.gather_for_metrics(torch.as_tensor(batch["id"])).tolist())
    return batches, seen


def test_gather_for_metrics_over_an_iterable_dataset_gives_every_item_once(ranks: Ranks) -> None:
    # Ported from Accelerate's test of gather_for_metrics on an IterableDataset (30 items -> 30):
    # every rank gathers each batch, and none waits for a batch another rank lacks.
    for n in (30, 29, 9):
        out = ranks.run(gathered_ids, n)
        assert out[0][0] == out[1][0]  # as many batches on every rank
        assert sorted(out[0][1]) == list(range(n)) and out[0][1] == out[1][1]


def test_shard_files_read_fsspec_urls(tmp_path: Path) -> None:
    import fsspec

    local = _line_shards(tmp_path)
    fs = fsspec.filesystem("memory")
    urls = []
    for i, path in enumerate(local[:2]):
        url = f"memory://stream-test/shard-{i}.txt"
        fs.pipe(url, Path(path).read_bytes())
        urls.append(url)
    tar = _tar_shards(tmp_path)[0]
    fs.pipe("memory://stream-test/train-0.tar", Path(tar).read_bytes())
    urls.append("memory://stream-test/train-0.tar")
    try:
        samples = list(distkit.ShardFiles(urls))
    finally:
        fs.rm("memory://stream-test", recursive=True)
    assert (
        samples[:LINES] == [f"s0-{j}" for j in range(LINES)] and samples[2 * LINES - 1] == f"s1-{LINES - 1}"
    )
    assert [s["__key__"] for s in samples[2 * LINES :]] == [f"s0-{j}" for j in range(7)]
