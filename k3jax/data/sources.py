"""Document corpora: local txt / jsonl / parquet files, and the Python standard library.

A corpus is an indexed list of documents (``len``, ``corpus[i] -> str``) read lazily from disk, so
that only the arrays of the index (a few bytes per document) stay in memory; parquet is the
exception (see `ParquetReader`). Every document has a stable name (its file's path relative to
the corpus root, plus its row), and a 64-bit hash of that name assigns it to the train or the
validation split, so the split survives adding files and never depends on the order of reading.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

from k3jax.data.config import SPLITS, TEXT_FORMATS

EXTENSIONS = {".txt": "txt", ".text": "txt", ".md": "txt", ".py": "txt",
              ".jsonl": "jsonl", ".parquet": "parquet"}
STDLIB_SKIP = ("site-packages", "dist-packages", "__pycache__")


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (vectorised, wrapping uint64): spreads (file hash + row) uniformly."""
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def in_split(file_hash: np.ndarray, row: np.ndarray, split: str, validation_fraction: float) -> np.ndarray:
    """Boolean mask of the documents ``(file, row)`` that belong to ``split``."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    with np.errstate(over="ignore"):
        h = _mix(file_hash.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * row.astype(np.uint64))
    is_validation = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53) < validation_fraction
    return is_validation if split == "validation" else ~is_validation


class TxtReader:
    """A file is one document, UTF-8. Indexing reads each file once: an empty or all-whitespace file
    holds no document (it would train on BOS/EOS alone), and undecodable bytes are an error naming
    the file and the byte, never U+FFFD fed to the model (``strict_utf8=False``: decoded with
    U+FFFD, for corpora known to hold a few legacy encodings, such as the standard library's tests)."""

    def __init__(self, files: list[Path], text_field: str, strict_utf8: bool = True):
        self.files, self.strict_utf8 = files, strict_utf8

    def rows(self, file: Path) -> np.ndarray:
        raw = file.read_bytes()
        try:
            text = raw.decode("utf-8", errors="strict" if self.strict_utf8 else "replace")
        except UnicodeDecodeError as err:
            raise ValueError(f"{file} is not UTF-8 text (undecodable byte 0x{raw[err.start]:02x} at offset "
                             f"{err.start}); convert it or leave it out of data.path") from None
        return np.zeros(1 if text.strip() else 0, np.int64)

    def read(self, file_index: int, row: int) -> str:
        return self.files[file_index].read_bytes().decode("utf-8", errors="replace")


class JsonlReader:
    """A non-blank line is one document, its string field ``text_field``; rows are byte offsets."""

    def __init__(self, files: list[Path], text_field: str, strict_utf8: bool = True):
        self.files, self.field = files, text_field

    def rows(self, file: Path) -> np.ndarray:
        data = np.frombuffer(file.read_bytes(), np.uint8)
        starts = np.concatenate([[0], np.flatnonzero(data == ord("\n")) + 1])
        ends = np.concatenate([starts[1:], [len(data)]])
        visible = np.concatenate([[0], np.cumsum(~np.isin(data, np.frombuffer(b" \t\r\n\f\v", np.uint8)))])
        blank = visible[ends] == visible[starts]
        rows = starts[~blank].astype(np.int64)
        if len(rows):
            self._parse(file, int(rows[0]))  # a wrong field name fails here, before any compute
        return rows

    def _parse(self, file: Path, offset: int) -> str:
        with file.open("rb") as f:
            f.seek(offset)
            line = f.readline()
        try:
            text = json.loads(line)[self.field]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{file} at byte {offset}: expected a JSON object with a string field "
                             f"text_field={self.field!r} ({type(err).__name__}: {err})") from err
        if not isinstance(text, str):
            raise ValueError(f"{file} at byte {offset}: field text_field={self.field!r} must be a string, "
                             f"got {type(text).__name__}")
        return text

    def read(self, file_index: int, row: int) -> str:
        return self._parse(self.files[file_index], int(row))


