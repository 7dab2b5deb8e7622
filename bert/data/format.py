"""The on-disk shard formats: MLPerf fixed-length hdf5 and NVIDIA's varlength hdf5.

Varlength shard (what training reads; keys and dtypes exactly as NVIDIA's
`convert_fixed2variable.py`, one row per sample, no padding, no mask):

    input_ids            (N,) vlen int16   [CLS] A [SEP] B [SEP]
    segment_ids          (N,) vlen int8
    masked_lm_positions  (N,) vlen int16   positions inside the sequence, sorted
    masked_lm_ids        (N,) vlen int16   original token ids at those positions
    next_sentence_labels (N,) int8         1 = sentence B is random
    lengths              (N,) int16        OUR length index, optional on read: NVIDIA's shards lack
                                           it, and then `VarlenShard.lengths()` computes it from input_ids

Fixed-length shard (what `create_pretraining_data` writes; MLPerf keys, int32, zero padded):

    input_ids, input_mask, segment_ids   (N, max_seq_length)
    masked_lm_positions, masked_lm_ids   (N, max_predictions_per_seq)
    next_sentence_labels                 (N,)

Writers are atomic (a temporary file renamed into place), so a file with the final name is
always complete. Readers validate keys, dtypes and row counts on open and raise `ShardError`,
naming the file, for anything missing, mistyped, truncated or corrupt.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import h5py
import numpy as np

from bert.sample import Sample

VARLEN_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int16),
    "segment_ids": np.dtype(np.int8),
    "masked_lm_positions": np.dtype(np.int16),
    "masked_lm_ids": np.dtype(np.int16),
}
NSP_KEY, NSP_DTYPE = "next_sentence_labels", np.dtype(np.int8)
VARLEN_KEYS: tuple[str, ...] = (*VARLEN_DTYPES, NSP_KEY)
LENGTHS_KEY, LENGTHS_DTYPE = "lengths", np.dtype(np.int16)

FIXED_SEQ_KEYS: tuple[str, ...] = ("input_ids", "input_mask", "segment_ids")
FIXED_PRED_KEYS: tuple[str, ...] = ("masked_lm_positions", "masked_lm_ids")
FIXED_KEYS: tuple[str, ...] = (*FIXED_SEQ_KEYS, *FIXED_PRED_KEYS, NSP_KEY)
FIXED_DTYPE = np.dtype(np.int32)
MAX_SEQ_LENGTH, MAX_PREDICTIONS = 512, 76
MASK_RATE = 0.15  # create_pretraining_data's masked_lm_prob, which the MLPerf shards were made with ([Google-BERT])
FRAMING = 3  # [CLS], [SEP], [SEP]: tokens that are never masked
FIXED_BLOCK = 4096  # samples padded at a time by the fixed-length writer
VARLEN_BLOCK = 8192  # rows converted at a time from fixed to varlength: memory does not grow with the shard
RowSource = Callable[[str, int, int], Sequence[np.ndarray]]  # (vlen key, start, stop) -> rows start..stop-1


class ShardError(ValueError):
    """A shard that cannot be used; the message names the file and the problem."""


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it to `path` only if the block succeeds."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _vlen_column(rows: Sequence[np.ndarray], dtype: np.dtype, key: str) -> np.ndarray:
    column = np.empty(len(rows), dtype=h5py.vlen_dtype(dtype))  # typed, for write_direct
    if not rows:
        return column
    flat = np.concatenate([np.asarray(row).ravel() for row in rows])
    info = np.iinfo(dtype)
    if flat.size and (flat.min() < info.min or flat.max() > info.max):
        # Token ids above 32767 mean a vocab that is not the 30522-entry MLPerf one.
        raise ValueError(f"{key} has values outside {dtype} ({flat.min()}..{flat.max()})")
    for i, row in enumerate(np.split(flat.astype(dtype), np.cumsum([len(row) for row in rows])[:-1])):
        column[i] = row  # element-wise, so numpy never reads equal-length rows as one 2-d array
    return column


def write_varlength_shard(path: str | os.PathLike, samples: Iterable[Sample]) -> int:
    """Write `samples` as one varlength shard (atomically); return the number written."""
    samples = list(samples)
    columns = {
        "input_ids": [s.input_ids for s in samples],
        "segment_ids": [s.segment_ids for s in samples],
        "masked_lm_positions": [s.masked_positions for s in samples],
        "masked_lm_ids": [s.masked_labels for s in samples],
    }
    for i, s in enumerate(samples):
        if len(s.segment_ids) != len(s.input_ids) or len(s.masked_positions) != len(s.masked_labels):
            raise ValueError(f"sample {i} has mismatched field lengths")
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    nsp = np.array([int(s.nsp_label) for s in samples], dtype=NSP_DTYPE)
    whole = max(1, len(samples))  # one block: these samples are in memory already
    _write_varlength_columns(path, lambda key, start, stop: columns[key][start:stop], nsp, lengths, whole)
    return len(samples)


def _write_varlength_columns(
    path: str | os.PathLike, rows: RowSource, nsp: np.ndarray, lengths: np.ndarray, block: int
) -> None:
    """Write a varlength shard (atomically) one column at a time, `block` rows at a time. Column by column, the
    file's bytes are those of writing each column whole (the global heap fills in the same order)."""
    if len(lengths) and lengths.max() > np.iinfo(LENGTHS_DTYPE).max:
        raise ValueError(f"sequence of {lengths.max()} tokens does not fit the int16 length index")
    n = len(lengths)
    with atomic_output(path) as tmp, h5py.File(tmp, "w", track_order=False) as f:
        for key, dtype in VARLEN_DTYPES.items():
            ds = f.create_dataset(key, shape=(n,), dtype=h5py.vlen_dtype(dtype), track_times=False)
            for start in range(0, n, block):
                stop = min(start + block, n)
                # write_direct: `ds[a:b] = column` would read equal-length rows as one 2-d array
                ds.write_direct(_vlen_column(rows(key, start, stop), dtype, key), dest_sel=np.s_[start:stop])
        f.create_dataset(NSP_KEY, data=nsp.astype(NSP_DTYPE), track_times=False)
        f.create_dataset(LENGTHS_KEY, data=lengths.astype(LENGTHS_DTYPE), track_times=False)


