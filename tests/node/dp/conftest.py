import sys
from pathlib import Path

# The process-world harness (tests/node/tp) and the checkpoints and references of the equivalence
# suites (tests/node/models) are shared with the TP tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
