"""Where a rank's main thread is, read from its frames."""

from __future__ import annotations

import threading

from slurmddp.watchdog import stacks

TORCH = "/venv/lib/python3.11/site-packages/torch"


def test_a_collective_a_backward_and_slurmddp_waits_are_waits():
    user = ("/home/u/train.py", 50, "step")
    assert stacks.waiting_in([user, (f"{TORCH}/distributed/distributed_c10d.py", 3245,
                                     "all_reduce")]) == "a torch.distributed call"  # fmt: skip
    assert "backward" in stacks.waiting_in([user, (f"{TORCH}/autograd/graph.py", 8, "_engine")])
    assert stacks.waiting_in([user, ("/x/slurmddp/rank/coordination.py", 1, "wait_all")])
    assert stacks.waiting_in([user]) is None and stacks.waiting_in([]) is None


def test_the_call_site_is_the_users_innermost_frame():
    frames = [("<frozen runpy>", 88, "_run_code"), ("/home/u/train.py", 50, "main"),
              (f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper"),
              (f"{TORCH}/distributed/distributed_c10d.py", 3245, "all_reduce")]  # fmt: skip
    assert stacks.call_site(frames) == "/home/u/train.py:50 in main"


def test_every_thread_is_rendered_with_a_header_read_back():
    ready, leave = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (ready.set(), leave.wait()), name="loader")
    worker.start()
    ready.wait()
    try:
        threads = stacks.threads()
    finally:
        leave.set()
        worker.join()
    assert next(iter(threads)) == "MainThread" and "loader" in threads
    assert threads["MainThread"][-1][2] == "threads"  # innermost: stacks.threads itself
    text = stacks.render({"rank": 3, "waiting": None}, threads)
    assert stacks.header(text) == {"rank": 3, "waiting": None}
    assert "Thread 'loader' (most recent call last):" in text and "in test_every_thread" in text
    assert stacks.header("no header\n") is None and stacks.header("# [1]\n") is None
