"""What preflight reports: findings (error, warning, ok), the report, the error it raises."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning" | "ok"
    check: str
    message: str

    def __str__(self) -> str:
        return f"[{self.level.upper():7}] {self.check}: {self.message}"


class PreflightError(RuntimeError):
    """Preflight found errors; the message lists them all."""


@dataclass
class PreflightReport:
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def render(self) -> str:
        lines = [f"preflight ({self.seconds:.1f} s): {len(self.errors)} error(s)"]
        lines += [f"  {f}" for f in self.findings]
        return "\n".join(lines)

    def raise_on_errors(self) -> None:
        if self.errors:
            raise PreflightError(
                "preflight found errors:\n" + "\n".join(f"  {f}" for f in self.errors)
            )


def ok(check: str, message: str) -> list[Finding]:
    return [Finding("ok", check, message)]


def warning(check: str, message: str) -> list[Finding]:
    return [Finding("warning", check, message)]


def error(check: str, message: str) -> list[Finding]:
    return [Finding("error", check, message)]
