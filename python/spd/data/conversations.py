"""A user's chat data for training (`spd train --data PATH...`), read as a stream.

A source is a file, a folder or the name `sharegpt` (the project's built-in ShareGPT, see
`spd.data.datasets.iter_sharegpt`). Files are told apart by suffix:

- `.jsonl`, `.jsonl.gz`: one JSON object a line.
- `.json`: a JSON array of objects, decoded object by object from 1 MB reads (ShareGPT's dump is
  one 600 MB array). Objects one after another without an array (JSON Lines saved as `.json`,
  as `datasets`' `to_json` writes them) are read the same way.
- `.parquet`: read a batch of rows at a time with pyarrow.
- a folder written by Hugging Face `datasets`' `save_to_disk` (a Dataset or a DatasetDict, every
  split in the order `dataset_dict.json` lists them): memory-mapped by `datasets`.
- any other folder: every file of the suffixes above below it, and every `save_to_disk` folder,
  in sorted path order; names starting with "." (caches, editor copies) are passed over.

A record is ShareGPT (`{"conversations": [{"from": "human"|"gpt"|"system", "value"}]}`) or
OpenAI chat (`{"messages": [{"role": "system"|"user"|"assistant", "content"}]}`, content a
string or a list of text parts). Each becomes a conversation, `[{"role", "content"}]`. A
malformed record is skipped and counted under its reason in `ReadStats`; reading goes on. An
error about a whole file (missing, unreadable, not UTF-8, a source with nothing usable) is one
SPDError line naming it.

Memory stays bounded by one record (one parquet batch), whatever the file's size, and the order
is fixed (sources as given, records in file order), so a run resumes by skipping the first k.
"""
from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Sequence

from spd.data.files import read_json_object
from spd.errors import SPDError

SHAREGPT_SOURCE = "sharegpt"
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
READ_BYTES = 1 << 20  # one read of a .json array; a larger object grows the buffer as it needs
PARQUET_BATCH = 64  # rows of one parquet / arrow batch: memory is bounded by one batch
ROLES = {"system": "system", "user": "user", "assistant": "assistant",
         "human": "user", "gpt": "assistant"}  # ShareGPT's names and OpenAI's
REASONS = ("invalid JSON", "not an object", "no messages", "unknown role", "empty content",
           "non-text content", "no user turn first", "truncated")
FORMAT_HINT = ('expected ShareGPT records ({"conversations": [{"from", "value"}, ...]}) or '
               'OpenAI chat records ({"messages": [{"role", "content"}, ...]})')
# Errors that json.JSONDecoder raises when its text merely ends too early: more bytes may fix
# them. Any other error further than this many characters from the end is in the file itself.
_INCOMPLETE_MARGIN = 16


@dataclass
class ReadStats:
    """What reading saw: records seen, conversations yielded, skips by reason, yield per source."""
    records: int = 0
    usable: int = 0
    skipped: Counter = field(default_factory=Counter)
    per_source: dict[str, int] = field(default_factory=dict)
    # files read only in part (a syntax error inside a JSON array hides where the rest begins)
    stopped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line, e.g. '12,345 conversations from 2 sources; skipped 3 (2 invalid JSON, 1
        unknown role)'."""
        n = len(self.per_source)
        line = (f"{self.usable:,} conversation{'' if self.usable == 1 else 's'} from {n} "
                f"source{'' if n == 1 else 's'}")
        if self.skipped:
            line += f"; skipped {sum(self.skipped.values()):,} ({_reasons(self.skipped)})"
        for path, why in self.stopped.items():
            line += f"; {path}: {why}"
        return line

    def as_dict(self) -> dict:
        return {"records": self.records, "usable": self.usable,
                "skipped": dict(self.skipped.most_common()),
                "per_source": dict(self.per_source), "stopped": dict(self.stopped)}


def _reasons(skipped: Counter) -> str:
    return ", ".join(f"{n:,} {reason}" for reason, n in skipped.most_common())


def read_conversations(sources: Sequence[str | Path], stats: ReadStats | None = None
                       ) -> Iterator[list[dict]]:
    """Every usable conversation of every source, in order (sources in the order given,
    records in file order). Streams: memory bounded by one record (one parquet batch).
    A source that ends with no usable conversation raises SPDError naming it."""
    stats = ReadStats() if stats is None else stats
    for source in _as_list(sources):
        yield from _read_source(source, stats)


