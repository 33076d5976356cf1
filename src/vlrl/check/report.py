"""What a check finds, as records: a `Problem` (where + message), the `CheckReport` of a whole check (problems stop the
run, warnings are printed, facts say what was checked), the `PreflightError` a recipe raises with it, and the
generation `Budget` the context must fit. The preflight (`vlrl.check.preflight`) and the sample checks
(`vlrl.check.samples`) both fill a report; neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Problem:
    where: str  # a config field ("rollout.max_new_tokens"), "file:line", or a sample
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class CheckReport:
    """Problems stop the run; warnings are printed; facts say what was checked."""

    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def warn(self, where: str, message: str) -> None:
        self.warnings.append(Problem(where, message))

    def format(self) -> str:
        lines = [f"  · {fact}" for fact in self.facts]
        lines += [f"  ! {w}" for w in self.warnings]
        lines += [f"  ✗ {p}" for p in self.problems]
        verdict = (f"preflight: {len(self.problems)} problem(s) — the run would fail; nothing was loaded onto a device"
                   if self.problems else "preflight: ok" + (f" ({len(self.warnings)} warning(s))" if self.warnings else ""))
        here = str(Path.cwd()).rstrip("/") + "/"  # config paths are absolute: show those under the cwd relative
        return "\n".join([*lines, verdict]).replace(here, "")


class PreflightError(RuntimeError):
    """Raised by the recipes when the preflight check finds problems; the message lists them all."""

    def __init__(self, report: CheckReport) -> None:
        super().__init__(report.format())
        self.report = report


Budget = tuple[str, str, int]  # (split, field or option named in the problem, new tokens)
