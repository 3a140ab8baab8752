"""A forked averager process may start many threads that use torch at once: its thread pool must be whole first.

Without :func:`renew_torch_thread_pool`, when the parent had set torch's thread count, about 1 forked child in 40
whose 32 threads make their first torch call at the same moment fails with "Invalid thread pool!" (torch 2.13,
measured: 26 of 1,000); with it, none may.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch
from hivemind.averaging import DecentralizedAverager

from template.allreduce import averager_process
from template.allreduce.averager_process import CheckedAverager, renew_torch_thread_pool

CHILDREN = 60
THREADS = 32


def _first_use_in_many_threads_at_once(errors: mp.Queue) -> None:
    renew_torch_thread_pool()
    barrier, failed = threading.Barrier(THREADS), []

    def work() -> None:
        barrier.wait()
        try:
            values = torch.randn(200_000)  # large enough for torch's parallel kernels
            values.to(torch.float16).float().sum()
        except RuntimeError as err:
            failed.append(str(err)[:120])

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors.put(failed)


@pytest.mark.timeout(120)
def test_threads_of_a_forked_process_use_torch_at_once_without_an_invalid_pool():
    # the parent set its thread count and used its pool before forking, as neurons (--neuron.torch_threads), the
    # engine's CLI and the benchmarks do: only then does a child's first use replace the pool (the same count here)
    torch.set_num_threads(torch.get_num_threads())
    torch.randn(200_000).sum()
    context = mp.get_context("fork")
    seen = []
    for _ in range(CHILDREN):
        errors = context.Queue()
        child = context.Process(target=_first_use_in_many_threads_at_once, args=(errors,))
        child.start()
        seen.extend(errors.get(timeout=60))
        child.join(timeout=30)
        assert child.exitcode == 0
    assert seen == [], seen[:3]


def test_the_averager_process_renews_the_pool_before_hivemind_serves(monkeypatch):
    """hivemind forks the averager and calls ``run`` in the child: ours renews the pool first, then serves."""
    calls = []
    monkeypatch.setattr(averager_process, "renew_torch_thread_pool", lambda: calls.append("renew"))
    monkeypatch.setattr(DecentralizedAverager, "run", lambda self: calls.append("serve"))
    CheckedAverager.run(object.__new__(CheckedAverager))
    assert calls == ["renew", "serve"]
