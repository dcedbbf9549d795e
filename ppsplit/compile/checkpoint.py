"""Driver support: reading a Hugging Face checkpoint tensor by tensor, and writing safetensors files one tensor at a time."""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.tensors import nbytes as tensor_bytes

ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}


class Checkpoint:
    """The safetensors shards of a checkpoint folder: which shard holds each tensor, and its header entry.

    Every shard header is read (and so validated) on construction; no tensor data is read until ``read``.
    """

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"{index} is not a readable safetensors index ({type(e).__name__}: {e}); "
                                  "re-save the checkpoint with save_pretrained") from None
            shards = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            shards = ["model.safetensors"]
            weight_map = None
        else:
            raise ConfigError(f"{folder} holds no safetensors weights (model.safetensors or "
                              "model.safetensors.index.json); save the model with save_pretrained(safe_serialization=True)")
        self.headers: dict[str, dict] = {}
        self._header_len: dict[str, int] = {}
        for shard in shards:
            self.headers[shard], self._header_len[shard] = _read_header(os.path.join(folder, shard))
        self.where: dict[str, str] = {}
        for shard, header in self.headers.items():
            for name in header:
                if name != "__metadata__":
                    self.where[name] = shard
        if weight_map is not None:
            for name, shard in weight_map.items():
                if self.where.get(name) != shard:
                    raise ConfigError(f"the index maps {name} to {shard}, but that shard does not hold it: the "
                                      "checkpoint is incomplete or corrupt; re-download or re-save it")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def raw_range(self, name: str) -> "RawRange":
        """Where ``name``'s bytes lie in its shard (offsets from the header validated on construction)."""
        shard = self.where[name]
        header = self.headers[shard]
        start, end = header[name]["data_offsets"]
        base = 8 + self._header_len[shard]
        return RawRange(os.path.join(self.folder, shard), base + start, end - start, header[name]["dtype"],
                        tuple(header[name]["shape"]))

    def read_one(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = os.path.join(self.folder, self.where[name])
        try:
            with safe_open(path, framework="pt") as f:
                return f.get_tensor(name)
        except (OSError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot read {self.where[name]}: {e}; the shard is corrupt or truncated, "
                              "re-download it") from None


def _read_header(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"shard {os.path.basename(path)} listed in the index is missing from "
                          f"{os.path.dirname(path)}; re-download the checkpoint")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"shard {os.path.basename(path)} is not a valid safetensors file ({e}); "
                          "re-download the checkpoint") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ConfigError(f"shard {os.path.basename(path)} is truncated ({size} bytes, header promises "
                          f"{8 + n + end}); re-download the checkpoint")
    return header, n


class RawRange:
    """A tensor's bytes in a safetensors shard, copied as they are when no dtype conversion is needed."""

    def __init__(self, path: str, offset: int, nbytes: int, dtype: str, shape: tuple):
        self.path, self.offset, self.nbytes, self.dtype, self.shape = path, offset, nbytes, dtype, shape

    def copy_to(self, out) -> None:
        with open(self.path, "rb") as src:
            offset, left = self.offset, self.nbytes
            try:
                while left:  # in the kernel, like cp: no page faults through a mapping, no Python buffers
                    done = os.copy_file_range(src.fileno(), out.fileno(), left, offset)
                    if done == 0:
                        raise OSError("unexpected end of shard")
                    offset, left = offset + done, left - done
            except (AttributeError, OSError):
                src.seek(offset)
                while left:
                    chunk = src.read(min(left, 64 << 20))
                    if not chunk:
                        raise ConfigError(f"{self.path} ended early; the shard is truncated, re-download it")
                    out.write(chunk)
                    left -= len(chunk)


def write_safetensors(path: str, entries: list[tuple[str, tuple, torch.dtype]],
                      tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict | None = None,
                      progress: Callable[[int], None] = lambda n: None) -> int:
    """Write a safetensors file whose header is known up front (``entries``: name, shape, dtype), consuming
    ``tensors`` one at a time in the same order: memory holds one tensor, never the file. Returns bytes written."""
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    sizes = []
    for name, shape, dtype in entries:
        nbytes = tensor_bytes(shape, dtype)
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        sizes.append(nbytes)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, shape, dtype), nbytes, (got, tensor) in zip(entries, sizes, tensors):
            if got != name or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"writing {name} {tuple(shape)}: got {got} {tuple(tensor.shape)}")
            if isinstance(tensor, RawRange):
                if tensor.dtype != ST_DTYPES[dtype] or tensor.nbytes != nbytes:
                    raise ValueError(f"{name}: stored as {tensor.dtype}, wanted {ST_DTYPES[dtype]}")
                f.flush()
                tensor.copy_to(f)
            else:
                data = tensor.detach().to(dtype).contiguous().view(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
            progress(nbytes)
    return 8 + len(raw) + offset
