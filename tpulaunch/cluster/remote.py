"""Ray on a real TPU slice, brought up over `gcloud ... tpu-vm ssh` (`cluster join` on a VM is `join.py`).

`emulated.py` starts emulated clusters on this machine; this module runs the commands that start,
query and stop Ray *on the slice's own VMs* (`worker_commands.py` builds them) through
`tpulaunch.gcloud` (the only module that runs gcloud). Nothing here opens a socket to the slice from the
laptop: Ray's ports on TPU VMs are internal, so the head is asked through ssh to worker 0.

What runs on each worker (every piece quoted with `shlex.quote`; nothing user-given unquoted):

* the token goes over **stdin**: `umask 077 && mkdir -p ~/.tpulaunch && cat > ~/.tpulaunch/ray_token`;
* then `RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.tpulaunch/ray_token python3 -c <worker_start.py>
  start ...` (Ray's own CLI, waiting for its raylet without spinning and up to 90 s): head on
  worker 0 (GCS on `--port`, default 6379, the one port others must know; dashboard, if any, bound
  to 127.0.0.1), `--address <worker 0 internal IP>:PORT` elsewhere.
  Every other Ray port is 0 (random): no clashes with anything else on the VM, nothing to open.
  No `--resources`: on a TPU VM Ray counts the chips itself and derives the `TPU-*` resources and
  `ray.io/tpu-*` labels from the metadata server.
* `--temp-dir` is per cluster (`/tmp/tpl-<hash of project/zone/name>`), and every Ray process of the
  cluster is started with `TPULAUNCH_CLUSTER_ID=<id>` in its environment (the id is a hash of the
  cluster's token) and the marker `tpulaunch-cluster` in its temp dir. So `down` stops exactly the
  processes carrying the id, and deletes the temp dir only if its marker names the id: never
  another Ray the user runs on the VM (`ray stop` would kill every Ray of the user), nor a
  directory a record merely names.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from tpulaunch import gcloud
from tpulaunch.cluster.ownership import ID_ENV
from tpulaunch.cluster.record import ClusterInfo, RemoteSpec, state_dir
from tpulaunch.cluster.tokens import cluster_id_of, ensure_token, token_file
from tpulaunch.cluster.worker_commands import (
    DEFAULT_PORT,
    DEFAULT_PYTHON,
    MAX_PARALLEL_SSH,
    cluster_key,
    default_temp_dir,
    local_auth_env,
    marked_json,
    output_tail,
    query_command,
    query_words,
    ray_start_words,
    setup_stdin,
    start_command,
    stop_command,
)
from tpulaunch.errors import ClusterError
from tpulaunch.gcloud import SSH_TIMEOUT
from tpulaunch.plan.slicespec import SliceSpec

Progress = Callable[[int, str], None]  # (worker id, or HEAD for a head off the slice; state text)
HEAD = -1


# -- a cluster on a slice, driven from anywhere gcloud works --------------------------------------


def route_ip(peer: str) -> str:
    """This machine's address on the route to `peer` (what a TPU worker reaches it at). No packet
    is sent: a UDP socket's connect only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            raise ClusterError(f"this machine has no route to worker 0 ({peer})",
                               "run `cluster up --head local` on a machine in the slice's network,"
                               " or pass --head-ip") from None


@dataclass(frozen=True)
class LocalHead:
    """The Ray head off the slice, on the machine that runs `cluster up --tpu NAME --head local`."""

    ip: str  # the address the TPU workers (and clients) reach this machine at
    temp_dir: str  # a /tmp/tpl-* dir of ours (marker with the cluster's id)
    dashboard_port: int
    python: str