def check_sources(sources: Sequence[str | Path]) -> None:
    """Fail fast before any model loads: each source exists, is of a supported kind, and yields
    at least one usable conversation (reads only until the first usable one)."""
    for source in _as_list(sources):
        stream = _read_source(source, ReadStats())
        try:
            next(stream, None)  # a source with nothing usable raises at its end
        finally:
            stream.close()  # closes the file it holds open


def conversation_key(conversation: list[dict]) -> str:
    """A stable hex sha256 of the first user message with whitespace collapsed and lowercased:
    used for the held-out split by hash and for deduplication (same function for both)."""
    first = next((m["content"] for m in conversation if m["role"] == "user"), "")
    return hashlib.sha256(" ".join(first.split()).lower().encode("utf-8")).hexdigest()


def in_holdout(conversation: list[dict], fraction: float) -> bool:
    """True for a fixed `fraction` of conversations chosen by conversation_key (int of the first
    16 hex digits / 16**16 < fraction): the held-out split, stable across runs, machines and
    file order."""
    return int(conversation_key(conversation)[:16], 16) / 16 ** 16 < fraction


# ---------------------------------------------------------------------------------------------
# one record -> a conversation, or the reason it is skipped


def parse_record(obj) -> tuple[list[dict] | None, str]:
    """(conversation, "") for a usable record, else (None, reason) with a reason of REASONS."""
    if not isinstance(obj, dict):
        return None, "not an object"
    # a parquet / arrow row may hold both columns, the one a record lacks being null
    messages = obj.get("conversations")
    if messages is None:
        messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, "no messages"
    out = []
    for m in messages:
        if not isinstance(m, dict):
            return None, "unknown role"  # a message that is not an object has no role
        role = m.get("from") if m.get("from") is not None else m.get("role")
        role = ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            return None, "unknown role"
        content = m.get("value") if m.get("value") is not None else m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                return None, "non-text content"
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str) or not content.strip():
            return None, "empty content"
        out.append({"role": role, "content": content})
    first = next((m["role"] for m in out if m["role"] != "system"), None)
    if first != "user":
        return None, "no user turn first"
    return out, ""


# ---------------------------------------------------------------------------------------------
# sources


def _as_list(sources) -> list:
    # one path given where a list is expected would otherwise be read letter by letter
    return [sources] if isinstance(sources, (str, Path)) else list(sources)


def _read_source(source: str | Path, stats: ReadStats) -> Iterator[list[dict]]:
    """The usable conversations of one source, counted into `stats`; SPDError at the end when
    there were none."""
    label = str(source)
    if label == SHAREGPT_SOURCE:
        records = _sharegpt_records()
    else:
        path = _existing(source)
        records = _folder_records(path, stats) if path.is_dir() else _file_records(path, stats)
    records_before, usable_before = stats.records, stats.usable
    skipped_before = stats.skipped.copy()
    stats.per_source.setdefault(label, 0)
    for obj in records:
        stats.records += 1
        conversation, reason = ((None, obj.reason) if isinstance(obj, _Marker)
                                else parse_record(obj))
        if conversation is None:
            stats.skipped[reason] += 1
            continue
        stats.usable += 1
        stats.per_source[label] += 1
        yield conversation
    if stats.usable == usable_before:
        n = stats.records - records_before
        why = _reasons(stats.skipped - skipped_before)
        raise SPDError(f"{label}: no usable conversation in {n:,} record{'' if n == 1 else 's'}"
                       f"{f' ({why})' if why else ''}; {FORMAT_HINT}")


def _existing(source: str | Path) -> Path:
    path = Path(source).expanduser()
    if not path.exists():
        raise SPDError(f"data source {path} does not exist (give a file, a folder or "
                       f"'{SHAREGPT_SOURCE}')")
    if not path.is_dir():
        _suffix(path)  # an unsupported file fails here, before anything is read
    return path


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise SPDError(f"{path}: unsupported file type; give a {', '.join(SUFFIXES)} file, a folder "
                   "of them or a Hugging Face save_to_disk folder")


def _sharegpt_records() -> Iterator[dict]:
    # the built-in set, checked like any other source (a few of its answers are empty)
    from spd.data.datasets import iter_sharegpt
    for conversation in iter_sharegpt():
        yield {"messages": conversation}


