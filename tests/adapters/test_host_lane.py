"""The host lane (adapters/host_kernels/host_lane, ADR 0030): the publish and wait kernels against the C++ serving
thread through the mailbox, end to end. On the CPU Triton's interpreter runs the kernels in Python while the
thread serves them without the GIL, so the real handshake runs here; the gpu tests add the pinned mailbox and a
captured graph replayed several times. The first test compiles the lane's extension (~1 min, then cached)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.quant import QTensor
from adapters.host_kernels import fp8_block_experts as hk
from adapters.host_kernels import host_lane as hl
from adapters.kernels import host_lane_wait
from domain.model_spec import WeightFormat
from tests.adapters.sm90 import build_for_sm90

H, I, K, M = 256, 128, 2, 3  # hidden, intermediate, top-k, mailbox rows
ROW_OF_KEY = torch.tensor([3, -1, 0, 4, 1, 2, -1, 0])  # 8 keys (2 layers x 4 experts) over 5 bank rows
SPINS = 20_000  # the interpreter polls about once a millisecond: a host that never answers fails a test in ~20 s


# NOTE: the tests of the CPU mailbox launch the kernels on CPU tensors, which only Triton's interpreter runs; on a
# CUDA host (interpreter off, tests/conftest.py) compiled Triton refuses them, and the gpu tests below cover the lane
cpu_mailbox = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the CPU mailbox's kernels run in Triton's interpreter (off on a CUDA host)")


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, detail = hl.available()
    assert ok, f"the host lane's extension does not build here: {detail}"


def _q(rows: int, cols: int, g: torch.Generator) -> QTensor:
    data = (torch.randn(rows, cols, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) + 0.25
    return QTensor(WeightFormat.FP8_BLOCK, (rows, cols), data=data, scale=scale)


@pytest.fixture(scope="module")
def bank():
    g = torch.Generator().manual_seed(30)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, H, I)
    rows = torch.stack([layout.pack(_q(I, H, g), _q(I, H, g), _q(H, I, g)) for _ in range(5)])  # [N, R]
    return rows, layout


def _lane(bank, device="cpu", **kw) -> hl.HostLane:
    rows, layout = bank
    return hl.HostLane(rows, layout, ROW_OF_KEY, K, M, device, **{"threads": 2, "max_spins": SPINS, **kw})


def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.001)


def _round(v: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """fp32 v rounded to dtype as a kernel on device does: Triton's interpreter truncates fp32 -> bf16 where a GPU
    (and torch) rounds to nearest even (tests/adapters/test_fused_residual_prefill.py)."""
    if dtype == torch.bfloat16 and torch.device(device).type != "cuda":
        return (v.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return v.to(dtype)


def _expected(bank, x, pairs, weights, out_before, device="cpu"):
    """out_before + the fp8 kernel over the host pairs in lane order, added in fp32 and rounded once."""
    rows, layout = bank
    lanes = [lane for lane, key in enumerate(pairs.tolist()) if key >= 0]
    tok = torch.tensor([lane // K for lane in lanes], dtype=torch.int64)
    row = torch.tensor([int(ROW_OF_KEY[int(pairs[lane])]) for lane in lanes], dtype=torch.int64)
    w = torch.tensor([float(weights[lane // K, lane % K]) for lane in lanes], dtype=torch.float32)
    partial = hk.fp8_block_experts(x.float().cpu().contiguous(), rows, layout, tok, row, w)
    return _round(out_before.float().cpu() + partial, out_before.dtype, device), partial


def _layer(g, t, keys, dtype):
    x = torch.randn(t, H, generator=g).to(dtype)
    weights = torch.rand(t, K + 1, generator=g)  # KO = K + 1: the last column a shared gate, never a pair's
    out = torch.randn(t, H, generator=g).to(dtype)
    return x, torch.tensor(keys, dtype=torch.int64), weights, out


@cpu_mailbox
@pytest.mark.parametrize("team", hl.TEAMS)
def test_round_trip_layer_after_layer(bank, team):
    # _expected runs the kernel on ATen's OpenMP team: the spin team's answers are the same bits
    g = torch.Generator().manual_seed(1)
    layers = [  # (T, keys by lane t*K + k, dtype of x and out)
        (2, [0, -1, 3, 5], torch.bfloat16),
        (3, [7, 2, -1, 4, -1, -1], torch.float32),  # row 2 is padding: no host pair, partial row zero
        (2, [-1, -1, -1, -1], torch.bfloat16),  # no host pairs: no request at all
        (1, [4, 4], torch.float32),  # one key twice on one row, summed in lane order
        (3, [5, 3, 0, 2, 7, 4], torch.bfloat16),
    ]
    with _lane(bank, team=team) as lane:
        for n, (t, keys, dtype) in enumerate(layers):
            x, pairs, weights, out = _layer(g, t, keys, dtype)
            before = out.clone()
            request, served = int(lane.ctrl[hl.REQUEST]), lane.served
            lane.publish(x, pairs, weights)
            lane.wait_add(out)
            assert lane.device_error() == (hl.DeviceError.NONE, 0), n
            want, partial = _expected(bank, x, pairs, weights, before)
            assert torch.equal(out, want), n
            if max(keys) < 0:
                assert int(lane.ctrl[hl.REQUEST]) == request and lane.served == served
                assert torch.equal(out, before)
                continue
            assert int(lane.ctrl[hl.REQUEST]) == request + 1 == int(lane.ctrl[hl.DONE]), n
            assert lane.served == served + 1
            assert torch.equal(lane.partial[:t], partial), n  # rows without host pairs hold zeros
            assert torch.equal(lane.x[:t], x.float()) and int(lane.ctrl[hl.ROWS]) == t
        assert lane.host_error() == (hl.HostError.NONE, 0, 0)
        assert int(lane.state[0]) == 4  # one sequence number a request


@cpu_mailbox
@pytest.mark.parametrize("team,threads", [("spin", 2), ("spin", 3), ("openmp", 2)])
def test_a_step_of_random_layers(bank, team, threads):
    # many requests back to back, each answered before the next is published: the sequence numbers and the
    # reused mailbox never mix two layers up (rows, pairs, padding and dtypes drawn at random); a spin team
    # larger than the cores here (3 on 2) still answers every request exactly
    g = torch.Generator().manual_seed(6)
    with _lane(bank, team=team, threads=threads) as lane:
        for n in range(40):
            t = int(torch.randint(1, M + 1, (), generator=g))
            keys = torch.randint(0, len(ROW_OF_KEY), (t * K,), generator=g)
            keys[ROW_OF_KEY[keys] < 0] = -1  # keys the bank lacks are never a host pair
            keys[torch.rand(t * K, generator=g) < 0.4] = -1
            dtype = (torch.float32, torch.bfloat16)[n % 2]
            x, pairs, weights, out = _layer(g, t, keys.tolist(), dtype)
            before = out.clone()
            lane.publish(x, pairs, weights)
            lane.wait_add(out)
            assert torch.equal(out, _expected(bank, x, pairs, weights, before)[0]), n
        assert lane.device_error() == (hl.DeviceError.NONE, 0)
        assert lane.served == int(lane.state[0]) == int(lane.ctrl[hl.DONE])


@cpu_mailbox
def test_wait_gives_up_after_max_spins_and_the_lane_recovers(bank):
    g = torch.Generator().manual_seed(2)
    lane = _lane(bank, max_spins=20)  # not started: nobody answers
    x, pairs, weights, out = _layer(g, 2, [0, 3, -1, 5], torch.float32)
    before = out.clone()
    lane.publish(x, pairs, weights)
    lane.wait_add(out)
    assert lane.device_error() == (hl.DeviceError.TIMEOUT, 1)
    assert torch.equal(out, before)
    # the step is lost: its later layers do not wait out the bound again (a live host would answer this one)
    lane.publish(x, pairs, weights)
    lane.wait_add(out)
    assert lane.device_error() == (hl.DeviceError.TIMEOUT, 1) and torch.equal(out, before)
    assert int(lane.ctrl[hl.DONE]) == 0
    # started late, the thread serves the last request it finds (seq 2), never one the device gave up on twice
    lane.clear_errors()
    lane.max_spins = SPINS
    with lane:
        _until(lambda: int(lane.ctrl[hl.DONE]) == 2, "the pending request answered")
        assert lane.served == 1
        x, pairs, weights, out = _layer(g, 2, [7, -1, 2, 2], torch.bfloat16)
        before = out.clone()
        lane.publish(x, pairs, weights)
        lane.wait_add(out)
        assert lane.device_error() == (hl.DeviceError.NONE, 0)
        assert torch.equal(out, _expected(bank, x, pairs, weights, before)[0])


@cpu_mailbox
def test_the_wait_spins_until_a_late_thread_answers(bank):
    # the wait runs (in a Python thread: the interpreter's kernel) before the host thread exists; the result is
    # the same whichever starts first, so nothing here depends on timing
    g = torch.Generator().manual_seed(7)
    lane = _lane(bank)
    x, pairs, weights, out = _layer(g, 2, [5, 0, 3, -1], torch.float32)
    before = out.clone()
    lane.publish(x, pairs, weights)
    waiter = threading.Thread(target=lane.wait_add, args=(out,))
    waiter.start()
    lane.start()
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    lane.stop()
    assert lane.device_error() == (hl.DeviceError.NONE, 0)
    assert torch.equal(out, _expected(bank, x, pairs, weights, before)[0])


@cpu_mailbox
@pytest.mark.parametrize("key,reason", [(len(ROW_OF_KEY) + 3, hl.HostError.BAD_KEY), (6, hl.HostError.NO_ROW)])
def test_a_bad_key_is_refused_and_the_thread_keeps_serving(bank, key, reason):
    g = torch.Generator().manual_seed(3)
    with _lane(bank) as lane:
        x, pairs, weights, out = _layer(g, 2, [0, -1, key, 5], torch.float32)
        before = out.clone()
        lane.publish(x, pairs, weights)
        lane.wait_add(out)
        # refused, not timed out: the host answered -seq and the wait stopped at once
        assert lane.device_error() == (hl.DeviceError.HOST_FAILED, 1)
        assert lane.host_error() == (reason, 1, key)
        assert int(lane.ctrl[hl.DONE]) == -1 and lane.running
        assert torch.equal(out, before)
        lane.clear_errors()
        x, pairs, weights, out = _layer(g, 2, [3, 4, -1, 0], torch.float32)
        before = out.clone()
        lane.publish(x, pairs, weights)
        lane.wait_add(out)
        assert lane.device_error() == (hl.DeviceError.NONE, 0)
        assert lane.host_error() == (hl.HostError.NONE, 0, 0)
        assert torch.equal(out, _expected(bank, x, pairs, weights, before)[0])


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@cpu_mailbox
def test_stop_is_prompt_idempotent_and_restartable(bank):
    g = torch.Generator().manual_seed(4)
    lane = _lane(bank, threads=1)  # a team of one: the lane adds exactly its own thread
    lane.stop()  # never started: nothing to stop
    assert not lane.running
    lane.start()
    lane.start()  # running: a no-op
    assert lane.running
    time.sleep(0.02)  # past the pure-spin spell: idle polling (stop must still be prompt there)
    began = time.monotonic()
    lane.stop()
    assert time.monotonic() - began < 1.0
    lane.stop()
    assert not lane.running
    lane.start()
    x, pairs, weights, out = _layer(g, 1, [2, 5], torch.float32)
    before = out.clone()
    lane.publish(x, pairs, weights)
    lane.wait_add(out)
    assert lane.device_error() == (hl.DeviceError.NONE, 0)
    assert torch.equal(out, _expected(bank, x, pairs, weights, before)[0])
    began = time.monotonic()  # stop right after serving: inside the pure-spin spell
    lane.stop()
    assert time.monotonic() - began < 1.0


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_dropping_the_lane_stops_its_thread(bank):
    lane = _lane(bank, threads=1)
    count = _threads()
    lane.start()
    assert _threads() == count + 1
    del lane  # the C++ object's destructor stops and joins the thread
    _until(lambda: _threads() == count, "the thread gone")


@pytest.mark.parametrize("team", hl.TEAMS)
def test_team_names_the_team_the_thread_serves_with(bank, team):
    lane = _lane(bank, team=team)
    assert lane.team == team  # not started: the one asked for
    with lane:
        assert lane.team == team  # the C++ thread's own report (a spin team that failed to start says openmp)
    assert lane.team == team


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_spin_team_lives_and_ends_with_its_thread(bank):
    lane = _lane(bank, threads=4, team="spin")
    count = _threads()
    lane.start()  # returns once the team is up: the lane's thread and its three workers
    assert _threads() == count + 4
    assert lane.team == "spin"
    time.sleep(0.02)  # past the workers' pure-spin spell: they poll, and must still end promptly
    began = time.monotonic()
    lane.stop()
    assert time.monotonic() - began < 1.0
    assert _threads() == count  # stop() joined the workers with the thread
    lane.start()
    _until(lambda: _threads() == count + 4, "a fresh team after a restart")
    del lane
    _until(lambda: _threads() == count, "every thread gone")


@pytest.mark.parametrize("team", hl.TEAMS)
def test_measure_serves_rows_routed_alike(bank, team):
    # --host-experts auto's measurement, and bench_host_experts' batch of one prompt: `rows` rows through the
    # same experts; the last request's answer must be the kernel's for those pairs
    rows, layout = bank
    lane = _lane(bank, team=team)
    with pytest.raises(RuntimeError, match="not running"):
        lane.measure(requests=1)
    lane.start()
    try:
        for bad in (dict(rows=0), dict(rows=M + 1), dict(experts=K + 1), dict(requests=0)):
            with pytest.raises(ValueError, match="rows in"):
                lane.measure(**bad)
        assert lane.measure(requests=1, experts=2, rows=M) > 0
        keys = (ROW_OF_KEY >= 0).nonzero().flatten()  # the keys with a bank row, as the lane lists them
        last = keys[(torch.arange(2) + 2) % keys.numel()]  # request 1's experts (request 0 warms up)
        expected = hk.fp8_block_experts(lane.x[:M].cpu(), rows, layout, torch.arange(M).repeat_interleave(2),
                                        ROW_OF_KEY[last].repeat(M), torch.full((2 * M,), 0.5))
        assert torch.equal(lane.partial[:M].cpu(), expected)
    finally:
        lane.stop()


def test_launchers_refuse_what_does_not_fit(bank):
    lane = _lane(bank)
    x, pairs, w = torch.zeros(2, H), torch.full((2 * K,), -1), torch.zeros(2, K + 1)
    with pytest.raises(ValueError, match="do not fit the mailbox"):
        lane.publish(torch.zeros(M + 1, H), torch.full(((M + 1) * K,), -1), torch.zeros(M + 1, K))
    with pytest.raises(ValueError, match="host_pairs must be"):
        lane.publish(x, pairs[:-1], w)
    with pytest.raises(ValueError, match="weights must be"):
        lane.publish(x, pairs, w[:, :1])
    with pytest.raises(ValueError, match="mailbox_x must be"):
        lane.publish(torch.zeros(2, H + 1), pairs, w)
    with pytest.raises(ValueError, match="partial must be"):
        lane.wait_add(torch.zeros(2, H + 1))
    with pytest.raises(ValueError, match="max_spins"):
        host_lane_wait.wait_add(x, lane.partial, lane.ctrl[hl.DONE:hl.DONE + 1], lane.state, 0)
    with pytest.raises(ValueError, match="row_of_key"):
        hl.HostLane(bank[0], bank[1], ROW_OF_KEY.int(), K, M, "cpu")
    with pytest.raises(ValueError, match="team must be one of spin, openmp"):
        hl.HostLane(bank[0], bank[1], ROW_OF_KEY, K, M, "cpu", team="tbb")
    with pytest.raises(ValueError, match="reads block FP8 rows"):
        hl.HostLane(bank[0], ExpertLayout(WeightFormat.BF16, H, I), ROW_OF_KEY, K, M, "cpu")
    assert not lane.running


@pytest.mark.parametrize("h", [256, 2048 + 384])
def test_wait_add_adds_every_column_of_a_row_past_one_block(h):
    # one program a row walks the row in blocks of at most 2,048 columns: a hidden size past one block (the last
    # masked) adds every column once; a layer that sent nothing (LIVE 0) adds nothing
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    pin = device == "cuda"
    g = torch.Generator().manual_seed(44)
    t, seq = 3, 7
    partial = torch.randn(M, h, generator=g).pin_memory() if pin else torch.randn(M, h, generator=g)
    done = torch.tensor([seq], dtype=torch.int64)
    done = done.pin_memory() if pin else done
    out = torch.randn(t, h, generator=g).to(device)
    before = out.clone()
    state = torch.tensor([seq, 1, 0, 0], dtype=torch.int64, device=device)
    host_lane_wait.wait_add(out, partial, done, state, SPINS)
    assert torch.equal(out.cpu(), before.cpu() + partial[:t]) and int(state[2]) == 0
    state[1] = 0
    host_lane_wait.wait_add(out, partial, done, state, SPINS)
    assert torch.equal(out.cpu(), before.cpu() + partial[:t])


_COMPILE_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adapters.kernels import host_lane_publish, host_lane_wait

def build(kernel, sig, consts, **options):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    return triton.compile(ASTSource(kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32), options=options)

for x in ("*bf16", "*fp32"):
    ptx = build(host_lane_publish._publish_kernel,
                {"x_ptr": x, "pairs_ptr": "*i64", "w_ptr": "*fp32", "mb_x_ptr": "*fp32", "mb_pairs_ptr": "*i64",
                 "mb_w_ptr": "*fp32", "request_ptr": "*i64", "state_ptr": "*i64", "T": "i32", "H": "i32",
                 "stride_x": "i32", "stride_w": "i32"},
                dict(K=8, BLOCK_L=128, BLOCK_H=1024)).asm["ptx"]
    assert "atom.global.sys.release.exch.b64" in ptx, ptx
    ptx = build(host_lane_wait._wait_add_kernel,
                {"partial_ptr": "*fp32", "out_ptr": x, "done_ptr": "*i64", "state_ptr": "*i64", "H": "i32",
                 "stride_out": "i32", "max_spins": "i32"},
                dict(TIMEOUT_CODE=1, HOST_CODE=2, BLOCK_H=2048, ON_GPU=True), num_warps=1).asm["ptx"]  # as launched
    assert "ld.acquire.sys.global.b64" in ptx and "nanosleep.u32" in ptx, ptx
print("ok")
"""


