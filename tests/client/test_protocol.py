"""The wire format in-process: every message kind round-trips through its encoder and
decoder, malformed control messages are refused, and docs/reference/protocol.md names every
kind and every error slug."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import pytest

from pinfeed import protocol as p
from pinfeed.errors import DATA_PLANE_ERRORS

REPO = Path(__file__).resolve().parents[2]

LAYOUT = p.Layout(
    treedef=["list", [["leaf", 0], ["dict", [["label", ["leaf", 1]], ["name", ["leaf", 2]]]]]],
    leaves=(
        p.Leaf("tensor", "float32", (3, 8, 8), 0, 3 * 64 * 4 * 4, 4),
        p.Leaf("tensor", "int64", (), 3072, 64, 8),
        p.Leaf("str", "", (), 3136, 0),
    ),
    batch_size=4,
    slot_bytes=3136,
)
ATTACHED = p.Attached(
    loader="demo",
    member=1,
    ring_bytes=6 * 3136,
    nslots=6,
    slot_bytes=3136,
    layout=LAYOUT,
    batches_per_epoch=25,
    epoch=3,
    position=7,
    config=p.AttachedConfig(
        dataset="images",
        batch_size=4,
        shuffle=True,
        seed=5,
        drop_last=False,
        num_workers=2,
        prefetch_factor=3,
        pin_memory=True,
        persistent_workers=False,
        rank=1,
        world_size=2,
        group_size=2,
        group_mode="split",
        collate_fn="mylab.collate:pad",
        sampler=None,
        batch_sampler="mylab.samplers:buckets",
    ),
    dataset_length=100,
    sampler_length=50,
    sample=[{"dtype": "uint8", "shape": [3, 32, 32]}, {"dtype": "int64", "shape": []}],
)


def _batch() -> bytes:
    parts = p.batch_parts(5, 2**40, 3, 7, p.pack_dims(LAYOUT, 4), b'[["a","b","c","d"]]')
    return b"".join(parts)


# kind -> (a message of that kind, a check that decoding it gives back what went in)
CREATE = p.Create(None, "d", 32, 2, 2, True, False, False, 100, 4, 100)
ROUND_TRIPS: dict[int, tuple[bytes, Callable[[bytes], object]]] = {
    p.ATTACH: (p.Attach("demo", 1).encode(), lambda m: p.Attach.decode(m) == p.Attach("demo", 1)),
    p.NEXT: (
        p.encode_release(p.NEXT, [4], 1500),
        lambda m: p.decode_release(m) == ([4], 1500),
    ),
    p.RELEASE: (
        p.encode_release(p.RELEASE, [1, 2, 3]),
        lambda m: p.decode_release(m) == ([1, 2, 3], 0),
    ),
    p.SKIP: (p.encode_release(p.SKIP, []), lambda m: p.decode_release(m) == ([], 0)),
    p.SEEK: (p.encode_position(p.SEEK, 2, 9), lambda m: p.decode_position(m) == (2, 9)),
    p.CUDA: (bytes([p.CUDA]), lambda m: m == b"C"),
    p.ATTACHED: (ATTACHED.encode(), lambda m: p.Attached.decode(m) == ATTACHED),
    p.BATCH: (
        _batch(),
        lambda m: (
            p.decode_batch(m, p.dims_struct(LAYOUT))
            == (5, 2**40, 3, 7, (4, 3, 8, 8, 4), b'[["a","b","c","d"]]')
        ),
    ),
    p.END: (p.encode_end(4, 99), lambda m: p.decode_end(m) == (4, 99)),
    p.POSITION: (p.encode_position(p.POSITION, 1, 0), lambda m: p.decode_position(m) == (1, 0)),
    p.SEGMENT: (
        p.SEGMENT_BODY.pack(p.SEGMENT, 2, 10, 8),
        lambda m: p.SEGMENT_BODY.unpack(m) == (p.SEGMENT, 2, 10, 8),
    ),
    p.RING: (
        p.RingInfo(4, 4096, LAYOUT).encode(),
        lambda m: p.RingInfo.decode(m) == p.RingInfo(4, 4096, LAYOUT),
    ),
    p.ERROR: (
        p.ErrorInfo(
            "sample-error", "sample 13 raised", False, extra={"index": 13, "error_type": "E"}
        )
        .at(2, 3)
        .encode(),
        lambda m: (
            p.ErrorInfo.decode(m)
            == p.ErrorInfo(
                "sample-error", "sample 13 raised", False, 2, 3, {"index": 13, "error_type": "E"}
            )
        ),
    ),
    p.CREATE: (
        CREATE.encode(),
        lambda m: (
            p.Create.decode(m) == p.Create(None, "d", 32, 2, 2, True, False, False, 100, 4, 100)
        ),
    ),
    p.EPOCH: (p.encode_epoch(3, -7, 2**62), lambda m: p.decode_epoch(m) == (3, -7, 2**62)),
    p.OBJECTS: (p.encode_objects(4), lambda m: p.decode_objects(m) == 4),
    p.FEED: (
        p.encode_feed(1, 5, [9, 2, 4], b"rng"),
        lambda m: p.decode_feed(m) == (1, 5, [9, 2, 4], b"rng", False, None),
    ),
    p.FEEDS: (
        p.encode_feeds(2, 6, [[9, 2, 4], [1], [2**40, 0]], True),
        lambda m: p.decode_feeds(m) == (2, 6, [[9, 2, 4], [1], [2**40, 0]], True),
    ),
    p.RNG: (
        p.RNG_HEAD.pack(p.RNG, 3) + b"abc",
        lambda m: p.RNG_HEAD.unpack_from(m) == (p.RNG, 3) and m[p.RNG_HEAD.size :] == b"abc",
    ),
    p.RESUME: (
        p.encode_resume({"version": 2, "epoch": 1, "ranks": [[1, 2]]}),
        lambda m: p.decode_resume(m) == {"version": 2, "epoch": 1, "ranks": [[1, 2]]},
    ),
    p.RESUMED: (
        p.Resumed(3, 12, {"epoch": 3, "start": 12, "end": 20, "stages": []}).encode(),
        lambda m: (
            p.Resumed.decode(m)
            == p.Resumed(3, 12, {"epoch": 3, "start": 12, "end": 20, "stages": []})
        ),
    ),
    p.REPLAY: (
        p.Replay("train-0", 4, 17).encode(),
        lambda m: p.Replay.decode(m) == p.Replay("train-0", 4, 17, p.PROTOCOL_VERSION),
    ),
    p.REPLAYED: (
        p.Replayed("train-0", 4, 17, [3, 1], 1, 0, 4096, LAYOUT).encode(),
        lambda m: p.Replayed.decode(m) == p.Replayed("train-0", 4, 17, [3, 1], 1, 0, 4096, LAYOUT),
    ),
    p.DESCRIBE: (
        p.Describe("images", {"path": "s3://b/train/", "size": 224}).encode(),
        lambda m: (
            p.Describe.decode(m)
            == p.Describe("images", {"path": "s3://b/train/", "size": 224}, p.PROTOCOL_VERSION)
        ),
    ),
    p.DESCRIBED: (
        p.Described(1281167, False).encode(),
        lambda m: p.Described.decode(m) == p.Described(1281167, False),
    ),
}


def test_a_feed_end_and_bad_feeds() -> None:
    assert p.decode_feed(p.encode_feed(2, 7, None)) == (2, 7, None, b"", False, None)
    # a batch fed ahead of its RNG states: its indices, no states
    assert p.decode_feed(p.encode_feed_ahead(2, 8, [3, 1])) == (2, 8, [3, 1], b"", True, None)
    with pytest.raises(ValueError, match="ahead of its RNG states"):  # with states
        p.decode_feed(bytes((p.FEED, p.FEED_AHEAD)) + p.encode_feed(1, 0, [1], b"s")[2:])
    with pytest.raises(ValueError, match="ahead of its RNG states"):  # an end
        p.decode_feed(bytes((p.FEED, p.FEED_AHEAD)) + p.encode_feed(1, 0, None)[2:])
    with pytest.raises(ValueError):
        p.decode_feed(p.encode_feed(1, 0, [1, 2])[:-3])
    with pytest.raises(ValueError, match="unknown flags"):
        p.decode_feed(bytes((p.FEED, 0x80)) + p.encode_feed(1, 0, [1])[2:])
    with pytest.raises(ValueError):  # a FEED_NEXT without its NEXT, or another kind after
        p.decode_feed(p.feed_then_next(p.encode_feed(1, 0, [1]), b""))
    with pytest.raises(ValueError):
        p.decode_feed(p.feed_then_next(p.encode_feed(1, 0, [1]), p.encode_release(p.SKIP, [])))


def test_feeds_an_end_alone_and_bad_feeds() -> None:
    # The sampler ran out right after the last chunk: a FEEDS of no batches, ended.
    assert p.decode_feeds(p.encode_feeds(4, 12, [], True)) == (4, 12, [], True)
    assert p.decode_feeds(p.encode_feeds(4, 0, [[1, 2]], False)) == (4, 0, [[1, 2]], False)
    good = p.encode_feeds(1, 0, [[1, 2], [3]], False)
    for bad in (
        good[:-1],  # short of its indices
        good + bytes(8),  # more indices than its sizes say
        good[: p.FEEDS_HEAD.size + 2],  # cut inside the sizes
        p.encode_feeds(1, 0, [[1], []], False),  # an empty batch
    ):
        with pytest.raises(ValueError):
            p.decode_feeds(bad)
    with pytest.raises(ValueError, match="unknown flags"):
        p.decode_feeds(bytes((p.FEEDS, 0x80)) + good[2:])
    with pytest.raises(struct.error):
        p.encode_feeds(1, 0, [[1.5]], False)


def test_a_feed_carries_the_next_after_it() -> None:
    # pinfeed.DataLoader's per-batch message: the next index batch, then its NEXT
    for indices, rng in (([4, 1], b"st"), (None, b"")):
        message = p.feed_then_next(
            p.encode_feed(3, 9, indices, rng), p.encode_release(p.NEXT, [5], 12)
        )
        epoch, index, got, got_rng, ahead, then = p.decode_feed(message)
        assert (epoch, index, got, got_rng, ahead) == (3, 9, indices, rng, False)
        assert then is not None and then[0] == p.NEXT
        assert p.decode_release(then) == ([5], 12)
    with pytest.raises(ValueError, match="unknown fields"):
        p.Create.decode(p._encode_json(p.CREATE, {"version": p.PROTOCOL_VERSION, "bogus": 1}))
    bad = p.Create(None, "d", 0, 2, 2, True, False, False, 100, 4, 100).encode()
    with pytest.raises(ValueError, match="max_rows"):
        p.Create.decode(bad)


def test_every_kind_round_trips() -> None:
    assert set(ROUND_TRIPS) == set(p.KIND_NAMES)
    for kind, (message, check) in ROUND_TRIPS.items():
        assert message[0] == kind, p.KIND_NAMES[kind]
        assert len(message) <= p.MAX_MESSAGE
        assert check(message), p.KIND_NAMES[kind]


def test_kinds_are_distinct_bytes() -> None:
    assert len(set(p.KIND_NAMES)) == len(p.KIND_NAMES) == len(set(p.KIND_NAMES.values()))


def test_batch_parts_are_what_the_server_sends() -> None:
    head, dims, strings = p.batch_parts(1, 2, 3, 4, b"", b"xy")
    assert p.BATCH_HEAD.unpack(head) == (p.BATCH, 1, 2, 3, 4, 2)
    assert (dims, strings) == (b"", b"xy")


def test_dims_are_rows_then_shape_of_each_tensor_leaf() -> None:
    dims = p.pack_dims(LAYOUT, 3)
    assert p.dims_struct(LAYOUT).unpack(dims) == (3, 3, 8, 8, 3)
    assert struct.calcsize(p.dims_struct(LAYOUT).format) == len(dims)


def test_layout_json_round_trips_and_sizes_rows() -> None:
    assert p.Layout.from_json(LAYOUT.to_json()) == LAYOUT
    assert LAYOUT.leaves[0].row_bytes == 3 * 8 * 8 * 4
    per_batch = replace(LAYOUT, per_batch=True)
    assert p.Layout.from_json(per_batch.to_json()) == per_batch
    older = {k: v for k, v in LAYOUT.to_json().items() if k != "per_batch"}
    assert p.Layout.from_json(older) == LAYOUT


STRUCTURE = (
    b'[["tuple",[["leaf",0],["list",[["leaf",1],["leaf",2]]]]],'
    b'[["t","int64",2],["o","",0],["n","float32",1]]]'
)


def test_a_batch_with_its_own_layout_round_trips() -> None:
    body = p.encode_batch_layout(STRUCTURE, [0, 4, 9, 320, 7], b'[["a",1]]')
    assert body[0] == 0  # the mark: never the first byte of a strings JSON
    message = b"".join(p.batch_parts(2, 9, 1, 5, b"", body, p.FLAG_LAYOUT))
    kind_flags, slot, seq, epoch, index, nbody = p.BATCH_HEAD.unpack_from(message)
    assert (kind_flags & 0xFF, kind_flags >> 8, slot, seq, epoch, index) == (p.BATCH, 1, 2, 9, 1, 5)
    assert message[0] == p.BATCH and message[1] & p.FLAG_LAYOUT
    structure, dims, objects = p.decode_batch_layout(message[p.BATCH_HEAD.size :])
    assert structure[1] == [["t", "int64", 2], ["o", "", 0], ["n", "float32", 1]]
    assert dims == (0, 4, 9, 320, 7)
    assert objects == [["a", 1]]
    assert p.layout_dims(structure[1]).size == 5 * 8
    assert nbody == len(body)
    # A fixed-layout BATCH has no flags: byte 1 is 0.
    assert _batch()[1] == 0


def test_release_wait_is_optional_and_bounded() -> None:
    bare = p.RELEASE_HEAD.pack(p.RELEASE, 1) + p.SLOT.pack(7)
    assert p.decode_release(bare) == ([7], None)
    assert p.decode_release(p.encode_release(p.NEXT, [1], 2**40)) == ([1], 0xFFFFFFFF)
    for bad in (b"N", p.RELEASE_HEAD.pack(p.NEXT, 2) + p.SLOT.pack(0)):
        with pytest.raises(ValueError):
            p.decode_release(bad)


@pytest.mark.parametrize(
    "message",
    [
        b"A",
        b'A{"loader": "de',
        b"A[1, 2]",
        b"A\xff\xfe",
        b"A" + b"[" * 100_000,
        b'A{"loader": 5, "version": 2}',
        b'A{"loader": "x"}',
        b'A{"loader": "x", "version": 2, "member": "zero"}',
        b'A{"loader": "x", "version": 2, "member": true}',
        b'N{"loader": "x", "version": 2}',
    ],
)
def test_a_malformed_attach_is_a_value_error(message: bytes) -> None:
    with pytest.raises(ValueError):
        p.Attach.decode(message)


def test_error_fatal_flag_comes_from_its_class_and_travels() -> None:
    for slug, cls in DATA_PLANE_ERRORS.items():
        info = cls("d").info()
        assert (info.slug, info.fatal) == (slug, cls.fatal)
        assert p.ErrorInfo.decode(info.encode()) == info
    # A slug this client does not know still says whether the connection goes on.
    future = p.ErrorInfo("from-the-future", "d", fatal=False)
    assert p.ErrorInfo.decode(future.encode()).fatal is False
    assert p.ErrorInfo.decode(b'X{"type": "from-the-future", "detail": "d"}').fatal is True


def test_attached_ignores_fields_it_does_not_know() -> None:
    """A newer server may add fields, to ATTACHED or to its config."""
    body = json.loads(ATTACHED.encode()[1:])
    body["spare"] = True
    body["config"] |= {"autotune": {"max_workers": 4}, "executor": "local"}
    newer = bytes([p.ATTACHED]) + json.dumps(body).encode()
    assert p.Attached.decode(newer) == ATTACHED


def test_attached_config_is_typed_and_says_each_field_once() -> None:
    body = json.loads(ATTACHED.encode()[1:])
    assert set(body["config"]) == {f.name for f in fields(p.AttachedConfig)}
    assert not set(body) & set(body["config"])  # no field twice
    decoded = p.Attached.decode(ATTACHED.encode())
    assert isinstance(decoded.config, p.AttachedConfig)
    assert decoded.config.group_mode == "split" and decoded.config.world_size == 2


@pytest.mark.parametrize("missing", ["layout", "config", "member", "config.seed"])
def test_an_attached_without_a_field_is_a_value_error(missing: str) -> None:
    body = json.loads(ATTACHED.encode()[1:])
    *path, key = missing.split(".")
    (body[path[0]] if path else body).pop(key)
    with pytest.raises(ValueError, match="ATTACHED"):
        p.Attached.decode(bytes([p.ATTACHED]) + json.dumps(body).encode())


def test_docs_table_names_every_kind_slug_and_attached_field() -> None:
    doc = (REPO / "docs" / "reference" / "protocol.md").read_text()
    for kind, name in p.KIND_NAMES.items():
        assert f"| {name} | `{chr(kind)}` |" in doc, name
    for slug, cls in DATA_PLANE_ERRORS.items():
        row = f"| `{slug}` | {'yes' if cls.fatal else 'no'} |"
        assert row in doc and f"| `{cls.__name__}`" in doc, slug
    for body in ("BATCH_HEAD", "END_BODY", "POSITION_BODY", "RELEASE_HEAD"):
        assert f"`{getattr(p, body).format}`" in doc, body
    attached = doc[doc.index("## ATTACHED") : doc.index("## The layout JSON")]
    for cls in (p.Attached, p.AttachedConfig):
        for f in fields(cls):
            assert f"`{f.name}`" in attached, f"{cls.__name__}.{f.name}"


def test_the_module_loads_by_path_without_torch_or_pinfeed() -> None:
    """What tests/reliability/rawclient.py relies on: a stdlib-only trainer."""
    path = str(REPO / "src" / "pinfeed" / "protocol.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('wire', {path!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['wire'] = m\n"
        "spec.loader.exec_module(m)\n"
        "assert m.Attach.decode(m.Attach('x').encode()).loader == 'x'\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'numpy', 'pinfeed'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-I", "-c", code], check=True, timeout=60)