def _padded_block(
    samples: Sequence[Sample], first: int, max_seq_length: int, max_predictions: int
) -> dict[str, np.ndarray]:
    n = len(samples)
    block = {key: np.zeros((n, max_seq_length), FIXED_DTYPE) for key in FIXED_SEQ_KEYS}
    block |= {key: np.zeros((n, max_predictions), FIXED_DTYPE) for key in FIXED_PRED_KEYS}
    block[NSP_KEY] = np.zeros(n, FIXED_DTYPE)
    for i, s in enumerate(samples):
        length, n_pred = len(s.input_ids), len(s.masked_positions)
        if length > max_seq_length or n_pred > max_predictions:
            raise ValueError(
                f"sample {first + i} ({length} tokens, {n_pred} masked) exceeds {max_seq_length}/{max_predictions}"
            )
        block["input_ids"][i, :length] = s.input_ids
        block["input_mask"][i, :length] = 1
        block["segment_ids"][i, :length] = s.segment_ids
        block["masked_lm_positions"][i, :n_pred] = s.masked_positions
        block["masked_lm_ids"][i, :n_pred] = s.masked_labels
        block[NSP_KEY][i] = s.nsp_label
    return block


def write_fixed_shard(
    path: str | os.PathLike,
    samples: Iterable[Sample],
    max_seq_length: int = MAX_SEQ_LENGTH,
    max_predictions: int = MAX_PREDICTIONS,
) -> int:
    """Write `samples` zero-padded in the MLPerf fixed-length layout (atomically); return the count."""
    samples = list(samples)
    n = len(samples)
    widths = dict.fromkeys(FIXED_SEQ_KEYS, (max_seq_length,)) | dict.fromkeys(FIXED_PRED_KEYS, (max_predictions,))
    with atomic_output(path) as tmp, h5py.File(tmp, "w") as f:
        datasets = {}
        for key in FIXED_KEYS:
            shape = (n, *widths.get(key, ()))
            # Padding compresses well; chunk by rows so a slice of samples reads few chunks.
            chunks = (min(max(n, 1), 256), *shape[1:])
            datasets[key] = f.create_dataset(
                key, shape, FIXED_DTYPE, compression="gzip", compression_opts=1, chunks=chunks, track_times=False
            )
        # Padded blocks, not one padded array: a part's worth of padding would need gigabytes.
        for first in range(0, n, FIXED_BLOCK):
            block = _padded_block(samples[first : first + FIXED_BLOCK], first, max_seq_length, max_predictions)
            for key, data in block.items():
                datasets[key][first : first + len(data)] = data
    return n