def _file_records(path: Path, stats: ReadStats) -> Iterator:
    suffix = _suffix(path)
    if suffix == ".parquet":
        return _parquet_records(path)
    if suffix == ".json":
        return _json_array_records(path, stats)
    return _jsonl_records(path, gzipped=suffix == ".jsonl.gz", stats=stats)


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def _folder_records(folder: Path, stats: ReadStats) -> Iterator:
    if _is_saved_dataset(folder):
        return _saved_dataset_records(folder)
    units = list(_folder_units(folder))
    if not units:
        raise SPDError(f"{folder}: no {', '.join(SUFFIXES)} file or save_to_disk folder in it "
                       "or below it")
    return _chain(units, stats)


def _folder_units(folder: Path) -> list[Path]:
    """The data files and save_to_disk folders below `folder`, in sorted path order."""
    units = []
    for root, dirs, files in os.walk(folder, onerror=_walk_error):
        here = Path(root)
        keep = []
        for d in dirs:
            if d.startswith("."):
                continue
            if _is_saved_dataset(here / d):
                units.append(here / d)  # read as a whole, not file by file
            else:
                keep.append(d)
        dirs[:] = keep
        for f in files:
            if not f.startswith(".") and f.lower().endswith(SUFFIXES):
                units.append(here / f)
    return sorted(units, key=lambda p: p.relative_to(folder).parts)


def _walk_error(exc: OSError) -> None:
    raise SPDError(f"cannot read folder {exc.filename}: {exc.strerror or exc}") from exc


def _chain(units: Iterable[Path], stats: ReadStats) -> Iterator:
    for unit in units:
        yield from (_saved_dataset_records(unit) if unit.is_dir()
                    else _file_records(unit, stats))


