"""`run --rehearse`, its pure parts: the verdict and its bytes, the table, the records read back,
the target's HBM and libtpu arguments, and what is refused before anything starts.

The rehearsal itself (a process, JAX and libtpu compiling) is in tests/integration/test_rehearsal_runs.py.
"""

from __future__ import annotations

import json

import pytest

from fakes import invoke
from support import write_scripts
from tpulaunch import rehearse
from tpulaunch.errors import ExitCode, LaunchError
from tpulaunch.plan.catalog import GENERATIONS
from tpulaunch.plan.topology import resolve
from tpulaunch.rehearse import target as T
from tpulaunch.rehearse.report import Program, Report, collectives, read_programs, verdict
from tpulaunch.run.prepare import LaunchRequest, Target, prepare
from tpulaunch import discover

GiB = 2**30

# Lines as libtpu's compiled HLO writes them: async pairs, tuple shapes, and names that only
# contain an opcode (a computation called `all-reduce-scatter-fusion`, an instruction `%all-gather.3`).
HLO = """
  %all-reduce-start.1 = (f32[16]{0}, f32[8]{0}) all-reduce-start(f32[16]{0} %p0, f32[8]{0} %p1), replica_groups=[4,16]<=[64]
  %all-reduce-done.1 = (f32[16]{0}, f32[8]{0}) all-reduce-done((f32[16]{0}, f32[8]{0}) %all-reduce-start.1)
  %all-gather.3 = f32[64]{0} all-gather(f32[16]{0} %x), dimensions={0}
  %fusion.2 = f32[4]{0} fusion(f32[64]{0} %all-gather.3), kind=kLoop, calls=%all-reduce-scatter-fusion.1
  %collective-permute-start = (f32[4]{0}, f32[4]{0}) collective-permute-start(f32[4]{0} %y), source_target_pairs={{0,1}}
  %collective-permute-done = f32[4]{0} collective-permute-done((f32[4]{0}, f32[4]{0}) %collective-permute-start)
  %a2a = f32[8]{0} all-to-all(f32[8]{0} %z), dimensions={0}
  %rs = f32[2]{0} reduce-scatter(f32[8]{0} %z), dimensions={0}, to_apply=%add
"""


def test_collectives_are_counted_by_kind_once_per_async_pair():
    assert collectives(HLO) == {"all-gather": 1, "all-reduce": 1, "all-to-all": 1, "collective-permute": 1,
                                "reduce-scatter": 1}
    assert collectives("%add.1 = f32[] add(f32[] %a, f32[] %b)") == {}