class RemoteSlice:
    """One TPU slice reached over gcloud ssh; `cluster up/status/down --tpu` in library form."""

    def __init__(self, spec: SliceSpec, *, port: int = DEFAULT_PORT, temp_dir: str | None = None,
                 python: str = DEFAULT_PYTHON, dashboard: bool = False, cluster_id: str | None = None,
                 head: LocalHead | None = None, setup: str | None = None, key: str | None = None) -> None:
        if not spec.workers:
            raise ClusterError(f"TPU '{spec.name}' lists no worker endpoints",
                               "is it READY? `tpulaunch slice describe`")
        if not spec.zone or not spec.project:
            raise ClusterError(f"TPU '{spec.name}' has no zone/project", "pass --zone and --project")
        self.spec = spec
        self.port = int(port)
        # the cluster's key (its token file): its first slice's; a slice that joins another's head shares it
        self.key = key or cluster_key(spec.project, spec.zone, spec.name)
        self.temp_dir = temp_dir or default_temp_dir(spec.project, spec.zone, spec.name)
        self.python = python
        self.dashboard = dashboard
        self.cluster_id = cluster_id  # known once the token is (up), or from the record (down)
        self.head = head  # the head off the slice, on this machine (None: on worker 0)
        self.setup = setup  # a shell script every worker runs before it joins (a fresh VM's installs)
        self.setup_logs: dict[int, str] = {}  # worker -> where its setup's output was saved

    @classmethod
    def from_record(cls, info: ClusterInfo, index: int = 0) -> RemoteSlice:
        """Slice `index` of a recorded cluster (`cluster up --tpu A [--tpu B ...]`), sharing its
        head and token."""
        r = info.remote
        assert r is not None, "a cluster on TPUs"
        head = None
        if r.head_here:
            head = LocalHead(ip=r.head_ip or "", temp_dir=info.temp_dir or "", dashboard_port=r.dashboard_port or 0,
                             python=r.head_python or sys.executable)
        first = info.slices[0]
        return cls(info.slices[index], port=r.port, temp_dir=r.temp_dir, python=r.python,
                   cluster_id=info.cluster_id, head=head, setup=r.setup,
                   key=cluster_key(first.project or "", first.zone or "", first.name))

    @property
    def head_ip(self) -> str:
        return self.head.ip if self.head else self.spec.workers[0].ip

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def ssh(self, worker: int, command: str, stdin: str | None = None) -> gcloud.SshResult:
        s = self.spec
        return gcloud.tpu_vm_ssh(s.name, zone=s.zone or "", project=s.project or "", worker=worker,
                                 command=command, stdin=stdin)

    def query(self) -> dict:
        """Ask the head which nodes it has (over ssh to worker 0, or here when the head is local):
        {"head": bool, "nodes": [...]}."""
        proc: subprocess.CompletedProcess[str] | gcloud.SshResult
        if self.head is not None:
            token = token_file(self.key)
            proc = subprocess.run(query_words(self.head.python, self.address),
                                  env={**os.environ, **local_auth_env(str(token))},
                                  capture_output=True, text=True, timeout=120)
        else:
            proc = self.ssh(0, query_command(self.python, self.head_ip, self.port))
        doc = marked_json(proc.stdout)
        if proc.returncode != 0 or doc is None:
            raise ClusterError(f"could not ask worker 0 of '{self.spec.name}' about Ray (exit {proc.returncode}):"
                               f" {output_tail(proc)}",
                               f"is Ray installed for {self.python} on the TPU VMs? (--remote-python)")
        if doc.get("error") and doc.get("head"):
            raise ClusterError(f"the Ray head at {self.address} answers but would not let us in: {doc['error']}",
                               "another cluster (or another token) holds that port; `tpulaunch cluster down` it first")
        return doc

    def alive_workers(self, doc: dict) -> set[int]:
        ids = set()
        for n in doc.get("nodes", []):
            labels = n.get("Labels") or {}
            if n.get("Alive") and labels.get("ray.io/tpu-slice-name") == self.spec.name:
                try:
                    ids.add(int(labels.get("ray.io/tpu-worker-id", "")))
                except ValueError:
                    pass
        return ids

    def _start_local_head(self, token_path: Path) -> None:
        """The head off the slice: `ray start --head` here, with no TPU, its dashboard (the job API)
        bound where clients and workers reach it, token auth, and the cluster's id and marker."""
        head = self.head
        assert head is not None and self.cluster_id
        words = ray_start_words(python=head.python, node_ip=head.ip, temp_dir=head.temp_dir, port=self.port, head=True,
                                dashboard=True)
        words[words.index("--dashboard-host") + 1] = head.ip
        words += ["--dashboard-port", str(head.dashboard_port), "--num-cpus", "1", "--resources", "{}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "RAY_ADDRESS"))}
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_USAGE_STATS_ENABLED": "0",
                    ID_ENV: self.cluster_id,
                    # `python` in the head's jobs (a detached run's supervisor) is the one with tpulaunch
                    "PATH": os.pathsep.join([os.path.dirname(head.python), os.environ.get("PATH", "")])})
        proc = subprocess.run(words, env=env, capture_output=True, text=True, timeout=SSH_TIMEOUT)
        if proc.returncode != 0:
            raise ClusterError(f"the Ray head did not start here (exit {proc.returncode}): {output_tail(proc)}",
                               f"Ray's logs are under {head.temp_dir}")

    def _setup(self, worker: int) -> None:
        """Run the setup script on one worker (fed to `bash -s`, so no quoting can break it); its
        output is kept here, one file per worker; a failure names the worker and its last lines."""
        if not self.setup:
            return
        proc = self.ssh(worker, "bash -s", stdin=setup_stdin(self.setup))
        logs = state_dir() / "setup"
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / f"{self.spec.name}-worker-{worker}.log"
        path.write_text(proc.stdout + proc.stderr)
        self.setup_logs[worker] = str(path)
        if proc.returncode != 0:
            raise ClusterError(f"the setup failed on worker {worker} (exit {proc.returncode}): {output_tail(proc)}",
                               f"its whole output is in {path}")

    def _start(self, worker: int, token: str, head: bool) -> None:
        words = ray_start_words(python=self.python, node_ip=self.spec.workers[worker].ip, temp_dir=self.temp_dir,
                                port=self.port, head=head, head_ip=self.head_ip, dashboard=self.dashboard)
        proc = self.ssh(worker, start_command(words, self.temp_dir, cluster_id_of(token)), stdin=token)
        if proc.returncode != 0:
            # A `ray start` that gave up waiting for its raylet (`worker_start`'s 90 s) leaves the
            # raylet running, and it may register later: on a re-created slice it would then pass
            # for a node of the old VMs, and the next try would wait for it to go away. Stop what
            # it left, and keep Ray's logs there: the error below points at them.
            try:
                self.ssh(worker, stop_command(self.python, self.temp_dir, cluster_id_of(token), keep_dir=True))
            except ClusterError:
                pass  # the reason below matters more
            raise ClusterError(f"ray start failed on worker {worker} (exit {proc.returncode}): {output_tail(proc)}",
                               f"Ray's logs are under {self.temp_dir} on that worker")

    def up(self, progress: Progress | None = None, replaced: bool = False,
           replaced_wait_s: float = 120.0) -> ClusterInfo:
        """Head on worker 0, every other worker joined; workers already in the cluster are left alone.

        `replaced`: the slice's VMs are new (re-created after a preemption). Ray still counts the old
        VMs' nodes as alive until its health checks fail (about 15 s by default), and a new VM must
        not be taken for one of them: wait (bounded) until Ray has let go of them first."""
        say = progress or (lambda _w, _s: None)
        n = len(self.spec.workers)
        token_path, token, created = ensure_token(self.key)
        self.cluster_id = cluster_id_of(token)
        say(0, "checking")
        doc = self.query()
        if replaced and doc["head"] and self.alive_workers(doc):
            end = time.monotonic() + replaced_wait_s
            say(0, "waiting for Ray to let go of the old VMs' nodes")
            while self.alive_workers(doc):
                if time.monotonic() > end:
                    raise ClusterError(f"Ray still counts the old VMs of '{self.spec.name}' as alive after"
                                       f" {replaced_wait_s:.0f} s", "check the head (`tpulaunch cluster status`)")
                time.sleep(1.0)
                doc = self.query()
        if doc["head"]:
            if created:
                token_path.unlink(missing_ok=True)
                raise ClusterError(f"a Ray head already runs at {self.address} but this machine has no token for it",
                                   "stop it with `tpulaunch cluster down` from where it was started, or on the VMs")
            alive = self.alive_workers(doc)
            for w in sorted(alive):
                say(w, "already in the cluster")
        elif self.head is not None:
            say(HEAD, "starting here (off the slice)")
            self._start_local_head(token_path)
            say(HEAD, "up")
            alive = set()
        else:
            if self.setup:
                say(0, "setting up")
                self._setup(0)
            say(0, "starting head")
            self._start(0, token, head=True)
            say(0, "head up")
            alive = {0}
        todo = [w for w in range(n) if w not in alive]
        errors: dict[int, str] = {}

        def join(w: int) -> None:
            try:
                if self.setup:
                    say(w, "setting up")
                    self._setup(w)
                say(w, "joining")
                self._start(w, token, head=False)
            except ClusterError as e:
                errors[w] = e.message
                say(w, "FAILED")
                return
            say(w, "joined")

        if todo:
            with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SSH, len(todo))) as pool:
                list(pool.map(join, todo))
        if errors:
            raise ClusterError("; ".join(f"worker {w}: {m}" for w, m in sorted(errors.items())),
                               "fix that and run `tpulaunch cluster up` again (hosts already up are left alone)")
        remote = RemoteSpec((self.spec.name,), self.spec.zone or "", self.spec.project or "", self.port, self.temp_dir,
                            self.python, "worker-0", self.setup)
        if self.head is not None:
            remote = replace(remote, head="local", head_ip=self.head.ip, dashboard_port=self.head.dashboard_port,
                             head_python=self.head.python)
        return ClusterInfo(address=self.address, temp_dir=self.head.temp_dir if self.head else None,
                           token_path=str(token_path), emulated=False, slices=[self.spec],
                           cluster_id=self.cluster_id, remote=remote,
                           dashboard=f"{self.head.ip}:{self.head.dashboard_port}" if self.head else None)

    def down(self, progress: Progress | None = None, stop_head: bool = True) -> dict[int, dict]:
        """End this cluster's Ray processes on every worker, in parallel: {worker: {"stopped", "left"}};
        then the head off the slice (`stop_head`; a cluster of several slices stops it after the last)."""
        cluster_id = self.cluster_id
        if not cluster_id:
            raise ClusterError(f"the record of the cluster on TPU '{self.spec.name}' has no cluster id (written by an"
                               " older tpulaunch?): nothing can be told apart as its", "stop its Ray processes on the"
                               " VMs yourself (`ray stop` there, if nothing else of yours runs Ray)")
        say = progress or (lambda _w, _s: None)
        results: dict[int, dict] = {}

        def stop(w: int) -> None:
            say(w, "stopping")
            try:
                proc = self.ssh(w, stop_command(self.python, self.temp_dir, cluster_id))
            except ClusterError as e:  # gcloud cannot run (a broken install or login) or timed out: the others go on
                results[w] = {"error": e.message}
                say(w, "FAILED")
                return
            doc = marked_json(proc.stdout)
            if proc.vm_gone:  # the VM itself is gone (preempted, deleted)
                results[w] = {"stopped": 0, "left": [], "gone": True}
                say(w, "the VM is gone: nothing to stop")
            elif proc.returncode != 0 or doc is None:
                results[w] = {"error": f"exit {proc.returncode}: {output_tail(proc)}"}
                say(w, "FAILED")
            else:
                results[w] = doc
                say(w, "stopped" if not doc.get("left") else f"{len(doc['left'])} process(es) left")

        n = len(self.spec.workers)
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SSH, n)) as pool:
            list(pool.map(stop, range(n)))
        if self.head is not None and stop_head:  # the head here: stopped as an emulated cluster is, by id and marker
            from tpulaunch.cluster.emulated import stop_owned

            results[-1] = {"stopped": stop_owned(cluster_id, self.head.temp_dir), "left": []}
        return results


