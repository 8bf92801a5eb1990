"""Durable file primitives: a streaming safetensors writer that checksums as it writes, fsync'd
atomic text files, and the folder names of a checkpoint directory.

The writer follows the published safetensors layout (github.com/huggingface/safetensors, "Format"):
an 8-byte little-endian header length, a JSON header mapping each name to dtype, shape and byte
offsets (padded with spaces to a multiple of 8), then the raw little-endian bytes. Writing it here
instead of calling `safetensors.torch.save_file` lets a file be produced one tensor at a time (peak
memory: one tensor), hashed on the way out and fsync'd before anyone is told it exists.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
from typing import Iterable, Optional

import torch

from engine.config import ConfigError

LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
_STALE_RE = re.compile(r"^(iter_\d{7}\.(tmp|deleting\d+)|" + re.escape(LATEST_FILE) + r"\.tmp\d+)$")

DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in DTYPE_CODES}
_CODE_DTYPES = {code: d for d, code in DTYPE_CODES.items()}


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_safetensors(path: str, specs: list, tensors: Iterable, metadata: Optional[dict] = None) -> str:
    """Write `tensors` ((name, tensor) pairs, in the order of `specs`: (name, dtype, shape)); fsync; return sha256.

    The header is written first from `specs`, so each tensor can be produced and dropped in turn.
    """
    header, offset = {}, 0
    for name, dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        def put(data):
            fh.write(data)
            digest.update(data)
        put(struct.pack("<Q", len(raw)))
        put(raw)
        expected = iter(specs)
        for name, t in tensors:
            want_name, want_dtype, want_shape = next(expected)
            if name != want_name or t.dtype != want_dtype or tuple(t.shape) != tuple(want_shape):
                raise ValueError(f"{path}: tensor {name} {t.dtype} {tuple(t.shape)} does not match its header entry "
                                 f"{want_name} {want_dtype} {tuple(want_shape)}")
            put(_tensor_bytes(t))
            del t  # keep at most one produced tensor alive
        if next(expected, None) is not None:
            raise ValueError(f"{path}: fewer tensors than header entries")
        fh.flush()
        os.fsync(fh.fileno())
    return digest.hexdigest()


class TensorFile:
    """Reads tensors, or row ranges of them, from a safetensors file with plain reads.

    Plain reads rather than safetensors' mmap: mapped pages would stay in the process's resident
    set until the file is closed, so a merge of the whole model would look (and be counted) as large
    as the model. Here memory is exactly the tensors asked for.
    """

    def __init__(self, path: str):
        self.path = path
        self._fh = open(path, "rb", buffering=0)
        try:
            (size,) = struct.unpack("<Q", self._fh.read(8))
            header = json.loads(self._fh.read(size))
        except (struct.error, ValueError):
            raise ConfigError(f"{path} is not a readable safetensors file (damaged header)") from None
        header.pop("__metadata__", None)
        self.entries, self._start = header, 8 + size

    def keys(self) -> list:
        return list(self.entries)

    def shape(self, key: str) -> tuple:
        return tuple(self.entries[key]["shape"])

    def read(self, key: str, axis: Optional[int] = None, lo: Optional[int] = None, hi: Optional[int] = None):
        """The tensor `key`, or its slice [lo, hi) along `axis`."""
        entry = self.entries[key]
        dtype, shape = _CODE_DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        if axis is None or (lo, hi) == (0, shape[axis]):
            return self._read_bytes(begin, end - begin).view(dtype).view(shape)
        if torch.Size(shape[:axis]).numel() == 1:  # a contiguous block of rows
            row = (end - begin) // shape[axis]
            out_shape = shape[:axis] + [hi - lo] + shape[axis + 1:]
            return self._read_bytes(begin + lo * row, (hi - lo) * row).view(dtype).view(out_shape)
        whole = self._read_bytes(begin, end - begin).view(dtype).view(shape)
        return whole.narrow(axis, lo, hi - lo).contiguous()

    def _read_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        self._fh.seek(self._start + offset)
        while done < nbytes:
            got = self._fh.readinto(view[done:])
            if not got:
                raise ConfigError(f"{self.path} is truncated (a tensor runs past the end of the file)")
            done += got
        return out


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_text_atomic(path: str, text: str) -> None:
    """Temporary file, fsync, rename over `path`, fsync the folder: readers see the old or the new text."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_durable(path: str, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def write_json_atomic(path: str, obj) -> None:
    """Durable, and never seen half written by a reader polling for `path`."""
    write_json_durable(path + ".part", obj)
    os.replace(path + ".part", path)


def read_latest(save_dir: str) -> Optional[int]:
    path = os.path.join(save_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    return int(text) if text.isdigit() else None


def list_iterations(save_dir: str) -> list:
    """Iterations with a finished folder (renamed into place), ascending; contents are not checked here."""
    if not os.path.isdir(save_dir):
        return []
    found = [int(m.group(1)) for m in map(_ITER_RE.match, os.listdir(save_dir)) if m]
    return sorted(i for i in found if os.path.isdir(os.path.join(save_dir, iter_dir_name(i))))


def remove_tree(path: str) -> None:
    """Rename out of the checkpoint namespace first, so a crash mid-delete leaves nothing that looks like one."""
    if not os.path.exists(path):
        return
    doomed = f"{path}.deleting{os.getpid()}"
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale(save_dir: str) -> None:
    """Leftovers of saves or deletions that a crash interrupted (only names this module makes)."""
    for name in os.listdir(save_dir):
        if _STALE_RE.match(name):
            path = os.path.join(save_dir, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


@contextlib.contextmanager
def staged(out_dir: str, iteration: int):
    """The `iter_N.tmp` folder a converter writes one iteration into, in an `out_dir` that holds no checkpoint
    (else one ConfigError line); on any failure the folder goes, and `out_dir` too when this made it, so a
    failed conversion leaves nothing. The converter publishes the folder itself (saver.publish)."""
    if read_latest(out_dir) is not None or list_iterations(out_dir):
        raise ConfigError(f"--out {out_dir}: already holds a checkpoint; give a new directory")
    made = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    remove_stale(out_dir)
    tmp = os.path.join(out_dir, iter_dir_name(iteration) + ".tmp")
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
