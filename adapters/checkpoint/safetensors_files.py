"""Read-only, zero-copy access to the tensors of one or more .safetensors files.

We parse the headers ourselves (8-byte little-endian length + JSON) and memory-map the
files, so shapes and dtypes of every tensor are known before anything is allocated and
worker threads can read tensors concurrently without sharing a file handle.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8),
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        try:
            header = json.loads(f.read(header_len))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
    return header, 8 + header_len


def read_entries(path: Path) -> dict[str, TensorEntry]:
    header, data_start = read_header(path)
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries[name] = TensorEntry(name, path, dtype, tuple(info["shape"]), data_start + begin, data_start + end)
    return entries


class SafetensorsFiles:
    """All tensors of a checkpoint directory, by name, read through shared memory maps."""

    def __init__(self, entries: dict[str, TensorEntry]):
        self.entries = entries
        self._maps: dict[Path, mmap.mmap] = {}
        for path in sorted({e.file for e in entries.values()}):
            with open(path, "rb") as f:
                # ACCESS_COPY: readable and privately writable, so torch.frombuffer gets a
                # writable buffer without ever touching the file.
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    @classmethod
    def open_dir(cls, model_dir: Path) -> SafetensorsFiles:
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: missing 'weight_map'")
            files = sorted({model_dir / f for f in weight_map.values()})
            for f in files:
                if not f.exists():
                    raise FileNotFoundError(f"{index}: weight_map names {f.name}, which does not exist")
        else:
            files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
        entries: dict[str, TensorEntry] = {}
        for f in files:
            for name, entry in read_entries(f).items():
                if name in entries:
                    raise ValueError(f"tensor {name} appears in both {entries[name].file.name} and {f.name}")
                entries[name] = entry
        return cls(entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> torch.Tensor:
        """A zero-copy tensor backed by the file mapping (copy it before mutating)."""
        e = self.entries[name]
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=e.dtype)
        buf = self._maps[e.file]
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=e.end - e.begin, offset=e.begin)
        return raw.view(e.dtype).reshape(e.shape)

    def close(self) -> None:
        """Unmap the files; a mapping still referenced by a live tensor stays open until GC."""
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass
        self._maps.clear()
