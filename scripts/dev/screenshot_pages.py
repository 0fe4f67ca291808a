#!/usr/bin/env python3
"""Screenshots of every dashboard page of a running control plane, e.g. under ``make up``
with traffic flowing (the browser tests take theirs from seeded data).

    .venv/bin/python scripts/dev/screenshot_pages.py --password PASS --out docs/screenshots/up

Signs in as ``--user`` with Chromium (``--chromium``, Debian's by default) through Playwright,
opens each list page and the first item each one links to, waits ``--settle`` seconds for
the live panels' first poll, and writes one full-page PNG per page. A page that answers an
error is reported and the script exits 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# (name, list page, the CSS selector of a link on it to the page named name + "-detail")
PAGES = (
    ("overview", "/", None),
    ("nodes", "/nodes/", "table a[href^='/nodes/']"),
    ("deployments", "/deployments/", "table a[href^='/deployments/']"),
    ("profiles", "/profiles/", "table a[href^='/profiles/']"),
    ("policy", "/policy/", None),
    ("tenants", "/tenants/", "table a[href^='/tenants/']"),
    ("batches", "/batches/", "table a[href^='/batches/']"),
    ("benchmarks", "/benchmarks/", "table a[href^='/benchmarks/']"),
)
DETAIL_NAMES = {
    "nodes": "node",
    "deployments": "deployment",
    "profiles": "profile",
    "tenants": "tenant",
    "batches": "batch",
    "benchmarks": "benchmark",
}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


def shoot(page: Any, base: str, path: str, out: Path, name: str, settle: float) -> bool:
    response = page.goto(base + path, wait_until="networkidle")
    if response is None or response.status >= 400:
        status = response.status if response is not None else "no answer"
        print(f"{name}: {path} answered {status}", file=sys.stderr)
        return False
    time.sleep(settle)
    page.screenshot(path=str(out / f"{name}.png"), full_page=True)
    print(f"{name}: {path}")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after each load")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="syshax-shots-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=args.chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        page = context.new_page()
        page.goto(args.base + "/accounts/login/")
        page.fill("input[name=username]", args.user)
        page.fill("input[name=password]", args.password)
        page.click("button[type=submit], input[type=submit]")
        page.wait_for_load_state("networkidle")
        for name, path, link in PAGES:
            ok = shoot(page, args.base, path, args.out, name, args.settle) and ok
            if link is None:
                continue
            found = page.locator(link).first
            if found.count() == 0:
                print(f"{name}: nothing listed to open", file=sys.stderr)
                continue
            href = found.get_attribute("href") or ""
            ok = shoot(page, args.base, href, args.out, DETAIL_NAMES[name], args.settle) and ok
        context.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
