"""host_staging.PinnedStaging: the bookkeeping on the CPU with plain memory and hand-written fake events (a
buffer is reused only once its copy is done, grows, bounds the copies in flight, survives two threads), the
CPU paths of step_inputs.upload and step_plan.upload_aligned, and on a GPU uploads queued behind long kernels."""

import sys
import threading
import time

import pytest
import torch

from adapters.cuda_exec.step_plan import upload_aligned
from adapters.torch_exec.host_staging import ALIGN, PinnedStaging, layout
from adapters.torch_exec.step_inputs import upload


class FakeEvent:
    """Pending from record() until the test finishes it (or synchronize() does)."""

    def __init__(self, events: "FakeEvents"):
        self.events = events
        self.done = True  # an event never recorded is done, as a CUDA event is
        self.records = 0

    def record(self, stream=None):
        self.done = self.events.auto_done
        self.records += 1
        self.events.log.append((self, self.records))

    def query(self) -> bool:
        if self.events.yield_in_query:
            time.sleep(0)  # lets the other thread run here, as a real query that drops the GIL may
        return self.done

    def synchronize(self) -> None:
        self.events.syncs += 1
        self.done = True


class FakeEvents:
    """The event factory: every event it made, and how many synchronize() calls waited."""

    def __init__(self, auto_done: bool = False):
        self.auto_done = auto_done  # True: a copy is done as soon as it is queued (a device that keeps up)
        self.yield_in_query = False
        self.made: list[FakeEvent] = []
        self.log: list[tuple[FakeEvent, int]] = []  # (event, its record count) per record(), in order
        self.syncs = 0

    def __call__(self) -> FakeEvent:
        e = FakeEvent(self)
        self.made.append(e)
        return e

    def finish_all(self) -> None:
        for e in self.made:
            e.done = True

    def finish(self, k: int) -> None:
        """The k-th copy is done (its event, unless recorded again since: then that later copy is pending)."""
        e, n = self.log[k]
        if e.records == n:
            e.done = True


