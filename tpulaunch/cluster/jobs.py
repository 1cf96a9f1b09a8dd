"""Ray's job API and log API on the cluster's head (the dashboard, HTTP): submit, list, stop, read.

The one module that talks to Ray's dashboard. Every request carries the cluster's token explicitly
(`Authorization: Bearer <token>`): Ray's client adds it only when `RAY_AUTH_MODE` was set before
`import ray`, which a launcher cannot promise. A refused token, an unreachable head and an
unknown run are each one line (`ClusterError`, exit 5), never a traceback.

* Jobs: `submit` (the submission id is the run id: a second submission of the same id is refused
  by Ray, so a client killed mid-submit leaves a run or none), `info`, `list`, `stop`, `driver_log`.
* Files the supervisor writes under the head's Ray log directory (`tpulaunch/runs/<run id>/...`):
  `read_file` through the log API, which serves exactly that directory.
"""

from __future__ import annotations

import builtins
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import overload

from tpulaunch.errors import ClusterError

TIMEOUT_S = 15.0  # one request, whole (a head that answers a byte a second is cut off too)
MAX_ANSWER = 64 << 20  # what one answer may hold (a run's whole log included)
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class Unreachable(ClusterError):
    """Nothing answered at the dashboard's address (refused, reset, or no answer in time)."""


@dataclass(frozen=True)
class JobInfo:
    """What the job API knows of one submission."""

    submission_id: str
    status: str  # PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED
    entrypoint: str
    message: str
    start_time: float | None  # seconds (the API gives ms)
    end_time: float | None
    metadata: dict
    driver_exit_code: int | None
    driver_node_id: str | None
    error_type: str | None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def supervisor_lost(self) -> bool:
        """The job's driver died with its node (Ray's `JobErrorType.JOB_SUPERVISOR_ACTOR_DIED` and
        kin): what happened to the run's hosts is not known from here."""
        return bool(self.error_type) and "SUPERVISOR" in str(self.error_type)