# Each open file's HDF5 metadata cache, fixed at this size. HDF5's own starts at 2 MiB and grows up to 32 MiB when
# its hit rate is low, which a reader's pattern makes it: a row or two from each of thousands of shards, each row's
# variable-length data in a global-heap collection the cache keeps. 400 shards read at random grew a reader by
# 1.3 GB, 64 KiB each by 0.11 GB, in the same CPU time (bench/reader_memory.py). None: HDF5's default. Our shards'
# collections are 64 KiB, so the cache holds about one: rows read again soon from one shard cost ~20 % more (a
# review), which at thousands of shards a rank seldom does.
METADATA_CACHE_BYTES: int | None = 64 * 1024


def _open(path: Path) -> h5py.File:
    if not path.is_file():
        raise ShardError(f"{path}: no such shard")
    try:
        f = h5py.File(path, "r")
    except OSError as e:  # truncated files and non-hdf5 files both land here
        raise ShardError(f"{path}: not a readable hdf5 file (truncated or corrupt?): {e}") from e
    if METADATA_CACHE_BYTES is not None:
        try:
            f.id.set_mdc_config(fixed_cache(f.id.get_mdc_config(), METADATA_CACHE_BYTES))
        except Exception as e:
            f.close()
            raise ShardError(f"{path}: cannot set its HDF5 metadata cache: {e}") from e
    return f


def fixed_cache(config: h5py.h5ac.CacheConfig, size: int) -> h5py.h5ac.CacheConfig:
    """`config` (a file's metadata cache) set to `size` bytes, neither growing nor shrinking."""
    config.set_initial_size = True
    config.initial_size = config.min_size = config.max_size = size
    config.incr_mode = config.flash_incr_mode = config.decr_mode = 0  # H5C_incr__off, H5C_flash_incr__off, ...
    return config


def _dataset(f: h5py.File, path: Path, key: str) -> h5py.Dataset:
    if key not in f:
        raise ShardError(f"{path}: missing key {key!r} (has {sorted(f.keys())})")
    node = f[key]
    if not isinstance(node, h5py.Dataset):
        raise ShardError(f"{path}: {key!r} is not a dataset")
    return node


def _check_rows(path: Path, datasets: dict[str, h5py.Dataset]) -> int:
    rows = {key: ds.shape[0] if ds.shape else None for key, ds in datasets.items()}
    if len(set(rows.values())) != 1 or None in rows.values():
        raise ShardError(f"{path}: datasets disagree on the number of samples: {rows}")
    return next(iter(rows.values()))


