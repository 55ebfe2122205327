"""`ft synth`: write a random checkpoint directory of a given geometry in any supported format.

Shape legend: H hidden, I expert intermediate, E experts, V vocab, C conv channels, Hv value heads.
Tensors are produced one at a time and written shard by shard, so the full Qwen3.6-35B-A3B
geometry (~35 GB in FP8) never sits in RAM. Small geometries quantize random float weights with
our own quantizer; large ones draw random codes directly in the quantized domain (same
on-disk layout, no float detour) because quantizing 10k experts on a CPU would take hours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapters.checkpoint.quant import MXFP4_GROUP, NVFP4_GROUP, QTensor, expected_parts
from adapters.checkpoint.quantize import disk_tensors, quantize
from adapters.checkpoint.synth_config import (
    FORMATS,
    GEOMETRIES,
    Geometry,
    config_json,
    generation_config,
    is_quantized_linear,
    module_variant,
)
from domain.model_spec import WeightFormat
from domain.quant_scheme import split_variant, variant_format

WEIGHT_STD = 0.02
DIRECT_THRESHOLD = 1024  # hidden sizes from here up draw quantized codes directly


# ---- what tensors a model has -------------------------------------------------------------------

def layer_tensors(g: Geometry, layer: int, kind: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(canonical name, shape, init) of one decoder layer, routed experts excluded."""
    p, h = f"layers.{layer}.", g.hidden_size
    norm = "zero_norm" if g.architecture == "qwen3_5_moe" else "one_norm"  # (1+w) RMSNorm starts at 0
    yield p + "input_layernorm.weight", (h,), norm
    yield p + "post_attention_layernorm.weight", (h,), norm
    if kind == "linear_attention":
        hv, key_dim = g.linear_num_value_heads, g.linear_num_key_heads * g.linear_key_head_dim
        value_dim = hv * g.linear_value_head_dim
        conv = 2 * key_dim + value_dim
        a = p + "linear_attn."
        yield a + "A_log", (hv,), "a_log"
        yield a + "dt_bias", (hv,), "ones"
        yield a + "conv1d.weight", (conv, 1, g.linear_conv_kernel_dim), "conv"
        yield a + "in_proj_qkv.weight", (conv, h), "linear"
        yield a + "in_proj_z.weight", (value_dim, h), "linear"
        yield a + "in_proj_a.weight", (hv, h), "linear"
        yield a + "in_proj_b.weight", (hv, h), "linear"
        yield a + "norm.weight", (g.linear_value_head_dim,), "one_norm"
        yield a + "out_proj.weight", (h, value_dim), "linear"
    else:
        q_width = g.num_attention_heads * g.head_dim
        gate = 2 if g.architecture == "qwen3_5_moe" else 1  # q_proj carries the output gate
        s = p + "self_attn."
        yield s + "q_proj.weight", (gate * q_width, h), "linear"
        yield s + "k_proj.weight", (g.num_key_value_heads * g.head_dim, h), "linear"
        yield s + "v_proj.weight", (g.num_key_value_heads * g.head_dim, h), "linear"
        yield s + "o_proj.weight", (h, q_width), "linear"
        yield s + "q_norm.weight", (g.head_dim,), norm
        yield s + "k_norm.weight", (g.head_dim,), norm
    yield p + "mlp.gate.weight", (g.num_experts, h), "linear"
    si = g.shared_expert_intermediate_size if g.architecture == "qwen3_5_moe" else 0
    if si:
        yield p + "mlp.shared_expert.gate_proj.weight", (si, h), "linear"
        yield p + "mlp.shared_expert.up_proj.weight", (si, h), "linear"
        yield p + "mlp.shared_expert.down_proj.weight", (h, si), "linear"
        yield p + "mlp.shared_expert_gate.weight", (1, h), "linear"


def init_tensor(shape: tuple[int, ...], init: str, gen: torch.Generator) -> torch.Tensor:
    """Random init drawn on the generator's device (the writer moves every tensor to the host)."""
    device = gen.device
    if init == "linear":
        return torch.randn(shape, generator=gen, device=device) * WEIGHT_STD
    if init == "embed":
        return torch.randn(shape, generator=gen, device=device)
    if init == "zero_norm":
        return torch.randn(shape, generator=gen, device=device) * 0.1
    if init == "one_norm":
        return 1.0 + torch.randn(shape, generator=gen, device=device) * 0.1
    if init == "a_log":
        return torch.log(torch.empty(shape, device=device).uniform_(1, 16, generator=gen))
    if init == "ones":
        return torch.ones(shape)
    if init == "conv":
        return torch.randn(shape, generator=gen, device=device) * 0.2
    raise ValueError(init)


