"""What pinfeed is measured against: the Dataset a trainer uses today for the same files
under ``torch.utils.data.DataLoader`` (``Workload.reference``), and what a performance
engineer writes with DataLoader alone (``Workload.tuned``).

References (plain DataLoader: per-sample ``__getitem__`` + ``default_collate``):

- ``tensordataset``: ``torch.utils.data.TensorDataset`` over the tensors of the same
  ``.pt`` (``torch.load(weights_only=True, mmap=True)``, as the ``tensors`` kind loads
  it) or ``.safetensors`` file (``safetensors.torch.load_file``);
- ``getitems``: the same with ``__getitems__`` (:class:`GetitemsTensorDataset`: one
  gather a batch, its samples views of it), DataLoader's batched-read hook;
- ``memmap``: :class:`MemmapArrays`, a user's ``np.memmap`` Dataset over ``.npy`` files;
- ``imagefolder``: :class:`PilImageFolder`, torchvision's ``ImageFolder`` + ``Resize`` +
  ``CenterCrop`` + ``PILToTensor`` written out with Pillow. torchvision itself cannot
  run here (PyPI's torchvision does not import beside torch 2.13.0 CPU), so this stands
  in for it: the same Pillow calls torchvision makes for those transforms;
- ``tokens``: nanoGPT's windows over ``np.memmap`` (:class:`MemmapTokens`);
- ``hf``: ``datasets.load_from_disk(...).with_format("torch")``;
- ``webdataset``: ``webdataset.WebDataset(...).decode("torchrgb8").to_tuple(...)``.

Tuned (``tuned_loader``): the same data, one batched read per batch where the dataset
allows it: ``batch_size=None`` over a ``BatchSampler`` (the sampler DataLoader would
build, on the same generator, so the batches are the same), the Dataset indexed with the
whole index list at once (one fancy index per field); an iterable pipeline batched in
the pipeline (WebDataset's ``.batched``). ``pin_memory`` with CUDA and the best
``num_workers`` are the benchmark's part (``bench.trainer``). tests/datasets/
test_references.py checks every tuned variant gives the plain reference's batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)


def load_tensors(path: Path) -> tuple[list[torch.Tensor], list[str] | None]:
    """The tensors of a ``.pt`` (tuple, list or dict) or ``.safetensors`` file, in file
    order, and their keys where the file holds a dict."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        data: Any = load_file(str(path))
    else:
        data = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    if isinstance(data, dict):
        return list(data.values()), list(data)
    if isinstance(data, torch.Tensor):
        return [data], None
    return list(data), None


def tensordataset(root: Path, params: dict[str, Any]) -> TensorDataset:
    tensors, _ = load_tensors(root / params["path"])
    return TensorDataset(*tensors)


class BatchedTensorDataset(TensorDataset):
    """``TensorDataset`` read a batch at a time: ``index_select`` per tensor. (Indexing
    with the list, ``t[idx]``, works too but is about 10x slower on a uint8 [N, 3, 64, 64]
    tensor: it gathers element by element; a performance engineer measures and picks
    this.)"""

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, ...]:
        if isinstance(index, list):
            idx = torch.as_tensor(index, dtype=torch.int64)
            return tuple(torch.index_select(t, 0, idx) for t in self.tensors)
        return super().__getitem__(index)


def tensordataset_batched(root: Path, params: dict[str, Any]) -> BatchedTensorDataset:
    tensors, _ = load_tensors(root / params["path"])
    return BatchedTensorDataset(*tensors)


class GetitemsTensorDataset(TensorDataset):
    """``TensorDataset`` with DataLoader's batched-read hook: ``__getitems__`` gathers a
    batch's rows with one ``index_select`` per tensor and hands ``default_collate`` its
    samples as views of them (what a Dataset written for ``__getitems__`` does)."""

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        rows = [torch.index_select(t, 0, idx).unbind(0) for t in self.tensors]
        return list(zip(*rows, strict=True))


def getitems(root: Path, params: dict[str, Any]) -> GetitemsTensorDataset:
    tensors, _ = load_tensors(root / params["path"])
    return GetitemsTensorDataset(*tensors)


