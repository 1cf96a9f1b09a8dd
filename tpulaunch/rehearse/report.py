"""What a rehearsal found: one record per program compiled for the target TPU, and the verdict.

Pure data: the rehearsal process writes one JSON line per program (`Program.to_dict`) as it
goes, so a process stopped or killed midway still leaves what it had found; the launcher reads
them back into a `Report`, prints its table and saves it with the run (`rehearsal.json`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

SCHEMA = "tpulaunch.rehearsal/v1"

# Collective opcodes in compiled HLO; an async pair (`all-gather-start` / `-done`) counts once.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_OP = re.compile(r"(?<![\w.-])(" + "|".join(sorted(COLLECTIVES, key=len, reverse=True)) + r")(-start)?\(")


def collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective a compiled module holds (its HLO text), by kind."""
    out: dict[str, int] = {}
    for m in _OP.finditer(hlo_text):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Program:
    """One XLA program as libtpu compiled it for the target: HBM per device, by use.

    Under SPMD every device runs the same partitioned program, so these are the numbers of each
    device (uneven shards are padded to the largest: the largest device's)."""

    name: str
    devices: int
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs that reuse a donated argument's buffer
    temp_bytes: int = 0
    code_bytes: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    compile_s: float = 0.0
    error: str = ""  # libtpu's refusal, when it would not compile the program

    @property
    def total_bytes(self) -> int:
        """What the program holds in HBM at once on one device: its arguments, outputs (less those
        aliased to donated arguments), temporaries and code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}

    @classmethod
    def from_dict(cls, d: dict) -> Program:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def gib(n: float) -> str:
    """Bytes for a person: `1.5 GiB`, `172 KiB`, `0 B`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}" if abs(n) < 100 * size else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"


def share(n: int, of: int) -> str:
    """`n` as a share of `of`, for the table: `12.50%`, `<0.01%`."""
    pct = 100 * n / of
    return f"{pct:.2f}%" if pct >= 0.01 else "<0.01%"


def verdict(p: Program, hbm_bytes: int, device_kind: str) -> str | None:
    """None when the program fits the target; else the one line that says why it would fail there."""
    if p.error:
        if "RESOURCE_EXHAUSTED" in p.error:
            held = p.argument_bytes + p.output_bytes
            return (f"program {p.name} does not fit {device_kind}'s HBM: its arguments and outputs alone hold {held}"
                    f" bytes ({gib(held)}) per device, against {hbm_bytes} bytes ({gib(hbm_bytes)}); libtpu: {p.error}")
        return f"program {p.name} does not compile for {device_kind}: {p.error}"
    if p.total_bytes > hbm_bytes:
        return (f"program {p.name} needs {p.total_bytes} bytes ({gib(p.total_bytes)}) per device, more than"
                f" {device_kind}'s {hbm_bytes} bytes ({gib(hbm_bytes)}) of HBM")
    return None


@dataclass
class Report:
    """A rehearsal: the target, every program compiled for it, and how it ended."""

    accelerator_type: str
    topology: str
    num_slices: int
    devices: int
    device_kind: str
    hbm_bytes: int  # per device, from the catalog
    libtpu_version: str
    programs: list[Program] = field(default_factory=list)
    stopped: str = ""  # the line that stopped the rehearsal before the CPU ran a program
    exit_code: int = 0
    script_exit: int | None = None  # the script's own exit code, when it ran to its end
    wall_s: float = 0.0
    peak_rss_bytes: int = 0  # the rehearsal process's largest resident set (what the CPU side held at most)
    log: str = ""

    @property
    def target(self) -> str:
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        return f"{self.accelerator_type} ({self.topology}){slices}"

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "target": self.target, "accelerator_type": self.accelerator_type,
                "topology": self.topology, "num_slices": self.num_slices, "devices": self.devices,
                "device_kind": self.device_kind, "hbm_bytes_per_device": self.hbm_bytes,
                "libtpu_version": self.libtpu_version, "exit_code": self.exit_code,
                "script_exit": self.script_exit, "stopped": self.stopped or None, "wall_s": round(self.wall_s, 3),
                "peak_rss_bytes": self.peak_rss_bytes, "log": self.log,
                "programs": [dict(p.to_dict(), hbm_share=round(p.total_bytes / self.hbm_bytes, 6))
                             for p in self.programs]}

    def header(self) -> str:
        return (f"rehearsal for {self.target}: {self.devices} devices of {self.device_kind},"
                f" {gib(self.hbm_bytes)} HBM each; libtpu {self.libtpu_version}")

    def table(self) -> list[str]:
        """One row per program (identical rows folded: `xN`); every number is per device."""
        rows: dict[tuple, list] = {}
        for p in self.programs:
            key = (p.name, p.devices, p.argument_bytes, p.output_bytes - p.alias_bytes, p.temp_bytes, p.code_bytes,
                   tuple(p.collectives.items()), p.error)
            rows.setdefault(key, [p, 0])[1] += 1
        head = ("program", "devices", "arguments", "outputs", "temporaries", "code", "total", "HBM", "collectives")
        body = []
        for p, n in rows.values():
            name = p.name + (f" x{n}" if n > 1 else "")
            coll = ", ".join(f"{k} {v}" for k, v in p.collectives.items()) or "-"
            if p.error:
                body.append((name, str(p.devices), gib(p.argument_bytes), gib(p.output_bytes), "-", "-", "-", "-",
                             f"libtpu refused it ({p.error.split(':')[0]})"))
                continue
            body.append((name, str(p.devices), gib(p.argument_bytes), gib(p.output_bytes - p.alias_bytes),
                         gib(p.temp_bytes), gib(p.code_bytes), gib(p.total_bytes),
                         share(p.total_bytes, self.hbm_bytes), coll))
        widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
        fmt = [("<" if i in (0, 8) else ">") for i in range(len(head))]
        return ["  ".join(f"{c:{a}{w}}" for c, a, w in zip(r, fmt, widths, strict=True)).rstrip()
                for r in (head, *body)]

    def verdict_line(self) -> str:
        if self.stopped:
            return f"{self.stopped}; the CPU did not run it; exit {self.exit_code}"
        largest = max(self.programs, key=lambda p: p.total_bytes, default=None)
        most = (f"; the largest, {largest.name}, uses {share(largest.total_bytes, self.hbm_bytes)} of a device's HBM"
                if largest else "")
        took = f"; libtpu compiled them in {sum(p.compile_s for p in self.programs):.1f} s" if self.programs else ""
        end = ("the script exited 0" if self.script_exit == 0 else
               f"the script exited {self.script_exit}" if self.script_exit is not None else "the script did not finish")
        return f"{len(self.programs)} program(s) fit {self.target}{most}{took}; {end}; exit {self.exit_code}"


def read_programs(path: str) -> tuple[list[Program], str]:
    """The rehearsal process's records: every program, and the stop line if one stopped it."""
    programs: list[Program] = []
    stopped = ""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return programs, stopped
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed process
        if "program" in rec:
            programs.append(Program.from_dict(rec["program"]))
        if rec.get("stop"):
            stopped = rec["stop"]
    return programs, stopped
