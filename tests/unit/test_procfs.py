"""`procfs`: what the kernel says of processes, read without walking all of /proc where it can."""

from __future__ import annotations

import os

from tpulaunch import procfs


def test_a_processs_children_come_from_the_kernels_own_list():
    assert os.getpid() in (procfs.child_pids(os.getppid()) or [])  # we are our parent's child
    assert procfs.child_pids(os.getpid()) is not None
    assert procfs.child_pids(2**22 + 11) == []  # beyond pid_max: no such process, no children