class MemmapArrays(Dataset[tuple[torch.Tensor, ...]]):
    """``.npy`` files memory-mapped with ``np.load(mmap_mode="r")``, one sample a row, as
    a user writes it: each field's row copied out of the mapping, as a tensor."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.arrays = [np.load(p, mmap_mode="r") for p in paths]

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(np.array(a[i])) for a in self.arrays)


class BatchedMemmapArrays(MemmapArrays):
    """:class:`MemmapArrays` read a batch at a time: one fancy index per field (a
    ``batch_size=None`` DataLoader over a ``BatchSampler`` passes the index list)."""

    def __getitem__(self, i: Any) -> tuple[torch.Tensor, ...]:
        if isinstance(i, list):
            return tuple(torch.from_numpy(a[i]) for a in self.arrays)
        return super().__getitem__(i)


def memmap(root: Path, params: dict[str, Any]) -> MemmapArrays:
    return MemmapArrays([root / p for p in params["paths"]])


def memmap_batched(root: Path, params: dict[str, Any]) -> BatchedMemmapArrays:
    return BatchedMemmapArrays([root / p for p in params["paths"]])


class PilImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """The reference: torchvision's ImageFolder + Resize(size) + CenterCrop(size) +
    PILToTensor, written out with Pillow (torchvision is not a dependency); without
    ``crop``, Resize(size) + PILToTensor (W9's deterministic stage)."""

    def __init__(self, root: Path, size: int, crop: bool = True) -> None:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = []
        for label, name in enumerate(classes):
            for dirpath, _, fnames in sorted(os.walk(root / name, followlinks=True)):
                for fname in sorted(fnames):
                    if fname.lower().endswith((".jpg", ".jpeg", ".png")):
                        self.samples.append((os.path.join(dirpath, fname), label))
        self.classes = classes
        self.size = size
        self.crop = crop

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return _pil_fit(f, self.size, self.crop), label

    def shape(self, index: int) -> tuple[int, int, int]:
        """Sample ``index``'s image shape, [3, H, W], from its file's header (no decode)."""
        from PIL import Image

        if self.crop:
            return 3, self.size, self.size
        with Image.open(self.samples[index][0]) as img:
            w, h = _fitted(*img.size, self.size)
        return 3, h, w


class SharedDecoded(Dataset[tuple[torch.Tensor, int]]):
    """What a tuned DataLoader user writes to decode each image once: ``dataset``'s
    ``(image, label)`` samples kept, as read, in a uint8 file in shared memory, and its
    labels and a filled flag per sample beside it (``np.memmap``, ``MAP_SHARED``). Made
    before the DataLoader; whichever process reads a sample first (the trainer, or any
    of DataLoader's workers, forked or started afresh: a copy reopens the files by
    path) decodes it, writes it and then sets its flag; from then on every process
    hands out a read-only view of it (the transform after it must not write into its
    input, as ``bench.transforms.w9`` does not). Each sample's place is fixed at
    construction from ``shapes`` (the decoded shapes, known without decoding: an image
    file's header), so no process allocates while others read. Two processes that
    decode the same sample at once write the same bytes. The files go when the object
    that made them is collected, or at exit (its process only)."""

    def __init__(
        self, dataset: Any, shapes: Sequence[tuple[int, ...]], tmp: str | None = None
    ) -> None:
        import tempfile
        import weakref

        self.dataset = dataset
        self.shapes = np.asarray(shapes, dtype=np.int64)
        sizes = self.shapes.prod(axis=1)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        shm = "/dev/shm" if tmp is None and os.path.isdir("/dev/shm") else tmp
        self.folder = tempfile.mkdtemp(prefix="bench-decoded-", dir=shm)
        n, total = len(self.shapes), int(self.offsets[-1])
        for name, length in (("pixels", total), ("labels", 8 * n), ("filled", n)):
            with open(os.path.join(self.folder, name), "wb") as f:
                f.truncate(max(1, length))  # sparse: pages come as samples are written
        self._open()
        weakref.finalize(self, _remove_folder, self.folder, os.getpid())

    def _open(self) -> None:
        n = len(self.shapes)
        path = os.path.join(self.folder, "{}").format
        total = max(1, int(self.offsets[-1]))
        self.pixels = np.memmap(path("pixels"), dtype=np.uint8, mode="r+", shape=(total,))
        self.labels = np.memmap(path("labels"), dtype=np.int64, mode="r+", shape=(n,))
        self.filled = np.memmap(path("filled"), dtype=np.uint8, mode="r+", shape=(n,))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("pixels", "labels", "filled")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        shape = tuple(int(x) for x in self.shapes[index])
        if not self.filled[index]:
            image, label = self.dataset[index]
            if tuple(image.shape) != shape:
                raise ValueError(f"sample {index}: decoded {tuple(image.shape)}, not {shape}")
            self.pixels[a:b] = image.numpy().reshape(-1)
            self.labels[index] = label
            self.filled[index] = 1  # after its bytes: a reader that sees it sees them
            return image, label
        view = torch.from_numpy(self.pixels[a:b]).view(shape)
        return view, int(self.labels[index])


def _remove_folder(folder: str, owner: int) -> None:
    import shutil

    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


def _fitted(w: int, h: int, size: int) -> tuple[int, int]:
    """(width, height) of a ``w`` x ``h`` image resized to shorter side ``size``, the
    aspect kept (torchvision's ``Resize(size)``)."""
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    return (new_short, new_long) if w <= h else (new_long, new_short)


def _pil_fit(f: Any, size: int, crop: bool) -> torch.Tensor:
    """The image in file ``f`` as RGB: Resize(size), CenterCrop(size) with ``crop``,
    PILToTensor (torchvision's, written out with Pillow)."""
    from PIL import Image

    img = Image.open(f).convert("RGB")
    w, h = img.size
    new_w, new_h = _fitted(w, h, size)
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    if not crop:
        return torch.from_numpy(np.array(img)).permute(2, 0, 1)
    top = round((new_h - size) / 2.0)
    left = round((new_w - size) / 2.0)
    img = img.crop((left, top, left + size, top + size))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


_OBSTORE_AWS_KEYS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
)


