"""Dataset files: paths that escape PINFEED_DATA_ROOT (``..``, absolute, symlinks) and
hostile file contents are refused with 422 problem+json, never a 5xx; ``.pt`` files
are loaded with ``weights_only`` only, so pickled code never runs."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import Server
from tests.helpers import unique

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def files(rserver: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An ``outside`` directory with real data files, and links to it from the data root."""
    root = rserver.data_root / unique("paths")
    root.mkdir()
    outside = tmp_path_factory.mktemp("outside")
    for where in (root, outside):
        np.save(where / "x.npy", np.arange(12, dtype=np.float32).reshape(4, 3))
        torch.save((torch.arange(4),), where / "t.pt")
    os.symlink(outside / "x.npy", root / "link.npy")
    os.symlink(outside / "t.pt", root / "link.pt")
    os.symlink(outside, root / "linkdir")
    os.symlink("x.npy", root / "inside-link.npy")  # stays inside: allowed
    os.symlink(root / "loop-b", root / "loop-a")
    os.symlink(root / "loop-a", root / "loop-b")
    return {"root": root, "outside": outside}


def _post(server: Server, kind: str, params: dict[str, Any]) -> httpx.Response:
    body = {"name": unique("hostile"), "kind": kind, "params": params}
    return httpx.post(server.url + "/v1/datasets", json=body, timeout=30)


def _refused(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 422, f"{r.status_code}: {r.text[:300]}"
    assert r.headers["content-type"].startswith(PROBLEM)
    problem: dict[str, Any] = r.json()
    assert problem["type"] == "urn:pinfeed:problem:invalid-request"
    assert "Traceback" not in problem["detail"]
    return problem


ESCAPES = {
    "npy-dotdot": ("npy", "../{out}/x.npy"),
    "npy-dotdot-deep": ("npy", "a/b/../../../../../../../../etc/passwd"),
    "npy-absolute": ("npy", "{outside}/x.npy"),
    "npy-absolute-etc": ("npy", "/etc/passwd"),
    "npy-symlink": ("npy", "link.npy"),
    "npy-symlinked-dir": ("npy", "linkdir/x.npy"),
    "npy-dev": ("npy", "../../../../../../dev/zero"),
    "tensors-dotdot": ("tensors", "../{out}/t.pt"),
    "tensors-absolute": ("tensors", "{outside}/t.pt"),
    "tensors-symlink": ("tensors", "link.pt"),
    "tensors-symlinked-dir": ("tensors", "linkdir/t.pt"),
}


@pytest.mark.parametrize(("kind", "path"), list(ESCAPES.values()), ids=list(ESCAPES))
def test_paths_escaping_the_data_root(
    rserver: Server, files: dict[str, Path], kind: str, path: str
) -> None:
    # Paths are relative to the data root; ``files["root"]`` is a folder inside it.
    sub = files["root"].name
    outside = files["outside"]
    rel = os.path.relpath(outside, rserver.data_root)
    path = path.format(out=f"{sub}/../{rel}", outside=outside)
    if not path.startswith("/"):
        path = f"{sub}/{path}"
    params = {"paths": [path]} if kind == "npy" else {"path": path}
    problem = _refused(_post(rserver, kind, params))
    assert "outside the data root" in problem["detail"]


def test_a_symlink_that_stays_inside_is_allowed(rserver: Server, files: dict[str, Path]) -> None:
    r = _post(rserver, "npy", {"paths": [f"{files['root'].name}/inside-link.npy"]})
    assert r.status_code == 201, r.text


ODD_PATHS = {
    "nul-byte": "x\0.npy",
    "name-too-long": "a" * 300 + ".npy",
    "path-too-long": "a/" * 3000 + "x.npy",
    "symlink-loop": "loop-a",
}


@pytest.mark.parametrize("path", list(ODD_PATHS.values()), ids=list(ODD_PATHS))
def test_odd_paths_are_a_422(rserver: Server, files: dict[str, Path], path: str) -> None:
    _refused(_post(rserver, "npy", {"paths": [f"{files['root'].name}/{path}"]}))


class Sentinel:
    """Unpickling this runs ``os.system``: it must never happen."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_pickled_code_in_pt_files_never_runs(rserver: Server, files: dict[str, Path]) -> None:
    root, sentinel = files["root"], files["outside"] / "PWNED"
    evil = Sentinel(sentinel)
    torch.save(evil, root / "evil.pt")
    torch.save((torch.arange(4), evil), root / "evil-in-tuple.pt")
    torch.save({"x": torch.arange(4), "y": evil}, root / "evil-in-dict.pth")
    torch.save(evil, root / "evil-legacy.pt", _use_new_zipfile_serialization=False)
    (root / "evil-raw.pt").write_bytes(pickle.dumps(evil))
    names = ["evil.pt", "evil-in-tuple.pt", "evil-in-dict.pth", "evil-legacy.pt", "evil-raw.pt"]
    for name in names:
        problem = _refused(_post(rserver, "tensors", {"path": f"{root.name}/{name}"}))
        assert "weights_only" in problem["detail"], problem
    assert not sentinel.exists(), "a pickle in a .pt file ran code in the server"


def _safetensors(header: Any, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
BAD_FILES = {
    "safetensors-huge-header-length": struct.pack("<Q", 2**62) + b"{}",
    "safetensors-garbage": b"\x00" * 7,
    "npy-object-dtype": b"",  # written with np.save below
    "npy-truncated": b"",
}
BAD_FILES_5XX = {
    "safetensors-data-out-of-bounds": _safetensors({"x": F32x4}),
    "safetensors-negative-range": _safetensors(
        {"x": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, b"\0" * 16
    ),
    "safetensors-shape-mismatch": _safetensors(
        {"x": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, b"\0" * 16
    ),
    "safetensors-entry-not-object": _safetensors({"x": 3}),
    "safetensors-header-not-object": _safetensors([1, 2]),
    "safetensors-empty": b"",
    "npy-empty": b"",
}


def _write_bad(root: Path, label: str, content: bytes) -> tuple[str, dict[str, Any]]:
    suffix = ".npy" if label.startswith("npy") else ".safetensors"
    path = root / f"{label}{suffix}"
    if label == "npy-object-dtype":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif label == "npy-truncated":
        np.save(path, np.arange(100))
        path.write_bytes(path.read_bytes()[:200])
    else:
        path.write_bytes(content)
    rel = f"{root.name}/{path.name}"
    return ("npy", {"paths": [rel]}) if suffix == ".npy" else ("tensors", {"path": rel})


@pytest.mark.parametrize("label", list(BAD_FILES))
def test_hostile_file_contents_are_a_422(
    rserver: Server, files: dict[str, Path], label: str
) -> None:
    _refused(_post(rserver, *_write_bad(files["root"], label, BAD_FILES[label])))


@pytest.mark.parametrize("label", list(BAD_FILES_5XX))
def test_malformed_files_are_a_422_not_a_500(
    rserver: Server, files: dict[str, Path], label: str
) -> None:
    _refused(_post(rserver, *_write_bad(files["root"], label, BAD_FILES_5XX[label])))
