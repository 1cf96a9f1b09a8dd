"""`procfs`: what the kernel says of processes, read without walking all of /proc where it can."""

from __future__ import annotations

import os

from tpulaunch import procfs


def test_a_processs_children_come_from_the_kernels_own_list():
    assert os.getpid() in (procfs.child_pids(os.getppid()) or [])  # we are our parent's child
    assert procfs.child_pids(os.getpid()) is not None
    assert procfs.child_pids(2**22 + 11) == []  # beyond pid_max: no such process, no children


def test_subtree_sees_what_the_walk_of_all_of_proc_sees():
    """`descendants` from the kernel's child lists (no walk of /proc) and from the full walk agree."""
    parent = os.getppid()
    assert os.getpid() in procfs.subtree(parent)[parent]
    assert set(procfs.descendants(parent)) == set(procfs.descendants(parent, procfs.children_map()))
    assert procfs.subtree(2**22 + 11) == {}


def test_a_processs_group_is_the_kernels():
    me = procfs.Process(os.getpid())
    assert me.pgid() == os.getpgrp() and me.ppid() == os.getppid()
    assert procfs.Process(2**22 + 11).pgid() is None  # beyond pid_max: gone
