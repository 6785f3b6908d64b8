"""Screenshots of the HTML reports, for reviewers: one PNG per shipped topology's run
report, and the batch report, from `runtime batch topologies/ --agent demo`.

    python benchmarks/report_screenshots.py [--out DIR] [--width 1200]

Runs the main job in a temporary artifacts root, then has headless Chromium (Debian's
`chromium`; `apt-get install -y chromium`) render each report.html to a PNG under
--out (default artifacts/screenshots). Prints each PNG with the SVG DAG's width, so a
reviewer can check that every shipped topology's DAG fits the page.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def chromium() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("chromium is not installed: apt-get install -y chromium")
    return browser


def shoot(browser: str, page: Path, png: Path, width: int, height: int, profile: Path) -> None:
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={profile}", f"--window-size={width},{height}",
         f"--screenshot={png}", page.as_uri()],
        check=True, capture_output=True, timeout=120)


def page_height(report: Path) -> int:
    """A rough height so the whole page fits one image (capped)."""
    text = report.read_text()
    rows = text.count("<tr") + text.count("<h3") * 3 + text.count("<p")
    svg = re.search(r'<svg[^>]*height="(\d+)"', text)
    return min(9000, 500 + rows * 30 + (int(svg.group(1)) if svg else 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "artifacts" / "screenshots")
    parser.add_argument("--width", type=int, default=1200)
    args = parser.parse_args()
    browser = chromium()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "runtime", "batch", str(REPO / "topologies"), "--agent",
             "demo", "--batch-id", "shots", "--artifacts", str(root / "artifacts"),
             "--prompts", str(REPO / "prompts"), "--no-progress"],
            check=True, capture_output=True, timeout=600)
        reports = sorted((root / "artifacts" / "runs").glob("*/report.html"))
        reports.append(root / "artifacts" / "batches" / "shots" / "report.html")
        for report in reports:
            name = report.parent.name.removeprefix("shots-")
            png = args.out / f"{name}.png"
            shoot(browser, report, png, args.width, page_height(report), root / "profile")
            svg = re.search(r'<svg[^>]*width="(\d+)"', report.read_text())
            print(f"{png}  (DAG width {svg.group(1) if svg else '-'} px)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
