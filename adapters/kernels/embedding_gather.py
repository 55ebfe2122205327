"""Input-embedding rows from a table in host memory: out[t] = table[ids[t]] in one launch (ADR 0029).

Shape legend: V table rows (vocabulary), H row width, T tokens of the step, W = H * itemsize / 4 words a row.

On CUDA the decoder keeps embed_tokens in pinned host memory (adapters/checkpoint/loader.hosts_embedding); a step
reads one row per token through unified virtual addressing (4 KiB at H = 2048 in bf16). The launch has a static
grid and no host sync, so the captured decode graphs hold it like any kernel. Its own kernel (not the expert miss
gather's): rows of a few KiB want a tile of the row, not 64 KiB chunks, and profiles tell the two apart (an
embedding read is not a miss).
"""

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 256  # int32 words a program copies: 1 KiB, so a 4 KiB row is 4 programs


@triton.jit
def _embedding_gather_kernel(table_ptr, ids_ptr, out_ptr, row_words, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(ids_ptr + token).to(tl.int64)  # NOTE: int64 offsets: V x W passes 2**31 words past 8 GiB
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    words = tl.load(table_ptr + row * row_words + offs, mask=mask)
    tl.store(out_ptr + token.to(tl.int64) * row_words + offs, words, mask=mask)


def gather_embedding_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] on ids' device: [T, H] of table's dtype, a new tensor.

    table: [V, H] contiguous, rows of a multiple of 16 bytes, in pinned host memory (or any memory the kernel can
    address); ids: int32/int64 [T] with unit stride, each in [0, V) (not checked: a check would sync the device).
    Raises ValueError on a table that is not 2-D and contiguous or whose rows are not a multiple of 16 bytes, and on
    ids that are not a 1-D integer tensor of unit stride."""
    if table.dim() != 2 or not table.is_contiguous() or table.shape[1] * table.element_size() % 16:
        raise ValueError(f"table must be a contiguous [V, H] with rows of a multiple of 16 bytes, got "
                         f"{table.dtype} {tuple(table.shape)}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.numel() > 1 and ids.stride(0) != 1:
        raise ValueError(f"ids must be int32/int64 [T] with unit stride, got {ids.dtype} {tuple(ids.shape)} "
                         f"stride {ids.stride()}")
    out = torch.empty((ids.shape[0], table.shape[1]), dtype=table.dtype, device=ids.device)
    if ids.shape[0] == 0:
        return out
    row_words = table.shape[1] * table.element_size() // 4
    _embedding_gather_kernel[(ids.shape[0], triton.cdiv(row_words, BLOCK_WORDS))](
        table.view(torch.int32), ids, out.view(torch.int32), row_words, BLOCK=BLOCK_WORDS)
    return out
