"""A cold `tpulaunch run` (its own emulated cluster) returns only once every process it started has
exited: a CI step that kills the step's process group right after sees nothing of it. Its script
closes its stdout before a clean exit: the host's exit code is still the script's, 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import cli_env, write_scripts


@pytest.mark.lifecycle
def test_a_cold_run_leaves_nothing_in_its_process_group(tmp_path):
    work = write_scripts(tmp_path, {"hi.py": "import sys\nprint('hi', flush=True)\nsys.stdout.close()\n"})
    proc = subprocess.Popen([sys.executable, "-m", "tpulaunch", "run", "hi.py", "--topology", "2x2", "--framework", "none",
                             "--log-dir", str(tmp_path / "runs")], cwd=work, env=cli_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    group = []
    for entry in os.listdir("/proc"):  # zombies included: a process not yet waited for is still in the group
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == proc.pid:  # pgid: the launcher led its own group
                group.append((int(entry), fields[0], open(f"/proc/{entry}/comm").read().strip()))
    assert group == [], f"left in the run's process group: {group}"
    assert "[host 0] hi" in out
