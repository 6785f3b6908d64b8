"""Exit 0 when node_modules holds exactly the versions package.json pins (.ci/run then
skips the ~40 s npm install)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
pinned = json.loads((ROOT / "package.json").read_text())["dependencies"]
for name, version in pinned.items():
    installed = ROOT / "node_modules" / name / "package.json"
    if not installed.is_file() or json.loads(installed.read_text())["version"] != version:
        sys.exit(1)