class VarlenShard:
    """A varlength shard opened read-only; rows come back as `Sample`s with int64 arrays."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = _open(self.path)
        try:
            self._ds = {key: _dataset(self._file, self.path, key) for key in VARLEN_KEYS}
            for key, dtype in VARLEN_DTYPES.items():
                base = h5py.check_vlen_dtype(self._ds[key].dtype)
                if base != dtype or self._ds[key].ndim != 1:
                    found = f"vlen {base}" if base is not None else str(self._ds[key].dtype)
                    raise ShardError(f"{self.path}: {key!r} is {found} {self._ds[key].shape}, expected vlen {dtype}")
            if self._ds[NSP_KEY].dtype != NSP_DTYPE or self._ds[NSP_KEY].ndim != 1:
                raise ShardError(f"{self.path}: {NSP_KEY!r} is {self._ds[NSP_KEY].dtype}, expected {NSP_DTYPE} (N,)")
            datasets = dict(self._ds)
            if LENGTHS_KEY in self._file:
                datasets[LENGTHS_KEY] = _dataset(self._file, self.path, LENGTHS_KEY)
                if datasets[LENGTHS_KEY].dtype != LENGTHS_DTYPE:
                    raise ShardError(f"{self.path}: {LENGTHS_KEY!r} is {datasets[LENGTHS_KEY].dtype}, expected int16")
            self._len = _check_rows(self.path, datasets)
            self._lengths_ds = datasets.get(LENGTHS_KEY)
        except BaseException:
            self._file.close()
            raise

    def __len__(self) -> int:
        return self._len

    @property
    def has_length_index(self) -> bool:
        """Whether the shard stores its `lengths` (ours do; NVIDIA's do not, and lengths() reads input_ids)."""
        return self._lengths_ds is not None

    def lengths(self) -> np.ndarray:
        """Tokens per sample (int64): from the length index, or computed from input_ids if absent."""
        with self._reading():
            if self._lengths_ds is not None:
                return self._lengths_ds[()].astype(np.int64)
            return np.fromiter((len(r) for r in self._ds["input_ids"][()]), dtype=np.int64, count=self._len)

    def __getitem__(self, i: int) -> Sample:
        if not -self._len <= i < self._len:
            raise IndexError(f"{self.path}: sample {i} out of range for {self._len} samples")
        return self.read([i % self._len])[0]

    def read(self, indices: Sequence[int] | np.ndarray) -> list[Sample]:
        """The samples at `indices`, in that order (one sorted hdf5 read per key)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size == 0:
            return []
        if indices.min() < 0 or indices.max() >= self._len:
            raise IndexError(f"{self.path}: indices outside 0..{self._len - 1}")
        # h5py fancy indexing needs increasing unique indices; read those, then map back.
        unique, inverse = np.unique(indices, return_inverse=True)
        try:
            if unique.size == 1:  # one row (the common case under balancing): h5py's scalar read costs 2/3 of a list's
                row = int(unique[0])
                cols = {key: (ds[row],) for key, ds in self._ds.items()}
            else:
                cols = {key: ds[unique] for key, ds in self._ds.items()}
        except OSError as e:  # a damaged chunk or heap is only found when it is read
            raise ShardError(f"{self.path}: {self._unreadable(unique)} unreadable (corrupt shard?): {e}") from e
        samples = []
        for j, row in zip(inverse, indices):
            sample = Sample(
                input_ids=cols["input_ids"][j].astype(np.int64),
                segment_ids=cols["segment_ids"][j].astype(np.int64),
                masked_positions=cols["masked_lm_positions"][j].astype(np.int64),
                masked_labels=cols["masked_lm_ids"][j].astype(np.int64),
                nsp_label=int(cols[NSP_KEY][j]),
            )
            if len(sample.segment_ids) != len(sample.input_ids) or len(sample.masked_positions) != len(
                sample.masked_labels
            ):
                raise ShardError(f"{self.path}: sample {row} has fields of mismatched lengths")
            samples.append(sample)
        return samples

    def __iter__(self) -> Iterator[Sample]:
        for start in range(0, self._len, 1024):
            yield from self.read(np.arange(start, min(start + 1024, self._len)))

    def _unreadable(self, rows: np.ndarray) -> str:
        """Which of `rows` cannot be read: re-read one at a time (only on the error path)."""
        for row in rows:
            try:
                for ds in self._ds.values():
                    ds[int(row)]
            except OSError:
                return f"sample {row}"
        return f"one of samples {rows.min()}..{rows.max()}"

    @contextmanager
    def _reading(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:  # a damaged chunk or heap is only found when it is read
            raise ShardError(f"{self.path}: read failed (corrupt shard?): {e}") from e

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> VarlenShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self):
        # An open hdf5 handle cannot cross a process boundary; reopen by path in the worker.
        return (type(self), (self.path,))


class FixedShard:
    """A fixed-length MLPerf shard opened read-only; rows come back unpadded as `Sample`s."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = _open(self.path)
        try:
            self._ds = {key: _dataset(self._file, self.path, key) for key in FIXED_KEYS}
            for key, ds in self._ds.items():
                ndim = 1 if key == NSP_KEY else 2
                if ds.dtype.kind not in "iu" or ds.ndim != ndim:
                    raise ShardError(
                        f"{self.path}: {key!r} is {ds.dtype} {ds.shape}, expected a {ndim}-d integer array"
                    )
            self._len = _check_rows(self.path, self._ds)
            widths = {key: self._ds[key].shape[1] for key in FIXED_SEQ_KEYS + FIXED_PRED_KEYS}
            if len({widths[k] for k in FIXED_SEQ_KEYS}) != 1 or len({widths[k] for k in FIXED_PRED_KEYS}) != 1:
                raise ShardError(f"{self.path}: padded widths disagree: {widths}")
            self.max_seq_length, self.max_predictions = widths["input_ids"], widths["masked_lm_ids"]
        except BaseException:
            self._file.close()
            raise

    def __len__(self) -> int:
        return self._len

    def column(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 of one key, padded."""
        try:
            return self._ds[key][start:stop]
        except OSError as e:
            raise ShardError(f"{self.path}: read failed (corrupt shard?): {e}") from e

    def read(self, start: int, stop: int) -> list[Sample]:
        """Samples start..stop-1, with padding removed (length from input_mask, as NVIDIA's converter)."""
        cols = {key: self.column(key, start, stop) for key in self._ds}
        lengths = cols["input_mask"].sum(axis=1)
        n_preds = _masked_counts(cols["masked_lm_positions"])
        cols = {key: col.astype(np.int64) for key, col in cols.items()}
        return [
            Sample(
                input_ids=cols["input_ids"][i, :length],
                segment_ids=cols["segment_ids"][i, :length],
                masked_positions=cols["masked_lm_positions"][i, :n_pred],
                masked_labels=cols["masked_lm_ids"][i, :n_pred],
                nsp_label=int(cols[NSP_KEY][i]),
            )
            for i, (length, n_pred) in enumerate(zip(lengths, n_preds))
        ]

    def __iter__(self) -> Iterator[Sample]:
        for start in range(0, self._len, 1024):
            yield from self.read(start, min(start + 1024, self._len))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> FixedShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _masked_counts(positions: np.ndarray) -> np.ndarray:
    # Position 0 is [CLS], which is never masked, so a zero position is padding.
    return np.count_nonzero(positions, axis=1)


class _FixedRows:
    """Unpadded rows of slices of fixed-length shards read back to back, read one key and `block` rows at a time."""

    def __init__(self, slices: Sequence[tuple[FixedShard, int, int]], block: int):
        self.slices = slices
        self.firsts = np.concatenate([[0], np.cumsum([stop - start for _, start, stop in slices])])
        tokens, masked, nsp = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for shard, start, stop in slices:
            for first in range(start, stop, block):
                last = min(first + block, stop)
                tokens.append(shard.column("input_mask", first, last).sum(axis=1))
                masked.append(_masked_counts(shard.column("masked_lm_positions", first, last)))
                nsp.append(shard.column(NSP_KEY, first, last))
        self.tokens, self.masked, self.nsp = (np.concatenate(x).astype(np.int64) for x in (tokens, masked, nsp))

    def rows(self, key: str, start: int, stop: int) -> list[np.ndarray]:
        widths = self.tokens if key in FIXED_SEQ_KEYS else self.masked
        rows = []
        for (shard, offset, _), first, last in zip(self.slices, self.firsts[:-1], self.firsts[1:]):
            lo, hi = max(start, first), min(stop, last)
            if lo < hi:
                padded = shard.column(key, offset + lo - first, offset + hi - first)
                rows.extend(row[:width] for row, width in zip(padded, widths[lo:hi]))
        return rows


def fixed_slices_to_varlength(
    dst: str | os.PathLike, slices: Sequence[tuple[str | os.PathLike, int, int | None]], block: int = VARLEN_BLOCK
) -> int:
    """Write rows start..stop-1 (None: to the end) of each fixed-length shard, back to back, as one varlength shard;
    return the number of samples. Read `block` rows of one key at a time, so memory does not grow with the shard."""
    with ExitStack() as stack:
        shards = [stack.enter_context(FixedShard(path)) for path, _, _ in slices]
        bounds = [(shard, start, len(shard) if stop is None else stop)
                  for shard, (_, start, stop) in zip(shards, slices)]
        source = _FixedRows(bounds, block)
        try:
            _write_varlength_columns(dst, source.rows, source.nsp, source.tokens, block)
        except ShardError:
            raise
        except ValueError as e:  # e.g. token ids beyond int16: data made with a vocab far larger than MLPerf's
            names = ", ".join(str(shard.path) for shard in shards)
            raise ShardError(f"{names}: cannot convert to varlength: {e}") from e
    return len(source.tokens)


def fixed_to_varlength(src: str | os.PathLike, dst: str | os.PathLike, block: int = VARLEN_BLOCK) -> int:
    """Convert one fixed-length shard to a varlength shard; return the number of samples."""
    return fixed_slices_to_varlength(dst, [(src, 0, None)], block)


def predictions_per_sequence(lengths: np.ndarray, max_predictions: int = MAX_PREDICTIONS) -> np.ndarray:
    """create_pretraining_data's masked count per sequence: min(max_predictions, max(1, round(MASK_RATE x
    length))), at most the words."""
    wanted = np.maximum(1, np.rint(np.asarray(lengths) * MASK_RATE).astype(np.int64))
    return np.minimum(np.minimum(wanted, max_predictions), np.asarray(lengths) - FRAMING)