@dataclass
class RemoteCluster:
    """One Ray cluster on real TPU slices: its slices in order (the first holds, or first joined,
    the head), sharing one head and one token. The one owner of how they fit together: `cluster
    up`, `status`, `down` and the re-creation of a preempted slice all go through it."""

    slices: list[RemoteSlice]

    @staticmethod
    def new(specs: list[SliceSpec], *, port: int, temp_dir: str | None, python: str, dashboard: bool,
            head: LocalHead | None, setup: str | None, home: Path) -> RemoteCluster:
        """A cluster to bring up on `specs`; a head here (`head`) gets its marked temp dir under
        `home` (the state directory) once the cluster's token is known."""
        from tpulaunch.cluster import ownership

        first = RemoteSlice(specs[0], port=port, temp_dir=temp_dir, python=python, dashboard=dashboard, head=head,
                            setup=setup)
        if first.head is not None and not first.head.temp_dir:
            _path, token, _created = ensure_token(first.key)
            first.head = replace(first.head, temp_dir=ownership.make_temp_dir(cluster_id_of(token), home))
        rest = [RemoteSlice(s, port=port, temp_dir=first.temp_dir, python=python, dashboard=dashboard, head=first.head,
                            setup=setup, key=first.key) for s in specs[1:]]
        return RemoteCluster([first, *rest])

    @staticmethod
    def of(info: ClusterInfo) -> RemoteCluster:
        """The cluster a record describes."""
        return RemoteCluster([RemoteSlice.from_record(info, i) for i in range(len(info.slices))])

    @property
    def names(self) -> list[str]:
        return [rs.spec.name for rs in self.slices]

    def up(self, progress_for: Callable[[str], Progress], before: ClusterInfo | None = None) -> ClusterInfo:
        """Ray on every slice's workers (the head first, with the first slice), idempotent; the
        cluster's record, one for all its slices. `before`: its record, if it was up (a TPU whose
        VMs have other addresses now was re-created since: its workers join afresh)."""
        was = {s.name: [w.ip for w in s.workers] for s in (before.slices if before and before.remote else [])}
        infos = [rs.up(progress=progress_for(rs.spec.name),
                       replaced=rs.spec.name in was and was[rs.spec.name] != [w.ip for w in rs.spec.workers])
                 for rs in self.slices]
        info = infos[0]
        info.slices = [i.slices[0] for i in infos]
        assert info.remote is not None
        info.remote = replace(info.remote, tpus=tuple(self.names))
        return info

    def status_query(self) -> dict:
        """What the head says of its nodes (asked over ssh to worker 0, or here when the head is)."""
        return self.slices[0].query()

    def down(self, progress_for: Callable[[str], Progress]) -> dict[str, dict]:
        """Every slice's Ray processes stopped, the head (off the slices) after the last slice's
        workers: {"head" | "<slice>/<worker>" (several slices) | "<worker>": what was stopped}."""
        many = len(self.slices) > 1
        out: dict[str, dict] = {}
        for i, rs in enumerate(self.slices):
            got = rs.down(progress=progress_for(rs.spec.name), stop_head=i == len(self.slices) - 1)
            out.update({("head" if w == -1 else f"{rs.spec.name}/{w}" if many else str(w)): r for w, r in got.items()})
        return out

    def rejoin(self, info: ClusterInfo, index: int, fresh: SliceSpec, progress: Progress, wait_s: float,
               replaced: bool = True) -> None:
        """Slice `index` was made again (new VMs): set them up, join them to the head (whose address
        stays: it is off the slices) and keep the record's slice current. `replaced=False`: the old
        VMs' nodes are known gone (a join again): the slice's nodes in Ray are its own."""
        rs = self.slices[index]
        rs.spec = fresh
        rs.up(progress=progress, replaced=replaced, replaced_wait_s=wait_s)
        info.slices[index] = fresh
