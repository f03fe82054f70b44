import sys
from pathlib import Path

# The process-world harness lives next to the TP primitive tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))
