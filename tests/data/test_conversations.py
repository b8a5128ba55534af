"""Chat data for `spd train --data`: every format reads the same conversations, malformed records
are skipped and counted, whole-file problems are one SPDError naming the file, and reading
streams (memory does not grow with the file)."""
import gzip
import hashlib
import itertools
import json
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from spd.data import conversations as conv_mod
from spd.data.conversations import (
    ReadStats,
    check_sources,
    conversation_key,
    in_holdout,
    read_conversations,
)
from spd.errors import SPDError

CONVERSATIONS = [
    [{"role": "user", "content": "Name three colors."},
     {"role": "assistant", "content": "Red, green and blue."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3 + 3?"},
     {"role": "assistant", "content": "6"}],
    [{"role": "user", "content": "Write a haiku about rain."}],  # user only: the target answers
    [{"role": "user", "content": 'Ünïcode ✓, "quotes", a {brace} and a\nnew line'},
     {"role": "assistant", "content": "Fine: \\ ] } ,"}],
]
FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def sharegpt(conversation, i=0) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": FROM[m["role"]], "value": m["content"]}
                                             for m in conversation]}


def openai(conversation, parts=False) -> dict:
    messages = [dict(m) for m in conversation]
    if parts:  # the first message's content as a list of text parts
        text = messages[0]["content"]
        messages[0]["content"] = [{"type": "text", "text": text[:5]},
                                  {"type": "text", "text": text[5:]}]
    return {"messages": messages}


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=2)
    return path


def read(sources, stats=None):
    return list(read_conversations(sources, stats))


@pytest.fixture
def small_reads(monkeypatch):
    """A 7-byte read size: every .json value, and some UTF-8 characters, straddle reads."""
    monkeypatch.setattr(conv_mod, "READ_BYTES", 7)


def write_every_format(tmp_path) -> dict:
    import datasets
    share = [sharegpt(c, i) for i, c in enumerate(CONVERSATIONS)]
    chat = [openai(c, parts=i == 0) for i, c in enumerate(CONVERSATIONS)]
    paths = {
        "sharegpt jsonl": write_jsonl(tmp_path / "share.jsonl", share),
        "openai jsonl": write_jsonl(tmp_path / "chat.jsonl", chat),
        "jsonl.gz": write_jsonl(tmp_path / "chat.jsonl.gz", chat, gzip.open),
        "json array": tmp_path / "share.json",
        "json objects": tmp_path / "lines.json",  # JSON Lines saved as .json (datasets' to_json)
        "sharegpt parquet": write_parquet(tmp_path / "share.parquet", share),
        "openai parquet": write_parquet(tmp_path / "chat.parquet",
                                        [openai(c) for c in CONVERSATIONS]),
    }
    paths["json array"].write_text(json.dumps(share, indent=2, ensure_ascii=False),
                                   encoding="utf-8")
    write_jsonl(paths["json objects"], chat)
    ds = datasets.Dataset.from_list([openai(c) for c in CONVERSATIONS])
    ds.save_to_disk(str(tmp_path / "saved"))
    paths["save_to_disk Dataset"] = tmp_path / "saved"
    # splits named against the alphabet: read in dataset_dict.json's order, not sorted
    datasets.DatasetDict({"zfirst": ds.select(range(2)), "asecond": ds.select(range(2, 4))}
                         ).save_to_disk(str(tmp_path / "saved_dict"))
    paths["save_to_disk DatasetDict"] = tmp_path / "saved_dict"
    mixed = tmp_path / "mixed"
    (mixed / "b" / "d").mkdir(parents=True)
    write_jsonl(mixed / "a.jsonl", share[:2])
    write_parquet(mixed / "b" / "c.parquet", chat[2:3])
    ds.select(range(3, 4)).save_to_disk(str(mixed / "b" / "d"))
    (mixed / "README.md").write_text("not data\n")
    (mixed / ".cache").mkdir()
    write_jsonl(mixed / ".cache" / "old.jsonl", share)  # hidden: passed over
    paths["folder"] = mixed
    return paths


