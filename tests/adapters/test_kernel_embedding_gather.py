"""The input-embedding gather (ADR 0029), in Triton's interpreter on the CPU (on a GPU, from pinned host memory):
table[ids] bit for bit, repeats and the table's last row included; what it cannot copy is refused."""

import pytest
import torch

from adapters.kernels.embedding_gather import BLOCK_WORDS, gather_embedding_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("dtype", "width"), [(torch.bfloat16, 24), (torch.float32, 2 * BLOCK_WORDS + 4)])
def test_rows_are_gathered_bit_for_bit_in_id_order(ids_dtype, dtype, width):
    # width 2 * BLOCK_WORDS + 4 fp32: three programs a row, the last one partial
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(50, width, generator=gen).to(dtype)
    if DEVICE == "cuda":  # the kernel reads pinned host memory over PCIe (UVA)
        table = table.pin_memory()
    ids = torch.tensor([7, 0, 49, 7, 12], dtype=ids_dtype, device=DEVICE)
    got = gather_embedding_rows(table, ids)
    assert got.device.type == DEVICE and got.dtype == dtype and got.shape == (5, width)
    assert torch.equal(got.cpu(), table[ids.cpu()])
    assert gather_embedding_rows(table, ids[:0]).shape == (0, width)


def test_what_it_cannot_copy_is_refused():
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        gather_embedding_rows(torch.zeros(4, 6, dtype=torch.bfloat16), torch.tensor([0]))  # 12-byte rows
    with pytest.raises(ValueError, match="contiguous"):
        gather_embedding_rows(torch.zeros(8, 16).t(), torch.tensor([0]))
    with pytest.raises(ValueError, match="ids"):
        gather_embedding_rows(torch.zeros(4, 8), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="unit stride"):  # the kernel reads ids[t] at ids_ptr + t
        gather_embedding_rows(torch.zeros(4, 8), torch.tensor([[0, 1], [2, 3]])[:, 0])