class FakeAlloc:
    """Plain (unpinned) host memory, every buffer kept so a test can read what was written into it."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.fail = False

    def __call__(self, n: int) -> torch.Tensor:
        if self.fail:
            raise MemoryError("no pinned memory")
        b = torch.full((n,), 0xAB, dtype=torch.uint8)
        self.buffers.append(b)
        return b


def pool(max_in_flight=16, min_bytes=1024, auto_done=False):
    alloc, events = FakeAlloc(), FakeEvents(auto_done)
    return PinnedStaging("cpu", alloc=alloc, make_event=events, max_in_flight=max_in_flight,
                         min_bytes=min_bytes), alloc, events


def random_parts(gen: torch.Generator, count: int, max_elems: int) -> list[torch.Tensor]:
    """Integer tensors of mixed dtypes and shapes, some non-contiguous, some empty."""
    dtypes = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool]
    parts = []
    for _ in range(count):
        dt = dtypes[int(torch.randint(len(dtypes), (), generator=gen))]
        n = int(torch.randint(0, max_elems + 1, (), generator=gen))
        t = torch.randint(0, 100, (n,), generator=gen).to(dt)
        if n >= 6 and n % 2 == 0:
            t = t.view(2, -1).t()  # non-contiguous [n/2, 2]
        parts.append(t)
    return parts


def test_views_equal_their_parts_each_at_a_multiple_of_16_bytes_of_one_buffer():
    staging, alloc, _ = pool()
    parts = [torch.arange(3, dtype=torch.int64), torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32).t(),
             torch.tensor([7], dtype=torch.uint8), torch.zeros(0, 4, dtype=torch.int32),
             torch.tensor(9, dtype=torch.int16), torch.tensor([True, False, True])]
    out = staging.upload(parts)
    base = out[0].untyped_storage().data_ptr()
    for v, t in zip(out, parts, strict=True):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
        assert v.untyped_storage().data_ptr() == base  # one device buffer
        assert (v.data_ptr() - base) % ALIGN == 0
    offsets, total = layout(parts)
    assert offsets == [0, 32, 64, 80, 80, 96] and total == 99
    assert len(alloc.buffers) == 1 and alloc.buffers[0].numel() == 1024  # min_bytes
    assert torch.equal(alloc.buffers[0][32:56].view(torch.int32), torch.tensor([1, 4, 2, 5, 3, 6], dtype=torch.int32))
    staging.check_valid()


def test_a_buffer_whose_copy_is_pending_is_never_overwritten():
    staging, alloc, events = pool()
    a = torch.arange(10, dtype=torch.int64)
    staging.upload([a])
    staging.upload([torch.arange(100, 110, dtype=torch.int64)])  # the first copy is still pending
    assert len(alloc.buffers) == 2 and staging.buffers() == 2
    assert torch.equal(alloc.buffers[0][:80].view(torch.int64), a)  # untouched
    assert events.syncs == 0  # nor did the host wait for the device
    staging.check_valid()


def test_a_done_buffer_is_reused_and_a_warm_pool_allocates_nothing():
    staging, alloc, events = pool()
    gen = torch.Generator().manual_seed(0)
    for i in range(60):
        if i == 10:
            warm = len(alloc.buffers)
        parts = random_parts(gen, 4, 60)  # up to 4 x 480 bytes: varying sizes, all under min_bytes
        out = staging.upload(parts)
        assert all(torch.equal(v, t) for v, t in zip(out, parts, strict=True))
        if i >= 2:  # the device finishes each copy two uploads after it was queued
            events.finish(i - 2)
        staging.check_valid()
    assert len(alloc.buffers) == warm == 3  # three copies in flight at most: three buffers, then none new
    assert staging.allocations == warm and events.syncs == 0


def test_every_done_buffer_is_reused_before_a_new_one():
    staging, alloc, events = pool()
    for _ in range(3):
        staging.upload([torch.arange(8)])
    events.finish_all()
    for _ in range(3):  # each takes one of the three done buffers
        staging.upload([torch.arange(8)])
    assert len(alloc.buffers) == 3
    staging.upload([torch.arange(8)])  # all three pending again
    assert len(alloc.buffers) == 4


def test_a_larger_upload_grows_a_done_buffer_to_the_next_power_of_two():
    staging, alloc, events = pool(min_bytes=1024)
    staging.upload([torch.arange(16)])
    events.finish_all()
    big = torch.arange(300, dtype=torch.int64)  # 2400 bytes
    (out,) = staging.upload([big])
    assert torch.equal(out, big)
    assert [b.numel() for b in alloc.buffers] == [1024, 4096]
    assert staging.buffers() == 1  # the small done buffer was replaced, not kept
    events.finish_all()
    staging.upload([torch.arange(16)])  # the grown buffer serves small uploads too
    assert len(alloc.buffers) == 2
    staging.check_valid()


def test_past_the_in_flight_bound_the_oldest_copy_is_waited_for_and_its_buffer_reused():
    staging, alloc, events = pool(max_in_flight=4)
    for i in range(4):
        staging.upload([torch.full((4,), i)])
    assert len(alloc.buffers) == 4 and events.syncs == 0
    (out,) = staging.upload([torch.full((4,), 7)])
    assert events.syncs == 1 and staging.syncs == 1
    assert len(alloc.buffers) == 4  # the oldest buffer, its copy waited for
    assert torch.equal(alloc.buffers[0][:32].view(torch.int64), torch.full((4,), 7))
    assert torch.equal(alloc.buffers[1][:32].view(torch.int64), torch.full((4,), 1))  # still pending: intact
    assert torch.equal(out, torch.full((4,), 7))
    staging.check_valid()


def test_a_failed_upload_drops_its_buffer_and_the_pool_goes_on():
    staging, alloc, _ = pool()
    with pytest.raises((RuntimeError, NotImplementedError)):
        staging.upload([torch.arange(4), torch.empty(3, device="meta")])  # a meta part cannot be packed
    assert staging.buffers() == 0 and staging.allocations == 1
    alloc.fail = True
    with pytest.raises(MemoryError):
        staging.upload([torch.arange(4)])
    assert staging.buffers() == 0
    staging.check_valid()
    alloc.fail = False
    assert torch.equal(staging.upload([torch.arange(4)])[0], torch.arange(4))
    assert staging.buffers() == 1


def test_two_threads_get_their_own_bytes():
    staging, alloc, events = pool(max_in_flight=3, auto_done=True)
    events.yield_in_query = True
    errors, barrier = [], threading.Barrier(2)

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        barrier.wait()
        for _ in range(300):
            parts = random_parts(gen, 3, 2000)
            try:
                out = staging.upload(parts)
            except Exception as e:  # a broken pool shows as an error in the thread: the test must see it
                errors.append(repr(e))
                return
            if not all(torch.equal(v, t) for v, t in zip(out, parts, strict=True)):
                errors.append(f"thread {seed}: another upload's bytes")

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave inside take/give back, not only between uploads
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    assert staging.buffers() <= 2  # copies done at once: never more buffers than uploads at a time
    staging.check_valid()


def test_cpu_upload_and_upload_aligned_are_plain_copies():
    t = torch.arange(12, dtype=torch.int64).view(3, 4).t()
    out = upload(t, "cpu")
    assert torch.equal(out, t) and out.dtype == t.dtype
    parts = [torch.arange(5, dtype=torch.int64), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32).t(),
             torch.tensor([1, 2, 3], dtype=torch.int16)]
    out = upload_aligned(parts, "cpu")
    base = out[0].untyped_storage().data_ptr()
    for v, p in zip(out, parts, strict=True):
        assert torch.equal(v, p) and v.dtype == p.dtype and v.shape == p.shape
        assert v.untyped_storage().data_ptr() == base and (v.data_ptr() - base) % ALIGN == 0
    assert out[1].data_ptr() - base == 48 and out[2].data_ptr() - base == 64  # 40 bytes -> 48, 16 -> 64


@pytest.mark.gpu
def test_gpu_uploads_behind_long_kernels_read_the_bytes_they_were_given():
    """Every upload is queued behind a big matmul, so the host runs far ahead of the copies: a buffer reused
    before its copy ran would show a later upload's bytes. Through a small pool (bound 4: the waits run too)
    and through step_inputs.upload / step_plan.upload_aligned (the process's pool)."""
    device = torch.device("cuda", torch.cuda.current_device())
    staging = PinnedStaging(device, max_in_flight=4, min_bytes=1024)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(4096, 4096, device=device)
    kept = []
    for i in range(200):
        if i % 10 == 0:
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)  # ~0.1-0.3 s queued in all (fp32): the copies wait behind it
        parts = random_parts(gen, 3, 3000)
        kept.append((parts, staging.upload(parts)))
        one = torch.randint(0, 1 << 40, (int(torch.randint(1, 700, (), generator=gen)),), generator=gen)
        kept.append(([one], [upload(one, device)]))
        kept.append((parts, upload_aligned(parts, device)))
    torch.cuda.synchronize(device)
    for parts, out in kept:
        for v, t in zip(out, parts, strict=True):
            assert v.device == device and v.dtype == t.dtype and v.shape == t.shape
            assert torch.equal(v.cpu(), t)
    for _, out in kept[2::3]:  # upload_aligned's contract: one buffer, 16-byte aligned views
        base = out[0].untyped_storage().data_ptr()
        assert all(v.untyped_storage().data_ptr() == base and (v.data_ptr() - base) % ALIGN == 0 for v in out)
    assert staging.buffers() <= 4
    staging.check_valid()