def test_kernels_compile_for_sm90():
    # the CUDA branches (inline PTX, the system-scope release) that the interpreter never takes
    assert build_for_sm90(_COMPILE_CHECK).strip().endswith("ok")


# --- on a CUDA device: the pinned mailbox, and the handshake inside a captured graph ---------------------------

def _graph_layers(lane, x, pairs, weights, base, out):
    """Two layers of a step: publish, unrelated GPU work, wait and add; twice on one mailbox."""
    for layer in range(2):
        lane.publish(x[layer], pairs[layer], weights[layer])
        torch.mul(base[layer], 2, out=out[layer])  # the GPU's own share of the layer, while the host computes
        lane.wait_add(out[layer])


@pytest.mark.gpu
def test_graph_replays_handshake_with_the_thread(bank):
    from tests.adapters.cuda_graphs import capture

    g = torch.Generator().manual_seed(5)
    dev = torch.device("cuda")
    t = 2
    x = torch.zeros(2, t, H, dtype=torch.bfloat16, device=dev)
    pairs = torch.full((2, t * K), -1, dtype=torch.int64, device=dev)
    weights = torch.zeros(2, t, K + 1, device=dev)
    base = torch.zeros(2, t, H, dtype=torch.bfloat16, device=dev)
    out = torch.zeros_like(base)
    with _lane(bank, dev, max_spins=hl.MAX_SPINS) as lane:
        assert lane.ctrl.is_pinned() and lane.partial.is_pinned()
        graph = capture(lambda: _graph_layers(lane, x, pairs, weights, base, out))
        torch.cuda.synchronize()
        seq = int(lane.state[0])
        keys = [[0, 3, -1, 5], [-1, -1, -1, -1], [7, 2, 2, -1], [4, -1, -1, 0]]
        for replay in range(6):
            want = []
            for layer in range(2):
                xs, ps, ws, bs = _layer(g, t, keys[(replay + layer) % len(keys)], torch.bfloat16)
                x[layer].copy_(xs)
                pairs[layer].copy_(ps)
                weights[layer].copy_(ws)
                base[layer].copy_(bs)
                want.append(_expected(bank, xs, ps, ws, (bs.float() * 2).to(torch.bfloat16), dev)[0])
            graph.replay()
            torch.cuda.synchronize()
            assert lane.device_error() == (hl.DeviceError.NONE, 0), replay
            for layer in range(2):
                assert torch.equal(out[layer].cpu(), want[layer]), (replay, layer)
            published = sum(max(keys[(replay + layer) % len(keys)]) >= 0 for layer in range(2))
            assert int(lane.state[0]) == seq + published  # fresh sequence numbers every replay
            seq += published
        lane.stop()
        # a stalled thread fails the replay within the bound instead of hanging the device
        lane.max_spins = 1000
        graph = capture(lambda: _graph_layers(lane, x, pairs, weights, base, out))
        lane.clear_errors()
        x[0].copy_(_layer(g, t, [0, 3, -1, 5], torch.bfloat16)[0])
        pairs[0].copy_(torch.tensor([0, 3, -1, 5]))
        graph.replay()
        torch.cuda.synchronize()
        assert lane.device_error()[0] == hl.DeviceError.TIMEOUT