class S3ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """What a trainer writes without pinfeed for an ImageFolder in a bucket: the keys
    listed once (obstore, the AWS chain of this process), each sample one GET of its
    object in the process that reads it (a client per process: DataLoader's workers
    fork), decoded as :class:`PilImageFolder` decodes. Nothing is cached: every epoch
    reads the store again. The chain's variables are read at construction and travel
    with the object: a forkserver started earlier in the process keeps the environment
    it started with, and its workers would otherwise ask the instance metadata
    service."""

    def __init__(self, bucket: str, prefix: str, size: int, crop: bool = True) -> None:
        import obstore

        self.bucket, self.size, self.crop = bucket, size, crop
        self.aws_env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        prefix = prefix.strip("/") + "/"
        keys = [str(m["path"]) for page in obstore.list(self._store(), prefix) for m in page]
        by_class: dict[str, list[tuple[str, str, str]]] = {}
        for key in keys:
            cls, _, rest = key[len(prefix) :].partition("/")
            if rest and key.lower().endswith((".jpg", ".jpeg", ".png")):
                folder, _, name = key.rpartition("/")
                by_class.setdefault(cls, []).append((folder, name, key))
        self.classes = sorted(by_class)
        self.samples = [
            (key, label)
            for label, cls in enumerate(self.classes)
            for _, _, key in sorted(by_class[cls])
        ]
        self._pid, self._client = -1, None

    def _store(self) -> Any:
        from obstore.store import S3Store

        config = {k.lower(): v for k, v in self.aws_env.items() if k in _OBSTORE_AWS_KEYS}
        endpoint = self.aws_env.get("AWS_ENDPOINT_URL", "")
        return S3Store(
            self.bucket,
            config=config,
            client_options={"allow_http": endpoint.startswith("http:")},
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_client": None}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import io

        import obstore

        if self._pid != os.getpid():
            self._pid, self._client = os.getpid(), self._store()
        key, label = self.samples[index]
        data = obstore.get(self._client, key).bytes()
        return _pil_fit(io.BytesIO(bytes(data)), self.size, self.crop), label


def imagefolder(root: Path, params: dict[str, Any]) -> PilImageFolder:
    return PilImageFolder(root / params["path"], params["size"], params.get("crop", True))


def imagefolder_cached(root: Path, params: dict[str, Any]) -> SharedDecoded:
    """:func:`imagefolder` decoded once (:class:`SharedDecoded`): W9's
    ``dataloader-cached``, a tuned DataLoader user's own cache of the deterministic
    stage."""
    base = imagefolder(root, params)
    return SharedDecoded(base, [base.shape(i) for i in range(len(base))])


class MemmapTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """nanoGPT's ``get_batch`` windows over ``np.memmap`` as a map-style Dataset."""

    def __init__(self, path: Path, dtype: str, seq_len: int, stride: int | None = None) -> None:
        self.data = np.memmap(path, dtype=dtype, mode="r")
        self.seq_len, self.stride = seq_len, stride or seq_len

    @classmethod
    def from_params(cls, root: Path, params: dict[str, Any]) -> Self:
        """Over the ``tokens`` kind's file, from its params."""
        return cls(
            root / params["path"],
            params.get("dtype", "uint16"),
            params["seq_len"],
            params.get("stride"),
        )

    def __len__(self) -> int:
        return (len(self.data) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.stride
        x = torch.from_numpy(self.data[s : s + self.seq_len].astype(np.int64))
        y = torch.from_numpy(self.data[s + 1 : s + 1 + self.seq_len].astype(np.int64))
        return x, y


class BatchedMemmapTokens(MemmapTokens):
    """:class:`MemmapTokens` a batch at a time: one 2-D fancy index (every window and its
    one extra target token), widened to int64 once."""

    def __getitem__(self, i: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(i, list):
            return super().__getitem__(i)
        starts = np.asarray(i, dtype=np.int64) * self.stride
        rows = self.data[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def tokens(root: Path, params: dict[str, Any]) -> MemmapTokens:
    return MemmapTokens.from_params(root, params)


def tokens_batched(root: Path, params: dict[str, Any]) -> BatchedMemmapTokens:
    return BatchedMemmapTokens.from_params(root, params)


class BatchedSequences(Dataset[dict[str, torch.Tensor]]):
    """W4's variable-length sequences (``bench.tokens``), a padded batch at a time: the
    batch's rows copied straight into one zeroed int64 array (no per-sample tensor, no
    ``pad_sequence``); the same dict as ``bench.tokens.pad_collate``."""

    def __init__(self, tokens: str, offsets: str) -> None:
        self.tokens = np.load(tokens, mmap_mode="r")
        self.offsets = np.load(offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: list[int]) -> dict[str, torch.Tensor]:
        idx = np.asarray(i, dtype=np.int64)
        starts, stops = self.offsets[idx], self.offsets[idx + 1]
        lengths = stops - starts
        ids = np.zeros((len(idx), int(lengths.max())), dtype=self.tokens.dtype)
        for row, (a, b) in enumerate(zip(starts.tolist(), stops.tolist(), strict=True)):
            ids[row, : b - a] = self.tokens[a:b]
        lens = torch.from_numpy(lengths)
        mask = torch.arange(ids.shape[1])[None, :] < lens[:, None]
        return {"input_ids": torch.from_numpy(ids), "attention_mask": mask, "lengths": lens}


def sequences_batched(root: Path, params: dict[str, Any]) -> BatchedSequences:
    return BatchedSequences(**params["kwargs"])


def hf(root: Path, params: dict[str, Any]) -> Any:
    import datasets as hd

    return hd.load_from_disk(str(root / params["path"])).with_format("torch")


def webdataset(root: Path, params: dict[str, Any]) -> Any:
    import webdataset as wds

    ds = wds.WebDataset(str(root / params["shards"]), shardshuffle=False, empty_check=False)
    return ds.decode("torchrgb8").to_tuple(*params["fields"])


REFERENCES: dict[str, Callable[[Path, dict[str, Any]], Any]] = {
    "tensordataset": tensordataset,
    "getitems": getitems,
    "memmap": memmap,
    "imagefolder": imagefolder,
    "imagefolder-cached": imagefolder_cached,
    "tokens": tokens,
    "hf": hf,
    "webdataset": webdataset,
}


def build(name: str, root: Path, params: dict[str, Any]) -> Any:
    return REFERENCES[name](root, params)


def named(reference: str, data_root: str, params: dict[str, Any]) -> Any:
    """Reference ``reference`` as a ``python`` dataset's factory: a named loader over the
    very Dataset object the DataLoader and pinfeed.DataLoader runs read (the
    ``pinfeed-python`` system), so the two ways into pinfeed are compared on one object."""
    return build(reference, Path(data_root), params)


# --- tuned: what a performance engineer writes with DataLoader alone -----------------

# Map-style datasets indexed with a whole batch's index list (batch_size=None over a
# BatchSampler); HF's torch format takes a list index as it is.
BATCHED: dict[str, Callable[[Path, dict[str, Any]], Any]] = {
    "tensordataset": tensordataset_batched,
    "memmap": memmap_batched,
    "tokens": tokens_batched,
    "sequences": sequences_batched,
    "hf": hf,
}


def _webdataset_batched(root: Path, params: dict[str, Any], batch_size: int) -> Any:
    from torch.utils.data import default_collate

    # WebDataset's own batching, in the pipeline (each worker batches its shards), with
    # torch's collate so the batches are DataLoader's.
    return webdataset(root, params).batched(batch_size, collation_fn=default_collate)


TUNED = (*BATCHED, "webdataset")


def tuned_loader(
    name: str,
    root: Path,
    params: dict[str, Any],
    *,
    batch_size: int,
    shuffle: bool,
    generator: torch.Generator,
    cls: Callable[..., DataLoader[Any]] = DataLoader,
    **loader: Any,
) -> DataLoader[Any]:
    """The tuned DataLoader of reference ``name``; ``loader``: DataLoader's other
    arguments (num_workers, pin_memory, persistent_workers, prefetch_factor); ``cls``:
    the class called (``pinfeed.DataLoader``: the one-line switch of a tuned script)."""
    if name == "webdataset":
        ds = _webdataset_batched(root, params, batch_size)
        return cls(ds, batch_size=None, generator=generator, **loader)
    ds = BATCHED[name](root, params)
    base = RandomSampler(ds, generator=generator) if shuffle else SequentialSampler(ds)
    batches = BatchSampler(base, batch_size, drop_last=False)
    # The DataLoader's generator is the sampler's too, as DataLoader(shuffle=True,
    # generator=g) has it: the same base seed, then the same permutation.
    return cls(ds, batch_size=None, sampler=batches, generator=generator, **loader)
