"""Zero-copy as the address says, over the Ray Data pipelines users write.

For each pipeline, every tensor ``from_ray_data`` delivers is looked up by
its data pointer (DLPack) in this process's mappings of Ray's object store
(``/proc/self/maps``), independently of tfray; ``stats()`` must report the
same bytes as zero-copy, and the pipelines whose batches lie within one
Arrow chunk of a block must be zero-copy throughout. Ray Data's own
``to_numpy`` concatenates a block's chunks, a copy in the trainer that no
count of tfray's own copies sees.
"""

import threading

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import ray
import ray.data
from support.dlpack_util import assert_stats_match_addresses

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]

ROWS, WIDTH = 2048, 256  # float32 rows of 1 KB: 2 MB, blocks well over Ray's inline limit.
BATCH = 128


def rows(n=ROWS):
    return {"x": np.arange(n * WIDTH, dtype=np.float32).reshape(n, WIDTH), "y": np.arange(n, dtype=np.int64)}


def ranged(blocks=4):
    """``x`` (a fixed-shape tensor column) and ``y`` from ``range`` in ``blocks`` blocks."""

    def to_rows(batch):
        ids = np.asarray(batch["id"])
        return {"x": np.repeat(ids[:, None].astype(np.float32), WIDTH, axis=1), "y": ids.astype(np.int64)}

    return ray.data.range(ROWS, override_num_blocks=blocks).map_batches(to_rows, batch_size=None)


def map_batches(batch_format, batch_size):
    def double(batch):
        if batch_format == "pandas":
            return batch.assign(y=batch["y"] * 2)
        if batch_format == "pyarrow":
            return batch.set_column(batch.schema.get_field_index("y"), "y", pc.multiply(batch["y"], 2))
        return {**batch, "y": batch["y"] * 2}

    return ranged().map_batches(double, batch_format=batch_format, batch_size=batch_size)


def parquet(tmp_path):
    """Two files of four row groups each; scalar columns (Parquet's own types)."""
    n = ROWS * 32
    table = pa.table({"x": np.arange(n, dtype=np.float64), "y": np.arange(n, dtype=np.int64)})
    for i in range(2):
        pq.write_table(table.slice(i * n // 2, n // 2), tmp_path / f"part{i}.parquet", row_group_size=n // 8)
    return ray.data.read_parquet(str(tmp_path))


def numpy_files(tmp_path):
    for i in range(2):
        np.save(tmp_path / f"part{i}.npy", rows(ROWS // 2)["x"])
    return ray.data.read_numpy(str(tmp_path)).rename_columns({"data": "x"}).map(
        lambda row: {**row, "y": np.int64(row["x"][0])}
    )


def images(tmp_path):
    from PIL import Image

    for i in range(32):  # 48 KB each once decoded: blocks over Ray's inline limit.
        Image.fromarray(np.full((128, 128, 3), i, np.uint8)).save(tmp_path / f"{i:03d}.png")
    return ray.data.read_images(str(tmp_path), mode="RGB", override_num_blocks=2).rename_columns({"image": "x"}).map(
        lambda row: {**row, "y": np.int64(row["x"][0, 0, 0])}
    )


# name: (make the dataset, batch size, whether every batch lies within one chunk)
PIPELINES = {
    "range+map_batches(pyarrow, 512)": (lambda _: map_batches("pyarrow", 512), BATCH, True),
    "range+map_batches(numpy, 128)": (lambda _: map_batches("numpy", 128), BATCH, True),
    "range+map_batches(numpy, 100)": (lambda _: map_batches("numpy", 100), BATCH, False),
    "range+map_batches(pandas, 256)": (lambda _: map_batches("pandas", 256), BATCH, True),
    "materialize": (lambda _: map_batches("numpy", 128).materialize(), BATCH, True),
    "from_numpy": (lambda _: ray.data.from_numpy(rows()["x"]).rename_columns({"data": "x"}).add_column(
        "y", lambda df: pd.Series(np.arange(len(df)), dtype=np.int64)), BATCH, True),
    # Blocks of ~10 rows: every batch gathers rows from several blocks.
    "from_items": (lambda _: ray.data.from_items(
        [{"x": r, "y": np.int64(i)} for i, r in enumerate(rows()["x"])]), BATCH, False),
    "from_pandas": (lambda _: ray.data.from_pandas(
        pd.DataFrame({"x": list(rows()["x"]), "y": rows()["y"]})), BATCH, True),
    "read_parquet": (parquet, 1024, True),
    "read_numpy": (numpy_files, BATCH, True),
    "read_images": (images, 16, True),
    "map": (lambda _: ranged().map(lambda r: {**r, "y": r["y"] + 1}), BATCH, True),
    "random_shuffle": (lambda _: ranged().random_shuffle(seed=0), BATCH, True),
    "repartition": (lambda _: ranged().repartition(3), BATCH, False),
    "union": (lambda _: ranged(2).union(ranged(2)), BATCH, True),
    "limit": (lambda _: ranged().limit(ROWS - 300), BATCH, True),
    "batch_size=None": (lambda _: map_batches("numpy", 128), None, False),
}


def read(ds):
    """Every element of one epoch, held (so no buffer is freed and reused meanwhile)."""
    return list(ds)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_stats_equal_the_address_check(name, tmp_path):
    make, batch_size, within_chunks = PIPELINES[name]
    data = make(tmp_path)
    ds = tfray.Dataset.from_ray_data(data, batch_size=batch_size, feature_columns="x", label_columns="y")
    elements = read(ds)
    assert elements, "the pipeline delivered nothing"
    stats = ds.stats()[-1]
    total, in_store = assert_stats_match_addresses(stats, elements, name)
    if within_chunks:
        assert in_store == total, f"{name}: {total - in_store} of {total} bytes were copied"
        assert stats.bytes_copied_by_tfray == stats.bytes_copied_upstream == 0
    else:
        # Batches across chunks: tfray gathers them, in one copy it counts.
        assert 0 < stats.bytes_copied == stats.bytes_copied_by_tfray
        assert stats.bytes_copied_upstream == 0


def test_streaming_split_as_ray_train_hands_it_out():
    """Ray Train's shards (DataIterators) read through Ray Data's iter_batches: copies, said so."""
    shards = ranged().streaming_split(2, equal=True)
    results = [None, None]

    def consume(i):
        ds = tfray.Dataset.from_ray_data(shards[i], batch_size=BATCH, feature_columns="x", label_columns="y")
        elements = read(ds)
        results[i] = (assert_stats_match_addresses(ds.stats()[-1], elements, f"shard {i}"), ds.stats()[-1])

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results), "a shard's reader did not finish"
    for (total, in_store), stats in results:
        # Ray Data's iter_batches makes the batches; what it copies is upstream's.
        assert stats.bytes_copied == stats.bytes_copied_upstream == total - in_store