def test_every_format_reads_the_same_conversations(tmp_path, small_reads):
    paths = write_every_format(tmp_path)
    for name, path in paths.items():
        stats = ReadStats()
        assert read([path], stats) == CONVERSATIONS, name
        assert (stats.records, stats.usable, stats.skipped) == (4, 4, Counter()), name
        assert stats.per_source == {str(path): 4}, name
        check_sources([path])
    # several sources: in the order given, counted per source; a plain str works as well
    stats = ReadStats()
    both = [str(paths["openai jsonl"]), paths["folder"]]
    assert read(both, stats) == CONVERSATIONS * 2
    assert stats.per_source == {str(paths["openai jsonl"]): 4, str(paths["folder"]): 4}
    assert stats.summary() == "8 conversations from 2 sources"
    assert stats.as_dict() == {"records": 8, "usable": 8, "skipped": {}, "stopped": {},
                               "per_source": stats.per_source}
    assert read(str(paths["openai jsonl"])) == CONVERSATIONS  # one path, not a list


MALFORMED = {
    "invalid JSON": ['{"messages": [', "not json at all"],
    "not an object": ["[1, 2]", '"a string"'],
    "no messages": ['{"id": 1}', '{"messages": []}', '{"conversations": "hello"}',
                    '{"conversations": null, "messages": null}'],
    "unknown role": ['{"messages": [{"role": "tool", "content": "x"}]}',
                     '{"conversations": [{"from": "bing", "value": "x"}]}',
                     '{"messages": [{"content": "no role"}]}', '{"messages": ["just text"]}'],
    "empty content": ['{"messages": [{"role": "user", "content": " \\n\\t"}]}',
                      '{"messages": [{"role": "user", "content": null}]}',
                      '{"conversations": [{"from": "human", "value": 3}]}',
                      '{"messages": [{"role": "user", "content": "hi"}, '
                      '{"role": "assistant", "content": ""}]}'],
    "non-text content": ['{"messages": [{"role": "user", "content": [{"type": "text", "text": '
                         '"look:"}, {"type": "image_url", "image_url": {"url": "x.png"}}]}]}'],
    "no user turn first": ['{"messages": [{"role": "assistant", "content": "Hello!"}, '
                           '{"role": "user", "content": "hi"}]}',
                           '{"messages": [{"role": "system", "content": "Be brief."}]}'],
}


def test_malformed_records_are_skipped_and_counted(tmp_path):
    assert set(MALFORMED) | {"truncated"} == set(conv_mod.REASONS)
    good = [json.dumps(openai(c)) for c in CONVERSATIONS]
    bad = [line for lines in MALFORMED.values() for line in lines]
    # good records around and between the bad ones; blank lines are not records
    lines = [good[0], *bad[:7], "", "   ", good[1], *bad[7:], good[2], good[3]]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    stats = ReadStats()
    assert read([path], stats) == CONVERSATIONS
    assert stats.skipped == Counter({k: len(v) for k, v in MALFORMED.items()})
    assert (stats.records, stats.usable) == (len(bad) + 4, 4)
    assert stats.summary() == ("4 conversations from 1 source; skipped 19 (4 no messages, "
                               "4 unknown role, 4 empty content, 2 invalid JSON, 2 not an "
                               "object, 2 no user turn first, 1 non-text content)")
    assert stats.as_dict()["skipped"]["unknown role"] == 4
    json.dumps(stats.as_dict())  # fit for --json output


def test_a_truncated_json_array_yields_the_whole_objects(tmp_path, small_reads):
    records = [sharegpt(c, i) for i, c in enumerate(CONVERSATIONS)]
    text = json.dumps(records, indent=2, ensure_ascii=False)
    last = text.rindex('{\n    "id": "c3"')
    path = tmp_path / "cut.json"
    for cut in range(last + 1, len(text) - 3, 7):  # every few characters of the last object
        path.write_text(text[:cut], encoding="utf-8")
        stats = ReadStats()
        assert read([path], stats) == CONVERSATIONS[:3], cut
        assert stats.skipped == Counter({"truncated": 1}), cut
        assert stats.records == 4 and not stats.stopped
    # cut between two objects: nothing was lost, nothing is counted
    path.write_text(text[:last], encoding="utf-8")
    stats = ReadStats()
    assert read([path], stats) == CONVERSATIONS[:3] and not stats.skipped


