"""The UVA gather kernel (in Triton's interpreter on the CPU): rows land in their slots, padding and
untouched slots keep their bytes."""

import pytest
import torch

from adapters.kernels.expert_gather import CHUNK_BYTES, gather_rows, gather_table_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_gather_copies_rows_into_slots_and_skips_padding():
    gen = torch.Generator().manual_seed(0)
    row_bytes = CHUNK_BYTES + 48  # two chunks, the second one partial
    bank = torch.randint(0, 256, (6, row_bytes), dtype=torch.uint8, generator=gen)
    if DEVICE == "cuda":  # the kernel reads pinned host memory over PCIe (UVA)
        bank = bank.pin_memory()
    slots = torch.randint(0, 256, (4, row_bytes), dtype=torch.uint8, generator=gen).to(DEVICE)
    before = slots.clone()
    gather_rows(bank, slots, torch.tensor([4, -1, 1], device=DEVICE), torch.tensor([2, -1, 0], device=DEVICE))
    slots, before = slots.cpu(), before.cpu()
    assert torch.equal(slots[2], bank[4]) and torch.equal(slots[0], bank[1])
    assert torch.equal(slots[1], before[1]) and torch.equal(slots[3], before[3])


def test_gather_refuses_mismatched_rows():
    with pytest.raises(ValueError, match="row bytes"):
        gather_rows(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 48, dtype=torch.uint8),
                    torch.tensor([0]), torch.tensor([0]))


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_table_rows_are_gathered_bit_for_bit_in_id_order(ids_dtype, dtype):
    # the input embedding a CUDA decoder keeps in host memory: table[ids] for a step's tokens, repeats included
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(50, 24, generator=gen).to(dtype)  # 24 x 2 = 48 bytes a bf16 row: a multiple of 16
    if DEVICE == "cuda":
        table = table.pin_memory()
    ids = torch.tensor([7, 0, 49, 7, 12], dtype=ids_dtype, device=DEVICE)
    got = gather_table_rows(table, ids)
    assert got.device.type == DEVICE and got.dtype == dtype and got.shape == (5, 24)
    assert torch.equal(got.cpu(), table[ids.cpu()])
    assert gather_table_rows(table, ids[:0]).shape == (0, 24)


def test_table_gather_refuses_what_it_cannot_copy():
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        gather_table_rows(torch.zeros(4, 6, dtype=torch.bfloat16), torch.tensor([0]))  # 12-byte rows
    with pytest.raises(ValueError, match="contiguous"):
        gather_table_rows(torch.zeros(8, 16).t(), torch.tensor([0]))
    with pytest.raises(ValueError, match="ids"):
        gather_table_rows(torch.zeros(4, 8), torch.tensor([0.0]))