def _info(d: dict) -> JobInfo:
    """A job as the API describes it; fields of the wrong type read as unknown, never as a crash."""
    def seconds(ms: object) -> float | None:
        return float(ms) / 1000.0 if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms else None

    def text(v: object) -> str:
        return v if isinstance(v, str) else ""

    def opt_int(v: object) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def opt_str(v: object) -> str | None:
        return v if isinstance(v, str) else None

    meta = d.get("metadata")
    return JobInfo(
        submission_id=text(d.get("submission_id")) or text(d.get("job_id")), status=text(d.get("status")),
        entrypoint=text(d.get("entrypoint")), message=text(d.get("message")), start_time=seconds(d.get("start_time")),
        end_time=seconds(d.get("end_time")),
        metadata={str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {},
        driver_exit_code=opt_int(d.get("driver_exit_code")), driver_node_id=opt_str(d.get("driver_node_id")),
        error_type=opt_str(d.get("error_type")),
    )


class JobApi:
    """The job and log APIs of one cluster's dashboard (`http://host:port`), with its token."""

    def __init__(self, url: str, token: str | None, timeout: float = TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout  # one request, whole

    def _request(self, method: str, path: str, body: dict | bytes | None = None, timeout: float | None = -1.0) -> bytes:
        timeout = self.timeout if timeout == -1.0 else timeout  # None: no bound
        raw = isinstance(body, bytes)
        headers = {"Content-Type": "application/octet-stream" if raw else "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = body if raw else json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            resp = urllib.request.urlopen(req, timeout=timeout)  # the cluster's own dashboard
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace").strip()
            if e.code in (401, 403):
                which = "no token" if not self.token else "the token"
                raise ClusterError(f"the Ray cluster at {self.url} refused {which} ({e.code})",
                                   "use the cluster's token (`eval \"$(tpulaunch cluster env)\"` where it was started)"
                                   ) from None
            raise _HttpError(e.code, text) from None
        except (urllib.error.URLError, OSError) as e:
            why = getattr(e, "reason", e)
            raise Unreachable(f"cannot reach the Ray dashboard (job API) at {self.url}: {why}",
                              "is the cluster up, with its dashboard? (`tpulaunch cluster status`)") from None
        return _read_bounded(resp, self.url, timeout)

    def version(self) -> dict:
        return json.loads(self._request("GET", "/api/version"))

    def wait_answering(self, timeout_s: float) -> dict:
        """The dashboard's version, once it answers: a head is ready before its dashboard is (KubeRay's
        probe asks the dashboard agent) and a loaded head may not answer the first request in time.
        Only an unreachable dashboard is waited for (a refused token is not); `Unreachable` after
        `timeout_s`."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                return self.version()
            except Unreachable:
                if time.monotonic() >= end:
                    raise
            time.sleep(1.0)

    def put_package(self, uri: str, data: bytes) -> None:
        """Store `data` in the cluster's GCS under `uri` (`gcs://NAME`), as Ray's job client stores a
        working directory: behind the token, readable by what runs on the cluster (`internal_kv`)."""
        protocol, _, name = uri.partition("://")
        try:
            self._request("PUT", f"/api/packages/{protocol}/{urllib.parse.quote(name)}", data)
        except _HttpError as e:
            raise ClusterError(f"the job API refused to store {uri} ({e.code}): {_first_line(e.text)}",
                               "see the head's dashboard log") from None

    def submit(self, *, entrypoint: str, submission_id: str, runtime_env: dict | None, metadata: dict[str, str],
               label_selector: dict[str, str] | None = None) -> str:
        runtime_env = self._upload_working_dir(runtime_env or {})
        body: dict = {"entrypoint": entrypoint, "submission_id": submission_id, "runtime_env": runtime_env,
                      "metadata": metadata}
        if label_selector:
            body["entrypoint_label_selector"] = label_selector
        try:
            doc = json.loads(self._request("POST", "/api/jobs/", body))
        except _HttpError as e:
            if "already exists" in e.text:
                raise ClusterError(f"a run with id {submission_id} was already submitted to this cluster",
                                   "see it with `tpulaunch status " + submission_id + "`") from None
            raise ClusterError(f"the job API refused the run ({e.code}): {_first_line(e.text)}",
                               "see the head's dashboard log") from None
        return str(doc.get("submission_id") or submission_id)

    def _upload_working_dir(self, runtime_env: dict) -> dict:
        """A local `working_dir` goes up to the cluster as a package (Ray's own client does the zip and
        the upload: the job then runs in the unpacked copy on the head)."""
        wd = runtime_env.get("working_dir")
        if not wd or "://" in str(wd):
            return runtime_env
        import logging
        import os

        saved = {k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ}
        logging.disable(logging.INFO)  # Ray's client logs every step of the upload at INFO
        try:  # (those variables would override the address the client is given)
            from ray.job_submission import JobSubmissionClient

            headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
            client = JobSubmissionClient(self.url, headers=headers)
            env = dict(runtime_env)
            client._upload_working_dir_if_needed(env)  # the upload ray job submit does
            return env
        except ClusterError:
            raise
        except Exception as e:  # Ray raises many types here
            raise ClusterError(f"could not upload the working directory to {self.url}: {type(e).__name__}:"
                               f" {_first_line(str(e))}", "check the address and the token") from None
        finally:
            os.environ.update(saved)
            logging.disable(logging.NOTSET)

    @overload
    def _json(self, method: str, path: str, kind: type[dict], body: dict | None = None) -> dict: ...

    @overload
    def _json(self, method: str, path: str, kind: type[list], body: dict | None = None) -> list[dict]: ...

    def _json(self, method: str, path: str, kind: type[dict] | type[list],
              body: dict | None = None) -> dict | list[dict]:
        """An answer that must be JSON of `kind` (dict or list): anything else is one line (exit 5)."""
        raw = self._request(method, path, body)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            raise ClusterError(f"the job API at {self.url} answered {path.split('?')[0]} with something that is not"
                               f" JSON ({_first_line(raw[:80].decode(errors='replace'))!r})",
                               "is that address the cluster's dashboard?") from None
        if not isinstance(doc, kind) or (kind is list and not all(isinstance(d, dict) for d in doc)):
            raise ClusterError(f"the job API at {self.url} answered {path.split('?')[0]} with a {type(doc).__name__},"
                               " not what Ray's job API gives", "is that address the cluster's dashboard?")
        return doc

    def info(self, submission_id: str) -> JobInfo | None:
        """The job, or None if the cluster does not know it."""
        try:
            return _info(self._json("GET", f"/api/jobs/{urllib.parse.quote(submission_id)}", dict))
        except _HttpError as e:
            if e.code == 404 or "does not exist" in e.text:
                return None
            raise ClusterError(f"the job API could not say what run {submission_id} is ({e.code}):"
                               f" {_first_line(e.text)}", "try again") from None

    def list(self) -> list[JobInfo]:
        try:
            return [_info(d) for d in self._json("GET", "/api/jobs/", list)]
        except _HttpError as e:
            raise ClusterError(f"the job API could not list runs ({e.code}): {_first_line(e.text)}",
                               "try again") from None

    def stop(self, submission_id: str) -> bool:
        try:
            return bool(self._json("POST", f"/api/jobs/{urllib.parse.quote(submission_id)}/stop", dict).get("stopped"))
        except _HttpError as e:
            raise ClusterError(f"the job API could not stop run {submission_id} ({e.code}): {_first_line(e.text)}",
                               "try again") from None

    def driver_log(self, submission_id: str) -> str:
        """What the run's supervisor printed (every host's prefixed lines and its progress)."""
        try:
            doc = self._json("GET", f"/api/jobs/{urllib.parse.quote(submission_id)}/logs", dict)
        except _HttpError as e:
            raise ClusterError(f"no log for run {submission_id} ({e.code}): {_first_line(e.text)}", "") from None
        return str(doc.get("logs") or "")

    def nodes(self) -> builtins.list[dict]:
        """Ray's nodes as its state API lists them (node_id, node_ip, state ALIVE/DEAD, labels, ...)."""
        try:
            doc = self._json("GET", "/api/v0/nodes?limit=10000&detail=true", dict)
        except _HttpError as e:
            raise ClusterError(f"the Ray head could not list its nodes ({e.code}): {_first_line(e.text)}",
                               "try again") from None
        return list(((doc.get("data") or {}).get("result") or {}).get("result") or [])

    def read_file(self, node_id: str, filename: str) -> str | None:
        """A file under that node's Ray log directory (None if it is not there)."""
        q = urllib.parse.urlencode({"node_id": node_id, "filename": filename, "lines": -1})
        try:
            text = self._request("GET", f"/api/v0/logs/file?{q}").decode(errors="replace")
        except _HttpError as e:
            if e.code in (404, 500) and ("not found" in e.text.lower() or "no such file" in e.text.lower()
                                         or "does not exist" in e.text.lower()):
                return None
            raise ClusterError(f"could not read {filename} on the head ({e.code}): {_first_line(e.text)}", "") from None
        # Ray 2.60's log API now and then answers 200 with nothing for a file that is not there (seen
        # after a run's files were removed): an empty answer is an empty file only if Ray lists it
        return text if text or self.has_file(node_id, filename) else None

    def has_file(self, node_id: str, filename: str) -> bool:
        """Ray's log API lists `filename` (a path under that node's Ray log directory)."""
        import glob

        q = urllib.parse.urlencode({"node_id": node_id, "glob": glob.escape(filename)})
        try:
            doc = self._json("GET", f"/api/v0/logs?{q}", dict)
        except _HttpError as e:
            raise ClusterError(f"could not list {filename} on the head ({e.code}): {_first_line(e.text)}", "") from None
        listed = (doc.get("data") or {}).get("result") or {}
        return isinstance(listed, dict) and any(isinstance(v, list) and filename in v for v in listed.values())


def _read_bounded(resp, url: str, timeout: float | None) -> bytes:  # an http.client response
    """The whole answer, within `timeout` in total and MAX_ANSWER bytes; ClusterError (exit 5) past either."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    parts: list[bytes] = []
    size = 0
    with resp:
        while True:
            chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            parts.append(chunk)
            if size > MAX_ANSWER:
                raise ClusterError(f"the answer from {url} is larger than {MAX_ANSWER >> 20} MiB",
                                   "is that the cluster's dashboard? (`tpulaunch cluster status`)")
            if deadline is not None and time.monotonic() > deadline:
                raise ClusterError(f"the answer from {url} took longer than {timeout:g} s",
                                   "the head may be overloaded; try again")


class _HttpError(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(code, text)
        self.code, self.text = code, text


def _first_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:300]
