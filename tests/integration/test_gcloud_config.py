"""Project and zone defaults from `gcloud config get-value`, through the fake gcloud on PATH."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from fakes import cli_env, hermetic_path, run_cli
from fakes.tpu_api_server import FakeTpuApi, standard_nodes, standard_queued_resources

from tpulaunch import discover as discovery


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """No host project/zone/endpoint/gcloud leaks into these tests."""
    for key in list(os.environ):
        if key.startswith(("TPULAUNCH_", "CLOUDSDK_", "FAKE_GCLOUD_")) or key in (
            "GOOGLE_CLOUD_PROJECT", "GOOGLE_APPLICATION_CREDENTIALS",
        ):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", hermetic_path(gcloud=False))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def _fake_gcloud(monkeypatch, tmp_path, project=None, zone=None):
    log = tmp_path / "gcloud.jsonl"
    monkeypatch.setenv("PATH", hermetic_path(gcloud=True))
    monkeypatch.setenv("FAKE_GCLOUD_LOG", str(log))
    if project:
        monkeypatch.setenv("FAKE_GCLOUD_PROJECT", project)
    if zone:
        monkeypatch.setenv("FAKE_GCLOUD_ZONE", zone)
    return log


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line)["argv"] for line in log.read_text().splitlines()] if log.exists() else []


def test_project_zone_from_flags_never_runs_gcloud(monkeypatch, tmp_path):
    log = _fake_gcloud(monkeypatch, tmp_path, project="g-proj", zone="g-zone")
    assert discovery.resolve_project_zone("p", "z") == ("p", "z", {"project": "--project flag", "zone": "--zone flag"})
    assert _calls(log) == []


def test_project_zone_from_gcloud_config(monkeypatch, tmp_path):
    log = _fake_gcloud(monkeypatch, tmp_path, project="g-proj", zone="us-central2-b")
    p, z, prov = discovery.resolve_project_zone(None, None)
    assert (p, z) == ("g-proj", "us-central2-b")
    assert prov == {"project": "gcloud config project", "zone": "gcloud config compute/zone"}
    assert _calls(log) == [["config", "get-value", "project"], ["config", "get-value", "compute/zone"]]


def test_gcloud_only_asked_for_what_is_missing(monkeypatch, tmp_path):
    log = _fake_gcloud(monkeypatch, tmp_path, project="g-proj", zone="g-zone")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "env-proj")
    p, z, prov = discovery.resolve_project_zone(None, None)
    assert (p, z) == ("env-proj", "g-zone")
    assert _calls(log) == [["config", "get-value", "compute/zone"]]


def test_gcloud_unset_values_and_no_gcloud(monkeypatch, tmp_path):
    _fake_gcloud(monkeypatch, tmp_path)  # on PATH, nothing configured
    assert discovery.resolve_project_zone(None, None) == (None, None, {})
    monkeypatch.setenv("PATH", hermetic_path(gcloud=False))
    assert discovery.resolve_project_zone(None, None) == (None, None, {})


def test_slow_gcloud_is_bounded(monkeypatch, tmp_path):
    _fake_gcloud(monkeypatch, tmp_path, project="g-proj", zone="g-zone")
    monkeypatch.setenv("FAKE_GCLOUD_DELAY", "20")
    monkeypatch.setenv("TPULAUNCH_GCLOUD_TIMEOUT", "0.5")
    start = time.monotonic()
    assert discovery.resolve_project_zone(None, None) == (None, None, {})
    assert time.monotonic() - start < 1 + 10


def test_project_zone_from_fake_gcloud(tmp_path):
    with FakeTpuApi(standard_nodes(), standard_queued_resources()) as api:
        _describe_with_gcloud_defaults(api, tmp_path)


def _describe_with_gcloud_defaults(api, tmp_path):
    log = tmp_path / "gcloud.jsonl"
    env = cli_env(
        tmp_path / "home", gcloud=True, TPULAUNCH_TPU_API_ENDPOINT=api.url,
        FAKE_GCLOUD_PROJECT="p", FAKE_GCLOUD_ZONE="us-central2-b", FAKE_GCLOUD_LOG=str(log),
    )
    proc = run_cli("slice", "describe", "my-v4", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["provenance"] == {"project": "gcloud config project", "zone": "gcloud config compute/zone"}
    calls = [json.loads(line)["argv"] for line in log.read_text().splitlines()]
    assert calls == [["config", "get-value", "project"], ["config", "get-value", "compute/zone"]]