class ParquetReader:
    """A row is one document, string column ``text_field``. A file's column is loaded on its first
    use and kept (memory ~ the text of the files read), since shuffled row access would otherwise
    decode a whole row group per document."""

    def __init__(self, files: list[Path], text_field: str, strict_utf8: bool = True):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ValueError("format='parquet' needs the 'pyarrow' package (pip install pyarrow)") from err
        self.pq, self.files, self.field, self.columns = pq, files, text_field, {}

    def rows(self, file: Path) -> np.ndarray:
        meta = self.pq.ParquetFile(file)
        names = meta.schema_arrow.names
        if self.field not in names:
            raise ValueError(f"{file}: text_field={self.field!r} must be one of its columns {names}")
        return np.arange(meta.metadata.num_rows, dtype=np.int64)

    def read(self, file_index: int, row: int) -> str:
        if file_index not in self.columns:
            table = self.pq.read_table(self.files[file_index], columns=[self.field])
            self.columns[file_index] = table.column(self.field)
        text = self.columns[file_index][int(row)].as_py()
        return "" if text is None else str(text)


READERS = {"txt": TxtReader, "jsonl": JsonlReader, "parquet": ParquetReader}


class Corpus:
    """The documents of ``split`` in ``files`` (names relative to ``root``), in file then row order."""

    def __init__(self, files: list[Path], root: Path, fmt: str, *, text_field: str = "text",
                 split: str = "train", validation_fraction: float = 0.05, strict_utf8: bool = True):
        if not files:
            raise ValueError(f"files={files} must name at least one file")
        self.reader = READERS[fmt](files, text_field, strict_utf8)
        file_of, rows, ordinal, hashes = [], [], [], []
        for i, file in enumerate(files):
            r = self.reader.rows(file)
            file_of.append(np.full(len(r), i, np.int32))
            rows.append(r)
            # jsonl rows are byte offsets; the split hashes the line's ordinal, so editing one line's
            # text moves no document between splits
            ordinal.append(np.arange(len(r), dtype=np.int64))
            hashes.append(np.full(len(r), _name_hash(file.relative_to(root).as_posix()), np.uint64))
        file_of, rows, ordinal, hashes = (np.concatenate(a) for a in (file_of, rows, ordinal, hashes))
        if len(file_of) == 0:
            what = f"{files[0]} is" if len(files) == 1 else f"all {len(files)} files under {root} are"
            raise ValueError(f"{what} empty or whitespace only: no documents to train on")
        keep = in_split(hashes, ordinal, split, validation_fraction)
        self.files, self.file_of, self.rows = files, file_of[keep], rows[keep]
        self.num_total = len(file_of)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> str:
        return self.reader.read(int(self.file_of[index]), int(self.rows[index]))


def list_files(path: str | Path, fmt: str | None, *, suffixes: tuple[str, ...] | None = None,
               skip_dirs: tuple[str, ...] = ()) -> tuple[list[Path], Path, str]:
    """The sorted files of ``path`` (a file, or a directory searched recursively), their root, and
    their format (``fmt``, or the one extension shared by the files)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data.path={str(path)!r} does not exist")
    if fmt is not None and fmt not in TEXT_FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {TEXT_FORMATS} or None")
    if path.is_file():
        files, root = [path], path.parent
    else:
        wanted = suffixes or tuple(s for s, f in EXTENSIONS.items() if fmt is None or f == fmt)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in wanted
                       and not set(p.relative_to(path).parts[:-1]) & set(skip_dirs))
        root = path
    if not files:
        raise ValueError(f"data.path={str(path)!r} holds no files of format={fmt!r} "
                         f"(extensions {sorted(EXTENSIONS)})")
    if fmt is None:
        found = {EXTENSIONS.get(p.suffix) for p in files}
        if None in found or len(found) != 1:
            raise ValueError(f"data.path={str(path)!r}: cannot infer the format from extensions "
                             f"{sorted({p.suffix for p in files})}; set format to one of {TEXT_FORMATS}")
        fmt = found.pop()
    return files, root, fmt


def stdlib_corpus(split: str = "train", validation_fraction: float = 0.05) -> Corpus:
    """The ``*.py`` files of the running interpreter's standard library (no download; ~2k files,
    ~38 MB for CPython 3.13), one document per file, split by the hash of the relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, root, _ = list_files(root, "txt", suffixes=(".py",), skip_dirs=STDLIB_SKIP)
    # A few of its test fixtures are deliberately Latin-1 or broken UTF-8: kept, decoded with U+FFFD.
    return Corpus(files, root, "txt", split=split, validation_fraction=validation_fraction, strict_utf8=False)
