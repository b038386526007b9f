"""Prompt sources as ``grain.MapDataset``s of ``Prompt``s, and the prompt stream built from them.

Sources (element ``i`` is record ``i``, read on demand):

- :func:`jsonl_source`: a JSON Lines file; line offsets are indexed once, records are parsed when
  read.
- :func:`parquet_source`: a Parquet file; the needed columns are held in memory as Arrow arrays.
- :func:`array_record_source`: ArrayRecord files of JSON-encoded records
  (:func:`write_array_record` writes them).
- :func:`env_source`: an environment's generated prompts, ``env.prompt(i, split)``.

A record is a JSON object (a Parquet row): ``text_key`` gives :attr:`Prompt.text`,
``answer_key`` :attr:`Prompt.answer` (numbers become strings; ``answer_key=None`` for data without
answers), and ``info_keys`` the fields copied into :attr:`Prompt.info` (``None``: every other
field). :attr:`Prompt.index` is the record's index in the source.

:func:`prompt_dataset` turns a source into this process's stream of :class:`PositionedPrompt`:
shuffled with a seed (a new order each epoch), repeated for ``num_epochs``, and split across JAX
processes by stride. Element ``p`` of the stream is a pure function of ``(source, seed,
num_epochs, process_index, process_count, p)``, so a consumer checkpoints what it has consumed
as stream positions and, on resume, reads any position again with ``stream[p]``.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grain
import jax

from rl_jax.data.prompts import Prompt, PromptGenerator

PathLike = str | os.PathLike


class SourceError(ValueError):
    """A prompt source that cannot be read: a malformed record, a missing field, an empty file."""


@dataclasses.dataclass(frozen=True)
class PositionedPrompt:
    """One element of a prompt stream (see :func:`prompt_dataset`).

    Attributes:
      position: index of this element in this process's stream: ``stream[position]`` is it again.
      global_position: index in the stream before sharding; process ``k`` of ``n`` holds global
        positions ``k, k + n, k + 2n, ...``.
      epoch: pass over the source this element belongs to, ``global_position // len(source)``.
      source_index: index of the prompt in the source.
      prompt: the prompt.
    """

    position: int
    global_position: int
    epoch: int
    source_index: int
    prompt: Prompt


# ---------------------------------------------------------------------------------------------
# Records to prompts.

@dataclasses.dataclass(frozen=True)
class _Fields:
    """Which record fields become which :class:`Prompt` attributes."""

    text_key: str
    answer_key: str | None
    info_keys: tuple[str, ...] | None

    def required(self) -> list[str]:
        keys = [self.text_key] + ([self.answer_key] if self.answer_key is not None else [])
        return keys + list(self.info_keys or ())

    def to_prompt(self, record: Any, index: int, where: str) -> Prompt:
        """The prompt of ``record``; ``where`` names the record in errors ("file, line 3")."""
        if not isinstance(record, Mapping):
            raise SourceError(f"{where}: a record must be a JSON object, got "
                              f"{type(record).__name__}")
        missing = [k for k in self.required() if k not in record]
        if missing:
            raise SourceError(f"{where}: missing field {missing[0]!r} (fields present: "
                              f"{', '.join(map(repr, record)) or 'none'})")
        text = record[self.text_key]
        if not isinstance(text, str):
            raise SourceError(f"{where}: field {self.text_key!r} must be a string, got "
                              f"{type(text).__name__}")
        answer = None if self.answer_key is None else record[self.answer_key]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        elif answer is not None and not isinstance(answer, str):
            raise SourceError(f"{where}: field {self.answer_key!r} must be a string or a number, "
                              f"got {type(answer).__name__}")
        if self.info_keys is None:
            info = {k: v for k, v in record.items() if k not in (self.text_key, self.answer_key)}
        else:
            info = {k: record[k] for k in self.info_keys}
        return Prompt(text=text, answer=answer, info=info, index=index)


def _fields(text_key: str, answer_key: str | None, info_keys: Sequence[str] | None) -> _Fields:
    if isinstance(info_keys, str):
        raise SourceError(f"info_keys must be a sequence of field names, got the string "
                          f"{info_keys!r}")
    return _Fields(text_key, answer_key, None if info_keys is None else tuple(info_keys))


def _existing_file(path: PathLike, kind: str) -> str:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind} file {path!r} does not exist")
    return path


def _check_index(index: int, length: int) -> int:
    index = int(index)
    if not 0 <= index < length:
        raise IndexError(f"record {index} is out of range for a source of {length} records")
    return index


# ---------------------------------------------------------------------------------------------
# JSON Lines.

class JsonlRecords:
    """Random access to the records of a JSON Lines file, as prompts.

    Construction reads the file once to index where each non-blank line starts (3 int64 per
    record in memory); ``self[i]`` reads and parses line ``i`` alone. Reads use ``os.pread``, so
    threads may share one instance; the file is reopened after unpickling.
    """

    def __init__(self, path: PathLike, fields: _Fields):
        self.path = _existing_file(path, "JSONL")
        self.fields = fields
        self._starts, self._lengths, self._line_numbers = array("q"), array("q"), array("q")
        offset = 0
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    self._starts.append(offset)
                    self._lengths.append(len(line))
                    self._line_numbers.append(number)
                offset += len(line)
        if not self._starts:
            raise SourceError(f"JSONL file {self.path!r} holds no records")
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> Prompt:
        index = _check_index(index, len(self))
        data = os.pread(self._fd, self._lengths[index], self._starts[index])
        where = f"{self.path}, line {self._line_numbers[index]}"
        try:
            record = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"{where}: malformed JSON ({e})") from None
        return self.fields.to_prompt(record, index, where)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_fd"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def jsonl_source(path: PathLike, *, text_key: str = "prompt", answer_key: str | None = "answer",
                 info_keys: Sequence[str] | None = None) -> grain.MapDataset:
    """Prompts from a JSON Lines file, one JSON object per non-blank line, in file order.

    Raises:
      FileNotFoundError: the file does not exist.
      SourceError: the file has no records; when an element is read, its line is not a JSON
        object or lacks a field (the message names the file and line).
    """
    return grain.MapDataset.source(JsonlRecords(path, _fields(text_key, answer_key, info_keys)))


# ---------------------------------------------------------------------------------------------
# Parquet.

class ParquetRecords:
    """Random access to the rows of a Parquet file, as prompts.

    The needed columns are read once into memory as Arrow arrays (memory-mapped reads, columnar
    storage); ``self[i]`` converts row ``i`` alone to Python. A pickle holds the path, not the
    columns: an unpickled copy reads the file anew.
    """

    def __init__(self, path: PathLike, fields: _Fields):
        import pyarrow.parquet as pq

        self.path = _existing_file(path, "Parquet")
        self.fields = fields
        try:
            metadata = pq.read_metadata(self.path)
        except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses here
            raise SourceError(f"{self.path!r} is not a readable Parquet file: {e}") from None
        names = metadata.schema.to_arrow_schema().names
        missing = [k for k in fields.required() if k not in names]
        if missing:
            raise SourceError(f"{self.path}: no column {missing[0]!r} (columns: "
                              f"{', '.join(map(repr, names))})")
        self.columns = names if fields.info_keys is None else fields.required()
        self._length = metadata.num_rows
        if self._length == 0:
            raise SourceError(f"Parquet file {self.path!r} holds no rows")
        self._table = self._read_columns()

    def _read_columns(self):
        import pyarrow.parquet as pq
        return pq.read_table(self.path, columns=self.columns, memory_map=True)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Prompt:
        index = _check_index(index, len(self))
        row = {name: self._table.column(name)[index].as_py() for name in self.columns}
        return self.fields.to_prompt(row, index, f"{self.path}, row {index}")

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_table"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._table = self._read_columns()


def parquet_source(path: PathLike, *, text_key: str = "prompt",
                   answer_key: str | None = "answer",
                   info_keys: Sequence[str] | None = None) -> grain.MapDataset:
    """Prompts from the rows of a Parquet file, in file order (needs ``pyarrow``).

    Raises:
      FileNotFoundError: the file does not exist.
      SourceError: the file is not Parquet, has no rows, or lacks a column; when an element is
        read, a value has the wrong type (the message names the file and row).
    """
    return grain.MapDataset.source(ParquetRecords(path, _fields(text_key, answer_key, info_keys)))


# ---------------------------------------------------------------------------------------------
# ArrayRecord.

class ArrayRecordRecords:
    """Random access to JSON-encoded records in ArrayRecord files, as prompts.

    Record ``i`` counts across the files in the order given; each file is read through
    ``grain.sources.ArrayRecordDataSource``, which opens it on first access.
    """

    def __init__(self, paths: PathLike | Sequence[PathLike], fields: _Fields):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not paths:
            raise SourceError("array_record_source needs at least one file")
        self.paths = [_existing_file(p, "ArrayRecord") for p in paths]
        self.fields = fields
        self._files = []
        for path in self.paths:
            try:
                self._files.append(grain.sources.ArrayRecordDataSource(path))
            except Exception as e:  # the reader raises RuntimeError or ValueError for bad files
                raise SourceError(f"{path!r} is not a readable ArrayRecord file: {e}") from None
        self._ends = []
        total = 0
        for file in self._files:
            total += len(file)
            self._ends.append(total)
        if total == 0:
            raise SourceError(f"ArrayRecord files {self.paths} hold no records")

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, index: int) -> Prompt:
        index = _check_index(index, len(self))
        file_index = bisect.bisect_right(self._ends, index)
        position = index - (self._ends[file_index - 1] if file_index else 0)
        where = f"{self.paths[file_index]}, record {position}"
        try:
            record = json.loads(self._files[file_index][position])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"{where}: malformed JSON ({e})") from None
        return self.fields.to_prompt(record, index, where)


def array_record_source(paths: PathLike | Sequence[PathLike], *, text_key: str = "prompt",
                        answer_key: str | None = "answer",
                        info_keys: Sequence[str] | None = None) -> grain.MapDataset:
    """Prompts from ArrayRecord files whose records are UTF-8 JSON objects, files in order.

    Raises:
      FileNotFoundError: a file does not exist.
      SourceError: a file is not ArrayRecord or all are empty; when an element is read, its record
        is not a JSON object or lacks a field (the message names the file and record).
    """
    return grain.MapDataset.source(
        ArrayRecordRecords(paths, _fields(text_key, answer_key, info_keys)))


def write_array_record(path: PathLike, records: Iterable[Mapping[str, Any]]) -> int:
    """Writes ``records`` as JSON-encoded ArrayRecord records (group size 1, for random access).

    Returns:
      The number of records written.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(os.fspath(path), "group_size:1")
    count = 0
    try:
        for record in records:
            writer.write(json.dumps(record).encode("utf-8"))
            count += 1
    finally:
        writer.close()
    return count


