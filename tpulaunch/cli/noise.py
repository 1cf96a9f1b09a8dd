"""Known runtime noise, shown once per run on the terminal instead of once per host per compile.

Every host prints XLA's GSPMD deprecation warning at every compile and gloo's connection
messages at every group it opens: dozens of identical lines that bury the script's own output.
The terminal shows the first of each kind with a note that the rest are folded; the host logs
(`runs/<id>/host-<i>.log`) keep every line, and the end of the run says how many were folded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# (substring that identifies the line, what to call it)
KNOWN = (
    ("GSPMD sharding propagation is going to be deprecated", "XLA's GSPMD deprecation warning"),
    ("Expected number of connected peer ranks is", "gloo's connection messages"),
    ("Duplicate keys to remove:", "torch.distributed.checkpoint's dedup log"),
    ("Using a non-tuple sequence for multidimensional indexing is deprecated", "torch_xla's indexing warning"),
)


@dataclass
class NoiseFold:
    counts: dict[str, int] = field(default_factory=dict)

    def classify(self, text: str) -> str:
        """'show' (not noise), 'first' (noise, first of its kind: show it), or 'fold' (hide)."""
        for needle, name in KNOWN:
            if needle in text:
                n = self.counts.get(name, 0)
                self.counts[name] = n + 1
                return "first" if n == 0 else "fold"
        return "show"

    def summary(self) -> str | None:
        folded = {name: n - 1 for name, n in self.counts.items() if n > 1}
        if not folded:
            return None
        parts = ", ".join(f"{name} x {n}" for name, n in folded.items())
        return (f"folded {sum(folded.values())} repeated line(s) of known runtime noise ({parts}); every line is in"
                " the host logs")
