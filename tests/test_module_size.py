"""Every module of the package fits in one reading: at most ``MAX_LINES`` lines. A module that grows
past it holds more than one idea; split it by idea (as ``source/commit_barrier`` left
``source/log_reader``, or ``cli/`` a module per command group), never by moving lines to a helper."""

from __future__ import annotations

from pathlib import Path

MAX_LINES = 500
ROOT = Path(__file__).resolve().parents[1] / "airflow_provider_lr"


def sizes(root: Path = ROOT) -> dict[str, int]:
    """Lines of every ``.py`` under ``root``, by path relative to the repository."""
    return {
        str(path.relative_to(root.parent)): len(path.read_text().splitlines()) for path in sorted(root.rglob("*.py"))
    }


def test_every_module_is_at_most_500_lines():
    found = sizes()
    assert found, f"no modules under {ROOT}"
    over = {path: lines for path, lines in found.items() if lines > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by idea): " + ", ".join(
        f"{path} ({lines})" for path, lines in sorted(over.items(), key=lambda item: -item[1])
    )