# ---------------------------------------------------------------------------------------------
# Generated prompts.

class _EnvPrompt:
    """Index -> ``env.prompt(index, split)``."""

    def __init__(self, env: PromptGenerator, split: str):
        self.env, self.split = env, split

    def __call__(self, index: int) -> Prompt:
        return self.env.prompt(int(index), self.split)


def env_source(env: PromptGenerator, split: str = "train",
               size: int | None = None) -> grain.MapDataset:
    """Prompts ``env.prompt(i, split)`` for ``i`` in ``[0, size)``; infinite (length
    ``sys.maxsize``) when ``size`` is None.

    Raises:
      SourceError: the environment does not generate prompts, or ``size`` is not positive.
    """
    if type(env).prompt is PromptGenerator.prompt:
        raise SourceError(f"{type(env).__name__} does not generate prompts; read its prompts "
                          "from a file source instead")
    if size is not None and size < 1:
        raise SourceError(f"size must be positive or None, got {size}")
    return grain.MapDataset.range(sys.maxsize if size is None else size).map(_EnvPrompt(env, split))


# ---------------------------------------------------------------------------------------------
# The prompt stream.

def shard_for_process(dataset: grain.MapDataset, process_index: int | None = None,
                      process_count: int | None = None) -> grain.MapDataset:
    """Elements ``process_index, process_index + process_count, ...`` of ``dataset``.

    Defaults to ``jax.process_index()`` and ``jax.process_count()``. Shards are disjoint, cover
    ``dataset``, and differ in length by at most one.
    """
    if (process_index is None) != (process_count is None):
        raise SourceError("give both process_index and process_count, or neither")
    if process_index is None:
        process_index, process_count = jax.process_index(), jax.process_count()
    if not 0 <= process_index < process_count:
        raise SourceError(f"process_index must be in [0, {process_count}), got {process_index}")
    return dataset[process_index::process_count]


