"""Reading single tensors out of a model's safetensors files, by name.

A rank of the distributed runtime holds a part of the model: it reads only the bytes of the
tensors it keeps (with plain reads into the final buffers: no memory map whose touched pages would
count in the process's resident memory, no second copy), and a few sampled elements of others
(the target's fingerprint). The format: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the data.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spd.data.files import read_safetensors_header
from spd.errors import SPDError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# Whole tensors up to this size are read at once to sample them; larger ones element by element.
_SAMPLE_READ_ALL = 4 << 20


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class WeightFiles:
    """The tensors of a folder's *.safetensors files (headers read at construction)."""

    def __init__(self, files: list[Path]):
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            n, header = read_safetensors_header(path)
            for name, v in header.items():
                if name == "__metadata__":
                    continue
                if v["dtype"] not in _DTYPES:
                    raise SPDError(f"{path}: tensor {name} has dtype {v['dtype']}, which is not "
                                   "supported here")
                begin, end = (int(x) for x in v["data_offsets"])
                self.entries[name] = TensorEntry(path, _DTYPES[v["dtype"]], tuple(v["shape"]),
                                                 8 + n + begin, end - begin)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def key(self, name: str) -> str | None:
        """The stored name of the model's parameter `name`: itself, or without the "model."
        prefix (a checkpoint of the bare decoder), or under "model.language_model." (a
        vision-language checkpoint's text model), or None when the files do not hold it."""
        if name in self.entries:
            return name
        bare = name.removeprefix("model.")
        if bare == name:
            return None
        return next((k for k in (bare, "model.language_model." + bare) if k in self.entries),
                    None)

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """Fill `dst` (the tensor's shape; any dtype and device) with the stored tensor. Straight
        into dst when it is a contiguous CPU tensor of the file's dtype, else via one temporary."""
        e = self.entries[name]
        if tuple(dst.shape) != e.shape:
            raise SPDError(f"{e.file}: {name} has shape {list(e.shape)}, the model expects "
                           f"{list(dst.shape)}")
        direct = dst.device.type == "cpu" and dst.dtype == e.dtype and dst.is_contiguous()
        buf = dst if direct else torch.empty(e.shape, dtype=e.dtype)
        if e.nbytes:
            view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
            got = 0
            with open(e.file, "rb", buffering=0) as f:
                f.seek(e.offset)
                while got < e.nbytes:  # one read returns at most ~2 GB
                    step = f.readinto(view[got:])
                    if not step:
                        raise SPDError(f"{e.file} is truncated: {name} needs {e.nbytes} bytes, "
                                       f"read {got}")
                    got += step
        if not direct:
            dst.copy_(buf)

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_into(name, out)
        return out

    def sample(self, name: str, count: int) -> torch.Tensor:
        """flat[::max(1, numel // count)][:count] of the stored tensor, in its own dtype, reading
        only those elements of a large tensor."""
        e = self.entries[name]
        step = max(1, e.numel // count)
        idx = range(0, e.numel, step)[:count]
        if e.nbytes <= _SAMPLE_READ_ALL:
            return self.read(name).reshape(-1)[::step][:count].clone()
        size = e.nbytes // e.numel
        fd = os.open(e.file, os.O_RDONLY)
        try:
            raw = b"".join(os.pread(fd, size, e.offset + i * size) for i in idx)
        finally:
            os.close(fd)
        return torch.frombuffer(bytearray(raw), dtype=e.dtype).clone()
