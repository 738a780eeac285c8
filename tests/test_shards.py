"""data/shards.py: tar shards in WebDataset's layout with a byte-offset index; random access; hostile indexes."""

import pickle
import random
import tarfile

import numpy as np
import pytest

from speedrun.data.shards import Shards, shard_name, write_split


def _samples(n=50, seed=0):
    rng = random.Random(seed)
    return [(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3000))), rng.randint(0, 9)) for _ in range(n)]


def test_every_sample_reads_back_in_any_order_and_tar_sees_the_same(tmp_path):
    samples = _samples()
    index = write_split(iter(samples), tmp_path, "train", shard_bytes=20_000)
    assert index.shape == (50, 4) and len(set(index[:, 0].tolist())) >= 3  # several shards
    order = list(range(len(samples)))
    random.Random(1).shuffle(order)
    with Shards(tmp_path, "train") as shards:
        assert len(shards) == 50
        for i in order:
            assert shards.read(i) == samples[i][0] and shards.label(i) == samples[i][1]
    seen = []  # the plain tar view (what webdataset.WebDataset reads): KEY.jpg then KEY.cls, in order
    for number in sorted(set(index[:, 0].tolist())):
        with tarfile.open(tmp_path / shard_name("train", number)) as tar:
            members = tar.getmembers()
            for jpg, cls in zip(members[::2], members[1::2]):
                assert jpg.name.endswith(".jpg") and cls.name == jpg.name[:-4] + ".cls"
                seen.append((tar.extractfile(jpg).read(), int(tar.extractfile(cls).read())))
    assert seen == samples
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_a_failure_while_writing_leaves_nothing(tmp_path):
    def broken():
        yield from _samples(10)
        raise RuntimeError("source went away")

    with pytest.raises(RuntimeError):
        write_split(broken(), tmp_path, "train", shard_bytes=5_000)
    assert list(tmp_path.iterdir()) == []


def test_hostile_or_damaged_indexes_are_one_error(tmp_path):
    write_split(iter(_samples(20)), tmp_path, "val", shard_bytes=10**9)
    index_path = tmp_path / "val-index.npy"
    good = np.load(index_path)
    cases = {
        "pickled object array": lambda: index_path.write_bytes(pickle.dumps(good.astype(object))),
        "object dtype .npy": lambda: np.save(index_path, good.astype(object), allow_pickle=True),
        "wrong shape": lambda: np.save(index_path, good[:, :3]),
        "float dtype": lambda: np.save(index_path, good.astype(np.float64)),
        "offset past the end": lambda: np.save(index_path, good + np.array([0, 10**9, 0, 0])),
        "negative size": lambda: np.save(index_path, good * np.array([1, 1, -1, 1])),
        "missing shard": lambda: np.save(index_path, good + np.array([7, 0, 0, 0])),
        "empty file": lambda: index_path.write_bytes(b""),
    }
    for what, damage in cases.items():
        damage()
        with pytest.raises(ValueError, match="val-index.npy") as info:
            Shards(tmp_path, "val")
        assert "\n" not in str(info.value), what
    np.save(index_path, good)
    (tmp_path / shard_name("val", 0)).write_bytes(b"cut")  # the shard cut after the index was written
    with pytest.raises(ValueError, match="outside its shard"):
        Shards(tmp_path, "val")
