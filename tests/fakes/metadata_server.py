"""A fake GCE metadata server (`/computeMetadata/v1/...`) as seen from one worker of a TPU slice.

Like the real one it refuses requests without `Metadata-Flavor: Google` (403), answers with that
header, 404s unknown keys, and lists a directory for a trailing `/`.

    with FakeMetadataServer.for_slice("v4-32", "2x2x4", worker=1) as md:
        env["TPULAUNCH_METADATA_HOST"] = md.host
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

PREFIX = "/computeMetadata/v1/"


def _host_bounds(shape: str, chips_per_host: int) -> tuple[str, str]:
    dims = [int(d) for d in shape.split("x")]
    dims3 = dims + [1] * (3 - len(dims))
    chips = dims3[0] * dims3[1] * dims3[2]
    if chips <= chips_per_host:
        return ",".join(map(str, dims3)), "1,1,1"
    per = (2, 2, 1)
    return ",".join(map(str, per)), ",".join(str(d // p) for d, p in zip(dims3, per))


class FakeMetadataServer:
    """Serves `values`: a flat map of metadata paths (relative to /computeMetadata/v1/) to text."""

    def __init__(self, values: dict[str, str] | None = None) -> None:
        self.values: dict[str, str] = dict(values or {})
        self.requests: list[tuple[str, str | None]] = []  # (path, Metadata-Flavor header)
        self._server: ThreadingHTTPServer | None = None

    @classmethod
    def for_slice(
        cls,
        accelerator_type: str = "v4-32",
        topology: str = "2x2x4",
        *,
        worker: int = 0,
        hosts: int = 4,
        name: str = "my-v4",
        zone: str = "us-central2-b",
        project: str = "p",
        project_number: str = "123456789012",
        ip_prefix: str = "10.130.0",
        chips_per_host: int = 4,
        multislice: tuple[int, int] | None = None,  # (slice_id, num_slices)
        preempted: bool = False,
    ) -> "FakeMetadataServer":
        """The metadata a TPU VM sees: worker `worker` of a `hosts`-VM slice."""
        endpoints = ",".join(
            f"t1v-n-{name}-w-{i}:{8470 + i}:{ip_prefix}.{i + 2}" for i in range(hosts)
        )
        cphb, hb = _host_bounds(topology, chips_per_host)
        env = {
            "ACCELERATOR_TYPE": accelerator_type,
            "CHIPS_PER_HOST_BOUNDS": cphb,
            "CONSUMER_PROJECT_ID": project,
            "HOST_BOUNDS": hb,
            "NODE_ID": name,
            "TOPOLOGY": topology,
            "TPU_RUNTIME_METRICS_PORTS": "8431,8432,8433,8434",
            "WORKER_ID": str(worker),
            "WRAP": "false,false,false",
            "ZONE": zone,
        }
        if multislice:
            env["MEGASCALE_COORDINATOR_ADDRESS"] = f"{ip_prefix}.2:8080"
            env["MEGASCALE_NUM_SLICES"] = str(multislice[1])
            env["MEGASCALE_SLICE_ID"] = str(multislice[0])
        values = {
            "instance/attributes/accelerator-type": accelerator_type,
            "instance/attributes/agent-worker-number": str(worker),
            "instance/attributes/worker-network-endpoints": endpoints,
            "instance/attributes/instance-id": name,
            "instance/attributes/tpu-env": tpu_env_text(env),
            "instance/attributes/startup-script": "#!/bin/bash\necho hello\n",
            "instance/zone": f"projects/{project_number}/zones/{zone}",
            "instance/hostname": f"t1v-n-{name}-w-{worker}.{zone}.c.{project}.internal",
            "instance/id": "7356104612345678901",
            "instance/preempted": "TRUE" if preempted else "FALSE",
            "instance/scheduling/preemptible": "FALSE",
            "project/project-id": project,
            "project/numeric-project-id": project_number,
        }
        return cls(values)

    # -- lifecycle
    def start(self) -> "FakeMetadataServer":
        fake = self

        class Handler(_Handler):
            md = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-metadata", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> "FakeMetadataServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def host(self) -> str:
        """`host:port`, the form TPULAUNCH_METADATA_HOST / GCE_METADATA_HOST take."""
        assert self._server is not None, "start() first"
        return f"127.0.0.1:{self._server.server_address[1]}"

    # -- behaviour
    def answer(self, path: str, flavor: str | None) -> tuple[int, str]:
        self.requests.append((path, flavor))
        if flavor != "Google":
            return 403, "Missing Metadata-Flavor:Google header.\n"
        if not path.startswith(PREFIX):
            return 404, "Not Found\n"
        key = path[len(PREFIX):]
        if key in self.values:
            return 200, self.values[key]
        if key == "" or key.endswith("/"):
            children = sorted({k[len(key):].split("/", 1)[0] + ("/" if "/" in k[len(key):] else "")
                               for k in self.values if k.startswith(key)})
            if children:
                return 200, "\n".join(children) + "\n"
        return 404, "Not Found\n"


def tpu_env_text(env: dict[str, str]) -> str:
    """The `tpu-env` attribute: YAML-ish `KEY: 'value'` lines."""
    return "".join(f"{k}: '{v}'\n" for k, v in env.items())


class _Handler(BaseHTTPRequestHandler):
    md: FakeMetadataServer

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        code, text = self.md.answer(urlsplit(self.path).path, self.headers.get("Metadata-Flavor"))
        body = text.encode()
        self.send_response(code)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", "application/text")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass
