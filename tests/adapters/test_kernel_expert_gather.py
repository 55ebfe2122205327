"""The UVA gather kernel (in Triton's interpreter on the CPU): rows land in their slots, padding and
untouched slots keep their bytes."""

import pytest
import torch

from adapters.kernels.expert_gather import CHUNK_BYTES, gather_rows

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