class _TagGlobal:
    """(global position, source index) -> (global position, epoch, source index)."""

    def __init__(self, source_length: int):
        self.source_length = source_length

    def __call__(self, global_position: int, source_index: int) -> tuple[int, int, int]:
        return global_position, global_position // self.source_length, int(source_index)


class _AttachPrompt:
    """(position, tagged source index) -> :class:`PositionedPrompt`."""

    def __init__(self, source: grain.MapDataset):
        self.source = source

    def __call__(self, position: int, tagged: tuple[int, int, int]) -> PositionedPrompt:
        global_position, epoch, source_index = tagged
        return PositionedPrompt(position, global_position, epoch, source_index,
                                self.source[source_index])


def prompt_dataset(source: grain.MapDataset, *, seed: int, shuffle: bool = True,
                   num_epochs: int | None = 1, shard_by_process: bool = True,
                   process_index: int | None = None,
                   process_count: int | None = None) -> grain.MapDataset:
    """This process's prompt stream: a ``grain.MapDataset`` of :class:`PositionedPrompt`.

    The source's indices are shuffled with ``seed`` (``grain.MapDataset.shuffle``; each epoch
    in a new order), repeated ``num_epochs`` times (``None``: forever, length ``sys.maxsize``),
    then split by stride across processes: process ``k`` of ``n`` takes global positions
    ``k, k + n, ...``, so each epoch's prompts are divided among processes, every prompt once.
    Shard lengths differ by at most one. Prompts are read from ``source`` when an element is read.

    Args:
      source: a ``grain.MapDataset`` of prompts (one of this module's sources).
      seed: shuffle seed.
      shuffle: shuffle the source order.
      num_epochs: passes over the source, or ``None`` for no end. An infinite source takes 1 or
        ``None`` (the same stream).
      shard_by_process: split across processes; otherwise every process sees the whole stream.
      process_index, process_count: the shard to take; default ``jax.process_index()`` and
        ``jax.process_count()``.
    """
    length = len(source)
    if length == 0:
        raise SourceError("the prompt source is empty")
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
        raise SourceError(f"num_epochs must be a positive int or None, got {num_epochs!r}")
    infinite = length >= sys.maxsize
    if infinite and num_epochs not in (1, None):
        raise SourceError(f"an infinite source cannot be repeated {num_epochs} times; use "
                          "num_epochs=1 or None")
    order = grain.MapDataset.range(length)
    if shuffle:
        order = order.shuffle(seed=seed)
    if num_epochs != 1 and not infinite:
        order = order.repeat(num_epochs)
    stream = order.map_with_index(_TagGlobal(length))
    if shard_by_process:
        stream = shard_for_process(stream, process_index, process_count)
    return stream.map_with_index(_AttachPrompt(source))
