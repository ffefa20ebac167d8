"""Where things are, for every tier (tests/README.md): the repository root and the shared test fixtures.
Tests live one or two folders below tests/, so they import these instead of counting `Path(__file__)` parents."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"                 # recorded inputs shared by the tiers
ENGINE_PY = REPO / "build" / "vllm-venv" / "bin" / "python"   # the engine venv (`make engine`)


def tier_of(path) -> str:
    """The tier a test file belongs to: its first folder below tests/ (tests/README.md)."""
    try:
        parts = Path(path).resolve().relative_to(REPO / "tests").parts
    except ValueError:
        return "other"
    return parts[0] if len(parts) > 1 else "tests"
