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


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, tokenizer_config.json, ...) as a dict; ValueError naming the
    file when it is not JSON or not an object (json's own message names neither file nor fix)."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(value).__name__}")
    return value


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where tensor data starts)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if 8 + header_len > size:
            raise ValueError(f"{path}: header says {header_len} bytes but the file has {size}: truncated or "
                             f"not a safetensors file")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + header_len


def read_entries(path: Path) -> dict[str, TensorEntry]:
    """Every tensor's entry, each checked against the file before anything is read: known dtype,
    byte length = shape x element size, data inside the file, no two tensors sharing bytes.
    A truncated download fails here naming the file and the first tensor cut off."""
    header, data_start = read_header(path)
    size = path.stat().st_size
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name}: malformed header entry {info!r} ({e})") from None
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        numel = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"{path}: tensor {name} has a negative dimension in shape {shape}")
            numel *= d
        want = numel * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end or end - begin != want:
            raise ValueError(f"{path}: tensor {name}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                             f"{info['dtype']} {list(shape)} needs {want}")
        if data_start + end > size:
            raise ValueError(f"{path}: tensor {name} ends at byte {data_start + end} but the file has {size} bytes "
                             f"(truncated download?)")
        entries[name] = TensorEntry(name, path, dtype, shape, data_start + begin, data_start + end)
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise ValueError(f"{path}: tensors {name_a} and {name_b} overlap in the file")
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
            weight_map = read_json_object(index).get("weight_map")
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