def test_invalid_json_inside_an_array_stops_that_file_and_says_so(tmp_path):
    records = [json.dumps(sharegpt(c)) for c in CONVERSATIONS]
    path = tmp_path / "broken.json"
    path.write_text("[" + records[0] + ",\n" + records[1].replace('"value"', '"value" 1', 1)
                    + ",\n" + records[2] + "]", encoding="utf-8")
    stats = ReadStats()
    assert read([path], stats) == CONVERSATIONS[:1]
    assert stats.skipped == Counter({"invalid JSON": 1})
    assert "were not read" in stats.stopped[str(path)]
    assert f"{path}: invalid JSON at character" in stats.summary()


def expect_error(source, *needles, check=True):
    """read_conversations (and check_sources, unless the fault is after a usable conversation)
    refuse `source` with one line naming it."""
    for run in (lambda: read([source]), lambda: check_sources([source]))[:1 + check]:
        with pytest.raises(SPDError) as info:
            run()
        message = str(info.value)
        assert str(source) in message and "\n" not in message, message
        for needle in needles:
            assert needle in message, message


def test_whole_file_problems_are_one_clear_error(tmp_path, small_reads):
    import pyarrow as pa
    import pyarrow.parquet as pq
    good = json.dumps(openai(CONVERSATIONS[0])).encode()
    expect_error(tmp_path / "missing.jsonl", "does not exist")
    (tmp_path / "data.csv").write_text("role,content\n")
    expect_error(tmp_path / "data.csv", "unsupported file type", ".jsonl.gz", ".parquet")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    expect_error(tmp_path / "empty.jsonl", "no usable conversation in 0 records")
    (tmp_path / "empty.json").write_bytes(b"")
    expect_error(tmp_path / "empty.json", "no usable conversation in 0 records")
    (tmp_path / "junk.jsonl").write_text('nope\n{"id": 1}\n{bad\n')
    expect_error(tmp_path / "junk.jsonl",
                 "no usable conversation in 3 records (2 invalid JSON, 1 no messages)")
    (tmp_path / "latin1.jsonl").write_bytes(good[:20] + b"caf\xe9" + good[20:] + b"\n" + good)
    expect_error(tmp_path / "latin1.jsonl", "not UTF-8", "byte 23")
    (tmp_path / "later.jsonl").write_bytes(good + b"\n" + good[:20] + b"caf\xe9" + good[20:])
    expect_error(tmp_path / "later.jsonl", "not UTF-8", f"byte {len(good) + 24:,}", check=False)
    (tmp_path / "latin1.json").write_bytes(b"[" + good[:20] + b"\xe9" + good[20:] + b"]")
    expect_error(tmp_path / "latin1.json", "not UTF-8", "byte 21")
    (tmp_path / "later.json").write_bytes(b"[" + good + b",\n" + good[:20] + b"\xe9" + good[20:])
    expect_error(tmp_path / "later.json", "not UTF-8", f"byte {len(good) + 23:,}", check=False)
    (tmp_path / "number.json").write_text("42")
    expect_error(tmp_path / "number.json", "expected a JSON array")
    (tmp_path / "text.jsonl.gz").write_text(good.decode())
    expect_error(tmp_path / "text.jsonl.gz", "not a gzip file")
    pq.write_table(pa.table({"text": ["hello"]}), tmp_path / "text.parquet")
    expect_error(tmp_path / "text.parquet", "no 'conversations' or 'messages' column", "text")
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    expect_error(tmp_path / "fake.parquet", "not a readable parquet file")
    import datasets
    datasets.Dataset.from_dict({"text": ["hello"]}).save_to_disk(str(tmp_path / "textset"))
    expect_error(tmp_path / "textset", "no 'conversations' or 'messages' column")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.txt").write_text("no data here\n")
    expect_error(tmp_path / "nothing", "no .jsonl")


def test_unreadable_files_and_a_missing_datasets_package(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "locked.jsonl", [openai(CONVERSATIONS[0])])
    saved = tmp_path / "saved"
    import datasets
    datasets.Dataset.from_list([openai(CONVERSATIONS[0])]).save_to_disk(str(saved))

    def denied(file, *args, **kwargs):  # tests may run as root, where chmod 000 reads anyway
        raise PermissionError(13, "Permission denied", str(file))
    monkeypatch.setattr(conv_mod, "open", denied, raising=False)
    expect_error(path, "cannot read", "Permission denied")
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    expect_error(saved, "pip install 'spd[train]'")


