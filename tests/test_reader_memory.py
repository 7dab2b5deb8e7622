"""The readers' HDF5 metadata cache (bert.data.format.METADATA_CACHE_BYTES) and bench/reader_memory.py.

HDF5's own cache per open file starts at 2 MiB and grows to 32 MiB; a reader holding thousands of shards open and
reading a row here and there grew by 1.3 GB over 400 shards (the bench). Every shard a reader opens gets a fixed
cache instead, and reads the same rows."""

from __future__ import annotations

import json
import sys

import h5py
import numpy as np
from script_modules import ROOT, load_script

import bert.data.format as fmt
from bert.data.format import FixedShard, VarlenShard, write_fixed_shard, write_varlength_shard

sys.path.insert(0, str(ROOT / "data"))  # the script's sibling modules (md5_list)
shards = load_script("data/make_random_shards.py")


def cache_of(f: h5py.File) -> tuple[int, int, int, int]:
    c = f.id.get_mdc_config()
    return c.initial_size, c.min_size, c.max_size, c.incr_mode


def test_every_shard_opens_with_a_fixed_metadata_cache_and_reads_the_same_rows(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    samples = shards.random_samples(shards.length_mix(5).sample(300, rng), rng)
    write_varlength_shard(tmp_path / "v.hdf5", samples)
    write_fixed_shard(tmp_path / "f.hdf5", samples, max_seq_length=512, max_predictions=80)
    size = fmt.METADATA_CACHE_BYTES
    assert size == 64 * 1024
    rows = np.array([5, 17, 299, 0])
    with VarlenShard(tmp_path / "v.hdf5") as v, FixedShard(tmp_path / "f.hdf5") as f:
        assert cache_of(v._file) == cache_of(f._file) == (size, size, size, 0)
        fixed = v.read(rows)
    monkeypatch.setattr(fmt, "METADATA_CACHE_BYTES", None)  # HDF5's default: adaptive, from 2 MiB
    with VarlenShard(tmp_path / "v.hdf5") as v:
        initial, _, most, incr = cache_of(v._file)
        assert (initial, most) == (2 * 2**20, 32 * 2**20) and incr != 0
        default = v.read(rows)
    assert all(np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.masked_labels, b.masked_labels)
               for a, b in zip(fixed, default, strict=True))


def test_the_bench_reports_each_variant_from_a_process_of_its_own(tmp_path, capsys):
    bench = load_script("bench/reader_memory.py")
    out = tmp_path / "reader_memory.json"
    assert bench.main(["--shards", "6", "--samples-per-shard", "50", "--reads", "60", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["cache_bytes"], r["shards"]) for r in rows] == [("hdf5-default", None, 6),
                                                                            ("fixed-64k", 65536, 6)]
    assert all(r["rss_open_mib"] >= r["rss_start_mib"] > 0 and r["in_order_samples"] == 50 for r in rows)
    assert "fixed-64k" in capsys.readouterr().out