def _open(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise SPDError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _not_utf8(path: Path, offset: int, exc: UnicodeDecodeError, where: str = "") -> SPDError:
    bad = exc.object[exc.start:exc.start + 1]
    return SPDError(f"{path} is not UTF-8 text (byte {offset:,}{where}: {bad!r}); convert it to "
                    "UTF-8")


def _jsonl_records(path: Path, gzipped: bool, stats: ReadStats) -> Iterator:
    """One JSON value a line; blank lines are passed over, a line that is not JSON is yielded
    as an _Invalid marker (counted "invalid JSON")."""
    where = " of its decompressed text" if gzipped else ""
    offset = 0
    with _open(path) as raw:
        f = gzip.GzipFile(fileobj=raw) if gzipped else raw
        try:
            for line in f:
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise _not_utf8(path, offset + exc.start, exc, where) from exc
                if offset == 0:
                    text = text.removeprefix("\ufeff")  # a byte-order mark
                offset += len(line)
                if not text.strip():
                    continue
                try:
                    yield json.loads(text)
                except (json.JSONDecodeError, RecursionError):
                    yield _INVALID
        except EOFError:
            yield _TRUNCATED  # a .gz cut short: its last lines are lost
            stats.stopped[str(path)] = "the compressed file ends early (cut short)"
        except gzip.BadGzipFile as exc:
            raise SPDError(f"{path} is not a gzip file ({exc}); name it .jsonl if it is plain "
                           "text") from exc
        except OSError as exc:
            raise SPDError(f"cannot read {path}: {exc.strerror or exc}") from exc


class _Marker:
    """A record that never parses: it stands for a line or object that could not be decoded."""

    def __init__(self, reason: str):
        self.reason = reason


_INVALID = _Marker("invalid JSON")
_TRUNCATED = _Marker("truncated")


def _json_array_records(path: Path, stats: ReadStats) -> Iterator:
    """The values of a JSON array (or of JSON values one after another), decoded one at a time
    from a buffer that holds the unread text of 1 MB reads: memory is bounded by the largest
    value. A file cut inside its last value yields the values before it, then a truncated
    marker."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos = "", 0  # unread text starts at buf[pos]
    dropped = 0  # characters dropped from the front of buf so far
    read_bytes = 0
    eof = False
    in_array = None  # decided by the first character: "[" or a value of its own

    with _open(path) as f:
        def more(size: int) -> bool:
            """Append the next `size` bytes' text to buf; False at the end of the file."""
            nonlocal buf, pos, dropped, read_bytes, eof
            if eof:
                return False
            try:
                data = f.read(size)
                text = utf8.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                pending = len(utf8.getstate()[0])
                raise _not_utf8(path, read_bytes - pending + exc.start, exc) from exc
            except OSError as exc:
                raise SPDError(f"cannot read {path}: {exc.strerror or exc}") from exc
            read_bytes += len(data)
            eof = not data
            dropped += pos
            buf, pos = buf[pos:] + text, 0
            if dropped == 0 and buf.startswith("\ufeff"):
                buf, dropped = buf[1:], 1  # a byte-order mark
            return not eof

        while True:
            # the next value's first character, past spaces (and commas inside the array)
            skip = " \t\r\n," if in_array else " \t\r\n"
            while True:
                while pos < len(buf) and buf[pos] in skip:
                    pos += 1
                if pos < len(buf) or not more(READ_BYTES):
                    break
            if pos >= len(buf):
                return  # the end of the file (an array that was never closed lost no value)
            if in_array is None:
                in_array = buf[pos] == "["
                if in_array:
                    pos += 1
                elif buf[pos] != "{":
                    raise SPDError(f"{path}: expected a JSON array of records or JSON objects "
                                   f"one after another, found {buf[pos]!r} first")
                continue
            if in_array and buf[pos] == "]":
                return
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as exc:
                    incomplete = (exc.msg.startswith("Unterminated string")
                                  or exc.pos >= len(buf) - _INCOMPLETE_MARGIN)
                    # a value larger than the buffer: read as much again (linear, not quadratic)
                    if incomplete and more(max(READ_BYTES, len(buf) - pos)):
                        continue
                    if incomplete:
                        yield _TRUNCATED
                    else:
                        yield _INVALID
                        stats.stopped[str(path)] = (
                            f"invalid JSON at character {dropped + exc.pos:,} ({exc.msg}); the "
                            "values after it cannot be located and were not read")
                    return
                except RecursionError:
                    yield _INVALID
                    stats.stopped[str(path)] = (f"a value nested too deeply at character "
                                                f"{dropped + pos:,}; the rest was not read")
                    return
            pos = end
            yield value


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise SPDError("reading .parquet files needs pyarrow: pip install 'spd[train]'") from exc
    return pyarrow


def _column(names: Sequence[str], where: Path) -> str:
    for name in ("conversations", "messages"):
        if name in names:
            return name
    raise SPDError(f"{where} has no 'conversations' or 'messages' column (its columns: "
                   f"{', '.join(names) or 'none'}); {FORMAT_HINT}")


def _parquet_records(path: Path) -> Iterator[dict]:
    pa = _pyarrow()
    with _open(path) as f:
        try:
            pf = pa.parquet.ParquetFile(f)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise SPDError(f"{path} is not a readable parquet file ({exc})") from exc
        col = _column(pf.schema_arrow.names, path)
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=[col]):
                for value in batch.column(0).to_pylist():
                    yield {col: value}
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise SPDError(f"cannot read {path}: {exc}") from exc


def _saved_dataset_records(folder: Path) -> Iterator[dict]:
    """Rows of a `save_to_disk` folder: a Dataset, or every split of a DatasetDict in the
    order its dataset_dict.json lists them."""
    try:
        import datasets
    except ImportError as exc:
        raise SPDError(f"{folder} is a Hugging Face datasets folder; reading it needs "
                       "datasets: pip install 'spd[train]'") from exc
    if (folder / "dataset_dict.json").is_file():
        splits = read_json_object(folder / "dataset_dict.json", "datasets split list")
        if not isinstance(splits.get("splits"), list):
            raise SPDError(f"{folder / 'dataset_dict.json'} has no 'splits' list; save the "
                           "data again with DatasetDict.save_to_disk")
        parts = [folder / str(name) for name in splits["splits"]]
    else:
        parts = [folder]
    for part in parts:
        try:
            ds = datasets.load_from_disk(str(part))
        except (OSError, ValueError) as exc:  # FileNotFoundError is an OSError
            raise SPDError(f"{part} cannot be read as a Hugging Face dataset saved with "
                           f"save_to_disk ({exc})") from exc
        if not isinstance(ds, datasets.Dataset):
            raise SPDError(f"{part} holds a {type(ds).__name__}, not one split's Dataset")
        col = _column(ds.column_names, part)
        for batch in ds.select_columns([col]).iter(batch_size=PARQUET_BATCH):
            for value in batch[col]:
                yield {col: value}