def test_check_sources_reads_only_to_the_first_usable_conversation(tmp_path):
    good = json.dumps(openai(CONVERSATIONS[0]))
    path = tmp_path / "good_then_garbage.jsonl"
    path.write_bytes(good.encode() + b"\n\xff\xfe garbage that is not even UTF-8\n")
    check_sources([path])  # stops after the first line
    with pytest.raises(SPDError, match="not UTF-8"):
        read([path])
    # a bad source after a good one still fails the check
    with pytest.raises(SPDError, match="missing.jsonl"):
        check_sources([path, tmp_path / "missing.jsonl"])


def test_a_source_with_nothing_usable_fails_when_its_stream_ends(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [openai(c) for c in CONVERSATIONS])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "tool", "content": "x"}]}\n')
    stream = read_conversations([good, bad])
    assert list(itertools.islice(stream, 4)) == CONVERSATIONS  # the good source first
    with pytest.raises(SPDError, match=r"bad.jsonl: no usable conversation in 1 record "
                                       r"\(1 unknown role\)"):
        next(stream)


STREAM_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from spd.data.conversations import read_conversations
    peaks = []
    for path in sys.argv[1:]:
        n = sum(1 for _ in read_conversations([path]))
        peaks.append((n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))
    print(json.dumps(peaks))
""")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_reading_streams_memory_does_not_grow_with_the_file(tmp_path, suffix):
    record = json.dumps(sharegpt([{"role": "user", "content": "Tell me a long story."},
                                  {"role": "assistant", "content": "Once upon a time. " * 450}]))
    block = ((record + "\n") * 128).encode()  # about 1 MB
    sizes = {"small": 20, "large": 200}  # MB
    paths = []
    for name, mb in sizes.items():
        path = tmp_path / f"{name}{suffix}"
        with open(path, "wb") as f:
            if suffix == ".json":
                f.write(b"[\n")
                f.write(block.replace(b"}\n", b"},\n") * (mb - 1))
                f.write(block.replace(b"}\n", b"},\n", 127))
                f.write(b"]\n")
            else:
                f.write(block * mb)
        paths.append(str(path))
    # one process reads the small file, then the large one: ru_maxrss is the peak so far, so
    # the large file's read may raise it only by what does not depend on the file's size
    out = subprocess.run([sys.executable, "-c", STREAM_SCRIPT, *paths], capture_output=True,
                         text=True, check=True).stdout
    (n_small, peak_small), (n_large, peak_large) = json.loads(out)
    assert (n_small, n_large) == (128 * 20, 128 * 200)
    assert peak_large < peak_small + 30, (peak_small, peak_large)


def test_conversation_key_and_holdout():
    base = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "  What is\n the  Capital of France? "},
            {"role": "assistant", "content": "Paris."}]
    same = [{"role": "user", "content": "what is the capital of france?"},
            {"role": "assistant", "content": "It is Paris."}]
    other = [{"role": "user", "content": "What is the capital of Spain?"}]
    assert conversation_key(base) == conversation_key(same) != conversation_key(other)
    # a fixed function of the text: the same on every machine and run
    assert conversation_key(same) == hashlib.sha256(b"what is the capital of france?").hexdigest()
    many = [[{"role": "user", "content": f"Question number {i}: why?"}] for i in range(2000)]
    held = [in_holdout(c, 0.1) for c in many]
    assert 0.08 < sum(held) / len(many) < 0.12
    assert [in_holdout(c, 0.1) for c in reversed(many)] == held[::-1]  # order does not matter
    assert all(in_holdout(c, 0.2) for c, h in zip(many, held) if h)  # a larger split holds it
    assert not any(in_holdout(c, 0.0) for c in many) and all(in_holdout(c, 1.0) for c in many)


def test_builtin_sharegpt_source():
    from spd.data.datasets import iter_sharegpt
    stats = ReadStats()
    stream = read_conversations(["sharegpt"], stats)
    first = list(itertools.islice(stream, 5))
    stream.close()
    expected = [c for c in itertools.islice(iter_sharegpt(), 50)
                if all(m["content"].strip() for m in c)][:5]
    assert first == expected and stats.per_source == {"sharegpt": 5}
    check_sources(["sharegpt"])