# ---- direct random codes in the quantized domain -----------------------------------------------

def _every_byte(b: int) -> int:
    """int64 constant holding byte `b` in each of its 8 bytes (signed, as torch needs)."""
    return int.from_bytes(bytes([b]) * 8, "little", signed=True)


def random_words(numel: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [ceil(numel/8)] of uniform random bits: 8 random bytes per draw, so the byte-wise
    bit tricks below run on 8 bytes per element (the full geometry draws ~32 GB)."""
    words = torch.empty(-(-numel // 8), dtype=torch.int64, device=gen.device).random_(generator=gen)
    words ^= (words & _every_byte(0x01)) << 7  # random_ leaves each word's top bit 0; refill it
    return words


def _as_bytes(words: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    return words.view(torch.uint8)[:numel].reshape(shape)


def random_qtensor(fmt: WeightFormat, rows: int, cols: int, gen: torch.Generator) -> QTensor:
    """A valid QTensor whose dequantized values have std of order WEIGHT_STD, without floats."""
    parts = expected_parts(fmt, rows, cols)
    if fmt == WeightFormat.BF16:
        return QTensor(fmt, (rows, cols), (torch.randn(rows, cols, generator=gen, device=gen.device) * WEIGHT_STD).bfloat16())
    data_shape = parts["data"][1]
    words = random_words(data_shape[0] * data_shape[1], gen)
    scale_shape = parts["scale"][1]
    if fmt in (WeightFormat.FP8_BLOCK, WeightFormat.FP8_TENSOR, WeightFormat.FP8_CHANNEL):
        # per byte: keep sign and mantissa, force the exponent field into 4..7: |value| in [1/8, 2)
        exponent = (((words >> 3) & _every_byte(0x03)) + _every_byte(0x04)) << 3
        words = (words & _every_byte(0x87)) | exponent
        data = _as_bytes(words, data_shape).view(torch.float8_e4m3fn)
        return QTensor(fmt, (rows, cols), data, torch.full(scale_shape, WEIGHT_STD / 0.7))
    raw = _as_bytes(words, data_shape)
    if fmt == WeightFormat.INT8_CHANNEL:
        data = raw.view(torch.int8).clamp_(min=-127)
        return QTensor(fmt, (rows, cols), data, torch.full(scale_shape, WEIGHT_STD / 73.0))
    if fmt == WeightFormat.NVFP4:
        scale = torch.empty(scale_shape, device=gen.device).uniform_(0.5, 1.0, generator=gen).to(torch.float8_e4m3fn)
        glob = torch.tensor([2.0**-7])
        return QTensor(fmt, (rows, cols), raw, scale, glob)
    if fmt == WeightFormat.MXFP4:
        return QTensor(fmt, (rows, cols), raw, torch.full(scale_shape, 127 - 7, dtype=torch.uint8))
    raise ValueError(fmt)


# ---- streaming shard writer ---------------------------------------------------------------------

def _umask_file_mode() -> int:
    """The mode open() gives a new file under the process umask (0o644 under the usual 022)."""
    umask = os.umask(0)  # the only portable way to read it is to set it; put it straight back
    os.umask(umask)
    return 0o666 & ~umask


class ShardWriter:
    """Collects tensors and writes a shard whenever `shard_bytes` is reached.

    With `spill_dir`, a shard that would take the shards kept in `out_dir` past `max_out_bytes` is written to
    `spill_dir` instead and linked into `out_dir` by a symlink of its final name, so the checkpoint reads as one
    directory. Why: the lent GPU host has a 64 GiB disk and 128 GiB of RAM, and the full model in BF16 (~69 GB)
    fits neither alone, nor in RAM beside its own ~64 GiB pinned expert bank; split between the disk and
    /dev/shm it fits both (docs/gpu-validation.md, "BF16 on one GPU").
    """

    def __init__(self, out_dir: Path, shard_bytes: int, spill_dir: Path | None = None,
                 max_out_bytes: int | None = None):
        if (spill_dir is None) != (max_out_bytes is None):
            raise ValueError("spill_dir and max_out_bytes go together")
        if max_out_bytes is not None and max_out_bytes < 0:
            raise ValueError(f"max_out_bytes must be >= 0, got {max_out_bytes}")
        self.out_dir = out_dir
        self.shard_bytes = shard_bytes
        self.spill_dir = spill_dir
        self.max_out_bytes = max_out_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.shard_dirs: list[Path] = []  # where each shard's file is (out_dir or spill_dir)
        self.out_bytes = 0  # bytes of the shards written to out_dir itself
        self.total_bytes = 0
        self.file_mode = _umask_file_mode()  # read here, before any worker thread runs

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous().cpu()  # random draws may come from a GPU generator
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        where = self.out_dir
        if self.spill_dir is not None and self.out_bytes + self.pending_bytes > self.max_out_bytes:
            where = self.spill_dir
        else:
            self.out_bytes += self.pending_bytes
        tmp = where / f"shard-{len(self.shards):05d}.tmp"
        save_file(self.pending, tmp, metadata={"format": "pt"})
        # save_file writes through a private 0600 temp file; give the shard the mode config.json gets,
        # or a checkpoint one user made is unreadable to another
        tmp.chmod(self.file_mode)
        self.shards.append(sorted(self.pending))
        self.shard_dirs.append(where)
        self.pending, self.pending_bytes = {}, 0

    def _place(self, i: int, final_name: str) -> Path:
        """Rename shard i to its final name; a spilled shard gets a symlink of that name in out_dir."""
        where = self.shard_dirs[i]
        (where / f"shard-{i:05d}.tmp").rename(where / final_name)
        final = self.out_dir / final_name
        if where != self.out_dir:
            final.unlink(missing_ok=True)  # a previous run's link or file of that name
            final.symlink_to((where / final_name).resolve())
        return final

    def finish(self) -> list[Path]:
        self.flush()
        n = len(self.shards)
        if n == 1:
            return [self._place(0, "model.safetensors")]
        weight_map, paths = {}, []
        for i, names in enumerate(self.shards):
            final = self._place(i, f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            weight_map.update(dict.fromkeys(names, final.name))
            paths.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return paths


# ---- the synthesizer ----------------------------------------------------------------------------

class _TensorMaker:
    """Builds the (on-disk name, tensor) entries of each part of the model."""

    def __init__(self, g: Geometry, fmt: str, prefix: str, direct: bool, float_weights: dict | None):
        self.g, self.fmt, self.prefix, self.direct = g, fmt, prefix, direct
        self.float_weights = float_weights

    def linear(self, canonical: str, shape: tuple[int, ...], quantized: bool, gen) -> list[tuple[str, torch.Tensor]]:
        base = self.prefix + canonical[: -len(".weight")]
        if not quantized:
            return [(self.prefix + canonical, init_tensor(shape, "linear", gen).bfloat16())]
        variant = module_variant(self.fmt, canonical)
        block = split_variant(variant)[1] or (128, 128)
        if self.direct:  # random scales are constant, so any block shape holds them
            q = random_qtensor(variant_format(variant), shape[0], shape[1], gen)
        else:
            w = init_tensor(shape, "linear", gen)
            if self.float_weights is not None:
                self.float_weights[base] = w
            q = quantize(w, variant_format(variant), block=block)
        return [(f"{base}.{suffix}", t) for suffix, t in disk_tensors(q, variant).items()]

    def fused_nvfp4_experts(self, layer: int, gen) -> list[tuple[str, torch.Tensor]]:
        """compressed-tensors NVFP4 with fused experts: {gate_up,down}_proj_packed [E, O, I/2],
        _scale e4m3 [E, O, I/16], _global_scale fp32 [E, 1] (a divisor; gate and up share one)."""
        g, h, i = self.g, self.g.hidden_size, self.g.moe_intermediate_size
        out = []
        for matrix, shape in (("gate_up", (2 * i, h)), ("down", (h, i))):
            qs = []
            for e in range(g.num_experts):
                if self.direct:
                    qs.append(random_qtensor(WeightFormat.NVFP4, *shape, gen))
                    continue
                w = init_tensor(shape, "linear", gen)
                if self.float_weights is not None:
                    self.float_weights[f"{self.prefix}layers.{layer}.mlp.experts.{e}.{matrix}_proj"] = w
                qs.append(quantize(w, WeightFormat.NVFP4))
            p = f"{self.prefix}layers.{layer}.mlp.experts.{matrix}_proj"
            out += [(p + "_packed", torch.stack([q.data for q in qs])),
                    (p + "_scale", torch.stack([q.scale for q in qs])),
                    (p + "_global_scale", torch.stack([1.0 / q.global_scale for q in qs]))]  # [E, 1]
        return out

    def embeddings(self, gen) -> list[tuple[str, torch.Tensor]]:
        g = self.g
        return [(self.prefix + "embed_tokens.weight", init_tensor((g.vocab_size, g.hidden_size), "embed", gen).bfloat16())]

    def layer(self, layer: int, experts: str, gen) -> list[tuple[str, torch.Tensor]]:
        g, fmt, out = self.g, self.fmt, []
        for name, shape, init in layer_tensors(g, layer, g.layer_types[layer]):
            if init == "linear":
                out += self.linear(name, shape, fmt != "bf16" and is_quantized_linear(name), gen)
            else:
                dtype = torch.float32 if init == "a_log" else torch.bfloat16
                out.append((self.prefix + name, init_tensor(shape, init, gen).to(dtype)))
        h, i, p = g.hidden_size, g.moe_intermediate_size, f"layers.{layer}.mlp.experts"
        if experts == "fused" and fmt == "nvfp4_ct":
            return out + self.fused_nvfp4_experts(layer, gen)
        if experts == "fused":
            gate_up = (torch.randn(g.num_experts, 2 * i, h, generator=gen, device=gen.device)
                       * WEIGHT_STD).bfloat16()  # [E, 2I, H]
            down = (torch.randn(g.num_experts, h, i, generator=gen, device=gen.device) * WEIGHT_STD).bfloat16()  # [E, H, I]
            return out + [(f"{self.prefix}{p}.gate_up_proj", gate_up), (f"{self.prefix}{p}.down_proj", down)]
        for e in range(g.num_experts):
            out += self.linear(f"{p}.{e}.gate_proj.weight", (i, h), fmt != "bf16", gen)
            out += self.linear(f"{p}.{e}.up_proj.weight", (i, h), fmt != "bf16", gen)
            out += self.linear(f"{p}.{e}.down_proj.weight", (h, i), fmt != "bf16", gen)
        return out

    def mtp(self, experts: str, gen) -> list[tuple[str, torch.Tensor]]:
        """The multi-token-prediction block as Qwen3-Next / Qwen3.5 / Qwen3.6 checkpoints store it, at
        the top level (``mtp.*``, outside ``model.``) in both layouts: ``mtp.fc`` [H, 2H] (projects
        [embedding; hidden] back to H), three (1+w) RMSNorms, and ``mtp.layers.0.*``, one
        full-attention decoder layer with the same MoE as the trunk, in the checkpoint's format.
        llama.cpp's converter maps them to its nextn tensors (blk.L.nextn.eh_proj, ...); the
        transformers models and our loader ignore them."""
        g, h = self.g, self.g.hidden_size
        out = [("mtp.fc.weight", init_tensor((h, 2 * h), "linear", gen).bfloat16())]
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out.append((f"mtp.{norm}.weight", init_tensor((h,), "zero_norm", gen).bfloat16()))
        block = _TensorMaker(replace(g, num_hidden_layers=1, full_attention_interval=1), self.fmt, "mtp.",
                             self.direct, None)  # one full-attention layer; no float originals kept
        return out + block.layer(0, experts, gen)

    def head(self, gen) -> list[tuple[str, torch.Tensor]]:
        g = self.g
        norm = "zero_norm" if g.architecture == "qwen3_5_moe" else "one_norm"
        return [(self.prefix + "norm.weight", init_tensor((g.hidden_size,), norm, gen).bfloat16()),
                ("lm_head.weight", init_tensor((g.vocab_size, g.hidden_size), "linear", gen).bfloat16())]


def _ordered_parallel(fn, count: int, workers: int) -> Iterator:
    """fn(0..count-1) on a thread pool, yielded in order, at most `workers` results in flight
    (bounds memory: each result is a whole layer)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for index in range(count):
            pending.append(pool.submit(fn, index))
            if len(pending) >= workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def synthesize(
    out_dir: str | Path,
    geometry: Geometry | str = "tiny",
    fmt: str = "bf16",
    seed: int = 0,
    layout: str = "nested",
    experts: str = "per_expert",
    shard_bytes: int = 2 << 30,
    tokenizer: bool = True,
    direct: bool | None = None,
    progress: bool = False,
    float_weights: dict[str, torch.Tensor] | None = None,
    device: str = "cpu",
    mtp: bool = True,
    spill_dir: str | Path | None = None,
    max_out_bytes: int | None = None,
) -> Path:
    """Write config.json, safetensors shards (+ index), generation_config.json and, with
    `tokenizer`, tokenizer.json + tokenizer_config.json into `out_dir`. Returns out_dir.

    A qwen3_5_moe geometry also gets the MTP block real checkpoints carry (``mtp.*``, one layer,
    declared by ``mtp_num_hidden_layers: 1``; see `_TensorMaker.mtp`) unless `mtp` is False, in
    which case the config declares 0 MTP layers. Its random draws come from their own generator
    after everything else, so the other tensors are the same bytes with and without it.

    `float_weights`, when given, receives the float original of every quantized linear (keyed
    by its on-disk base name) so tests can measure the quantization error end to end.

    `device` is where the random codes of the direct (large-geometry) path are drawn: the CPU
    generator needs ~20 ms per 1M-element matrix (~10 min for the full model's 30k expert
    matrices), a CUDA one a fraction of that. A seed reproduces a checkpoint on the same device
    kind only. The quantize-from-float path (small geometries) always runs on the CPU.

    `spill_dir` with `max_out_bytes`: shards past `max_out_bytes` of `out_dir` are written to `spill_dir` and
    symlinked into `out_dir` (ShardWriter); the bytes are the same as without.
    """
    g = GEOMETRIES[geometry] if isinstance(geometry, str) else geometry
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if experts not in ("per_expert", "fused"):
        raise ValueError(f"experts must be 'per_expert' or 'fused', got {experts!r}")
    _check_fused(fmt, experts)
    if layout == "nested" and g.architecture != "qwen3_5_moe":
        layout = "flat"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    direct = g.hidden_size >= DIRECT_THRESHOLD if direct is None else direct
    prefix = "model.language_model." if layout == "nested" else "model."
    spill = None
    if spill_dir is not None:
        spill = Path(spill_dir)
        spill.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, shard_bytes, spill, max_out_bytes)
    started = time.monotonic()
    make = _TensorMaker(g, fmt, prefix, direct, float_weights)
    draw_on = device if direct else "cpu"
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    for name, t in make.embeddings(gen):
        writer.add(name, t)
    if direct:
        # independent per-layer generators: layers are built in parallel and still deterministic;
        # at most 4 layers in flight (~0.8 GB each in FP8) bound the RSS
        layers = _ordered_parallel(lambda layer: make.layer(layer, experts, torch.Generator(draw_on).manual_seed(
            seed * 1_000_003 + layer + 1)), g.num_hidden_layers, workers=max(1, min(4, (os.cpu_count() or 2) - 1)))
    else:
        layers = (make.layer(layer, experts, gen) for layer in range(g.num_hidden_layers))
    for layer, entries in enumerate(layers):
        for name, t in entries:
            writer.add(name, t)
        if progress:
            print(f"  layer {layer + 1}/{g.num_hidden_layers}  {writer.total_bytes / 2**30:.2f} GiB  "
                  f"{time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    for name, t in make.head(gen):
        writer.add(name, t)
    mtp_layers = 1 if mtp and g.architecture == "qwen3_5_moe" else 0
    if mtp_layers:
        mtp_gen = torch.Generator(draw_on).manual_seed(seed * 1_000_003 + g.num_hidden_layers + 1)
        for name, t in make.mtp(experts, mtp_gen):
            writer.add(name, t)
    writer.finish()

    (out / "config.json").write_text(json.dumps(config_json(g, fmt, layout, mtp_layers), indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2))
    if tokenizer:
        from adapters.checkpoint.hf_tokenizer import write_tokenizer_files

        write_tokenizer_files(out)
    return out


def _check_fused(fmt: str, experts: str) -> None:
    if experts == "fused" and fmt not in ("bf16", "nvfp4_ct"):
        raise ValueError("fused experts are written in bf16 or compressed-tensors nvfp4_ct only")


def _check_divisible(g: Geometry, fmt: str) -> None:
    group = {"nvfp4_modelopt": NVFP4_GROUP, "nvfp4_ct": NVFP4_GROUP, "mxfp4_ct": MXFP4_GROUP,
             "mixed_modelopt": NVFP4_GROUP, "mixed_ct": NVFP4_GROUP}.get(fmt)
    if group and (g.hidden_size % group or g.moe_intermediate_size % group):
        raise ValueError(f"{fmt} needs hidden and intermediate sizes divisible by {group}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ft synth", description="Write a random checkpoint in a given format.")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--geometry", default="tiny", choices=sorted(GEOMETRIES))
    parser.add_argument("--format", default="bf16", choices=FORMATS, dest="fmt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default="nested", choices=("nested", "flat"))
    parser.add_argument("--experts", default="per_expert", choices=("per_expert", "fused"))
    parser.add_argument("--shard-gb", type=float, default=2.0, help="shard size in GiB (> 0)")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the geometry's vocabulary")
    parser.add_argument("--no-tokenizer", action="store_true")
    parser.add_argument("--no-mtp", action="store_true",
                        help="leave out the MTP block (mtp.*) that qwen3_5_moe checkpoints carry; the config "
                             "then declares mtp_num_hidden_layers: 0")
    parser.add_argument("--spill-dir", type=Path, default=None,
                        help="write the shards that would take --out past --max-out-gb here (e.g. /dev/shm/x), "
                             "symlinked into --out: a checkpoint larger than one disk")
    parser.add_argument("--max-out-gb", type=float, default=None,
                        help="GiB of shards kept in --out itself (needs --spill-dir)")
    parser.add_argument("--device", default="cpu",
                        help="where to draw the random weights of large geometries (cpu | cuda | cuda:N)")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        parser.error(f"--device {args.device}: no such device here (cpu, or cuda on a CUDA host)")
    if not 0 < args.shard_gb < math.inf:  # NOTE: False for nan
        parser.error(f"--shard-gb must be a positive number of GiB, got {args.shard_gb}")
    if (args.spill_dir is None) != (args.max_out_gb is None):
        parser.error("--spill-dir and --max-out-gb go together")
    if args.max_out_gb is not None and not 0 <= args.max_out_gb < math.inf:
        parser.error(f"--max-out-gb must be a number of GiB >= 0, got {args.max_out_gb}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: not a directory")
    g = GEOMETRIES[args.geometry]
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            parser.error(f"--vocab-size must be >= 1, got {args.vocab_size}")
        g = replace(g, vocab_size=args.vocab_size)
    if not args.no_tokenizer:
        from adapters.checkpoint.hf_tokenizer import tokenizer_rows

        if g.vocab_size < tokenizer_rows():
            parser.error(f"--vocab-size {g.vocab_size}: the Qwen3.6 tokenizer written beside the weights has ids up to "
                         f"{tokenizer_rows() - 1}, past the embedding; give at least {tokenizer_rows()} or add "
                         "--no-tokenizer")
    try:
        _check_divisible(g, args.fmt)
        _check_fused(args.fmt, args.experts)
    except ValueError as exc:
        parser.error(str(exc))
    started = time.monotonic()
    try:
        synthesize(args.out, g, args.fmt, args.seed, args.layout, args.experts,
                   shard_bytes=max(1, int(args.shard_gb * 2**30)), tokenizer=not args.no_tokenizer, progress=True,
                   device=args.device, mtp=not args.no_mtp, spill_dir=args.spill_dir,
                   max_out_bytes=None if args.max_out_gb is None else int(args.max_out_gb * 2**30))
    except OSError as exc:  # the folder cannot be made or written (disk full, permissions): the machine's, not ours
        parser.exit(1, f"ft synth: error: {exc}\n")
    shards = list(args.out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards)
    spilled = sum(f.stat().st_size for f in shards if f.is_symlink())
    print(f"wrote {args.out} ({args.geometry}, {args.fmt}): {size / 2**30:.2f} GiB in "
          f"{time.monotonic() - started:.1f}s" + (f" ({spilled / 2**30:.2f} GiB of it in {args.spill_dir})"
                                                  if args.spill_dir else ""))
    return 0