def test_a_program_over_the_chips_hbm_is_stopped_with_its_bytes_against_the_chips():
    hbm = T.hbm_bytes_per_device(GENERATIONS["v5e"])
    assert hbm == 16 * GiB
    fits = Program("train_step", 16, argument_bytes=GiB, output_bytes=GiB, alias_bytes=GiB, temp_bytes=2 * GiB,
                   code_bytes=2**20)
    assert fits.total_bytes == 3 * GiB + 2**20 and verdict(fits, hbm, "TPU v5 lite") is None
    over = Program("big", 16, output_bytes=17 * GiB)
    line = verdict(over, hbm, "TPU v5 lite")
    assert line == ("program big needs 18253611008 bytes (17.0 GiB) per device, more than TPU v5 lite's"
                    " 17179869184 bytes (16.0 GiB) of HBM")
    refused = Program("big", 16, output_bytes=17 * GiB, error="RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    line = verdict(refused, hbm, "TPU v5 lite")
    assert line.startswith("program big does not fit TPU v5 lite's HBM: its arguments and outputs alone hold"
                           " 18253611008 bytes (17.0 GiB) per device, against 17179869184 bytes")
    assert line.endswith("libtpu: RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    other = Program("k", 4, error="UNIMPLEMENTED: no TPU lowering for custom call lapack_sgesdd")
    assert verdict(other, hbm, "TPU v5 lite") == ("program k does not compile for TPU v5 lite: UNIMPLEMENTED: no TPU"
                                                  " lowering for custom call lapack_sgesdd")


def test_hbm_per_device_is_the_chips_shared_by_its_devices():
    per = {g: T.hbm_bytes_per_device(GENERATIONS[g]) // GiB for g in ("v4", "v5e", "v5p", "v6e", "v7x", "v3")}
    assert per == {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "v7x": 96, "v3": 16}


def test_libtpu_is_asked_for_tpulaunchs_host_blocks_megacore_and_slices():
    assert T.topology_args(resolve("v4-32")) == {"topology_name": "v4:2x2x4", "platform": "tpu",
                                                 "chips_per_host_bounds": (2, 2, 1), "chip_config_name": "megacore"}
    args = T.topology_args(resolve(topology="2x4", accelerator="v6e"), 2)
    assert (args["topology_name"], args["chips_per_host_bounds"], args["num_slices"]) == ("v6e:2x4", (2, 4, 1), 2)
    assert T.topology_args(resolve("tpu7x-128"))["topology_name"] == "tpu7x:4x4x4"
    env = T.libtpu_env(resolve("v5p-128"))
    assert env["TPU_SKIP_MDS_QUERY"] == "1" and env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
    assert env["TPU_ACCELERATOR_TYPE"] == "v5p-128"


def test_the_table_folds_identical_programs_and_the_json_has_every_one(tmp_path):
    small = Program("convert_element_type", 1, 512, 512, 0, 0, 51200)
    step = Program("train_step", 64, 706 * 2**10, 2**20, 2**20 - 736, 7 * 2**20, 2 * 2**20, {"all-reduce": 9})
    report = Report("v5p-128", "4x4x4", 1, 64, "TPU v5", 95 * GiB, "0.0.42.1", [small, small, small, step])
    rows = report.table()
    assert rows[0].split() == ["program", "devices", "arguments", "outputs", "temporaries", "code", "total", "HBM",
                               "collectives"]
    assert rows[1].split()[:2] == ["convert_element_type", "x3"] and len(rows) == 3
    assert rows[2].split()[-2:] == ["all-reduce", "9"]
    doc = report.to_dict()
    assert doc["schema"] == "tpulaunch.rehearsal/v1" and doc["libtpu_version"] == "0.0.42.1"
    assert len(doc["programs"]) == 4 and doc["programs"][3]["total_bytes"] == step.total_bytes
    assert "libtpu 0.0.42.1" in report.header()
    # records as the rehearsal process writes them; a last line cut short by a kill is skipped
    path = tmp_path / "programs.jsonl"
    path.write_text(json.dumps({"program": step.to_dict(), "stop": None}) + "\n"
                    + json.dumps({"program": small.to_dict(), "stop": "program x does not fit"}) + "\n{\"progr")
    programs, stopped = read_programs(str(path))
    assert programs == [step, small] and stopped == "program x does not fit"


def _plan(workdir, script: str, **kw):
    req = LaunchRequest(script=str(workdir / script), workdir=str(workdir), log_dir=str(workdir / "runs"), rehearse=True,
                        slices=discover.SliceRequest(topology=kw.pop("topology", "4x4x4"),
                                                     accelerator=kw.pop("accelerator", "v5p")), **kw)
    return prepare(req, Target(None), None, None).plan


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return write_scripts(tmp_path_factory.mktemp("rehearse"), {
        "j.py": "import jax\n", "t.py": "import torch_xla\n", "n.py": "print('hi')\n"})


def test_a_rehearsal_plans_slices_this_machine_could_never_emulate(workdir):
    """A v5p-128 is 16 hosts: too many to emulate here, one process to rehearse."""
    plan = _plan(workdir, "j.py")
    assert len(plan.hosts) == 16 and plan.mesh.num_devices == 64
    assert rehearse.check(plan, "0.0.42.1") == "0.0.42.1"


def test_what_cannot_be_rehearsed_is_one_line_each(workdir):
    with pytest.raises(LaunchError) as e:
        rehearse.check(_plan(workdir, "j.py"), None)
    assert e.value.line().startswith("--rehearse needs libtpu, which is not installed. install the TPU compiler:"
                                     " pip install 'tpulaunch[rehearse]'")
    with pytest.raises(LaunchError) as e:
        rehearse.check(_plan(workdir, "t.py"), "0.0.42.1")
    assert e.value.message.startswith("--rehearse cannot rehearse torch_xla: torch_xla 2.9 compiles")
    assert "\n" not in e.value.line()
    with pytest.raises(LaunchError) as e:
        rehearse.check(_plan(workdir, "n.py", framework="none"), "0.0.42.1")
    assert "no XLA program" in e.value.message
    with pytest.raises(LaunchError) as e:  # 4096 devices: more than XLA's CPU client runs a program over
        rehearse.check(_plan(workdir, "j.py", topology="16x16x16"), "0.0.42.1")
    assert e.value.message.startswith("--rehearse holds the slice's 4096 devices in one process as CPU devices, and"
                                      " XLA's CPU client runs a program over at most 2048")
    assert rehearse.check(_plan(workdir, "j.py", topology="8x16x16"), "0.0.42.1")  # 2048: rehearsed (52 s here)


@pytest.mark.parametrize("flags, says", [
    (["--dry-run"], "--rehearse runs the script once, here: it goes without --dry-run and --detach"),
    (["--address", "127.0.0.1:6379"], "--rehearse compiles here, in one process of this Python, and starts no cluster:"
                                      " it goes without --address"),
    (["--python", "/usr/bin/python3"], "it goes without --python"),
])
def test_rehearse_refuses_flags_that_ask_for_a_launch(workdir, flags, says):
    proc = invoke("run", "j.py", "--topology", "2x2x1", "--accelerator", "v5p", "--rehearse", *flags, cwd=workdir)
    assert proc.returncode == ExitCode.USAGE and says in proc.stderr, proc.stderr
    assert not (workdir / "runs").exists()


def test_torch_xla_is_refused_in_one_line_before_anything_starts(workdir):
    proc = invoke("run", "t.py", "--topology", "2x2x1", "--accelerator", "v5p", "--rehearse", cwd=workdir)
    assert proc.returncode == ExitCode.USAGE
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")] == [
        "error: --rehearse cannot rehearse torch_xla: " + rehearse.CANNOT["torch_xla"] + ". run without --rehearse"]
