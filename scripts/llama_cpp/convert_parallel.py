"""Run llama.cpp's own converter (convert_hf_to_gguf.py) with its tensors evaluated by a thread pool.

Usage: python convert_parallel.py LLAMA_CPP_SRC [converter arguments...]
       CONVERT_THREADS (default: cores - 2, at least 1) tensors are evaluated ahead of the writer.

Why: the converter evaluates each lazy tensor (FP8 block dequantization in torch, then Q8_0 quantization
in numpy) on one thread, right before writing it. On the lent H200 host that took 18 minutes for the full
Qwen3.6-35B-A3B checkpoint (docs/gpu-validation.md, session 12) with 15 of 16 cores idle. Here the writer's
loop is unchanged; each tensor it is about to write has already been evaluated (or is being evaluated) by a
pool worker, in file order, at most CONVERT_THREADS tensors ahead. numpy's and torch's array kernels let go
of the GIL, so the workers run in parallel. The bytes written are the converter's own: the same functions
run on the same inputs, only on other threads (`scripts/llama_cpp/check_convert_parallel.sh` compares the
files byte for byte against a plain run).
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any


class _Prefetched:
    """Stands in for one tensor in the writer's loop: `tofile` waits for the worker that evaluated it."""

    def __init__(self, original: Any, future: Future, on_write: Any) -> None:
        self.nbytes = original.nbytes  # the writer checks this against its TensorInfo before writing
        self._future = future
        self._on_write = on_write

    def tofile(self, fout: Any) -> None:
        array = self._future.result()
        self._on_write()  # one tensor leaves the window: start the next one
        array.tofile(fout)


def _patch_writer(threads: int) -> None:
    import gguf
    from gguf.lazy import LazyBase

    def evaluate(tensor: Any) -> Any:
        return type(tensor).to_eager(tensor) if isinstance(tensor, LazyBase) else tensor

    original = gguf.GGUFWriter.write_tensors_to_file

    def write_tensors_to_file(self: Any, *, progress: bool = False) -> None:
        infos = [ti for shard in self.tensors for ti in shard.values() if ti.tensor is not None]
        if not infos:
            return original(self, progress=progress)
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="convert")
        lock = threading.Lock()
        # NOTE: nothing but the pool's work item and the writer's stand-in keeps a tensor or its result, so
        # each evaluated array is freed once written (a list of futures here would hold all 36 GB)
        pending: deque[tuple[Any, Future]] = deque()

        def submit_next() -> None:
            with lock:
                if not pending:
                    return
                source, future = pending.popleft()

            def run() -> None:
                try:
                    future.set_result(evaluate(source))
                except BaseException as error:  # re-raised in the writer's thread by result()
                    future.set_exception(error)

            pool.submit(run)

        for ti in infos:
            future: Future = Future()
            pending.append((ti.tensor, future))
            ti.tensor = _Prefetched(ti.tensor, future, submit_next)
        for _ in range(threads):  # the window: `threads` tensors in flight ahead of the writer
            submit_next()
        try:
            original(self, progress=progress)
        finally:
            pending.clear()
            pool.shutdown(wait=False, cancel_futures=True)

    gguf.GGUFWriter.write_tensors_to_file = write_tensors_to_file


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    source = Path(sys.argv[1]).resolve()
    threads = int(os.environ.get("CONVERT_THREADS") or max(1, (os.cpu_count() or 2) - 2))
    sys.path.insert(0, str(source / "gguf-py"))
    sys.path.insert(0, str(source))
    if threads > 1:
        import torch

        torch.set_num_threads(1)  # parallel across tensors, not inside each one: no oversubscription
        _patch_writer(threads)
    print(f"convert_parallel: {threads} tensor threads", file=sys.stderr)
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
