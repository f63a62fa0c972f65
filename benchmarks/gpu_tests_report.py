"""The records of `benchmarks/gpu_tests.py` merged into one table, file x card, so a closing note can say which
files of `tests/gpu` passed on which card at which commit.

A file's cell on a card is its newest result there that ran (a "not run" never hides a result), with the commit
beside it where that is not the card's newest; every file of the tests folder gets a row, so a file no shard ran
reads "not run"."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from benchmarks import gpu_shards as gs

RAN = {"passed", "failed", "skipped", "timeout", "crashed", "no tests"}


def load_records(paths: list[Path]) -> list[dict]:
    """Every gpu_tests record in these files or folders (searched to any depth)."""
    records = []
    for p in paths:
        for f in sorted(p.rglob("*.json")) if p.is_dir() else [p]:
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("kind") == "gpu_tests":
                records.append(data)
    return records


def merge(records: list[dict]) -> dict[str, dict]:
    """{card: {"commits": [newest first], "files": {file: result with its commit}}}."""
    cards: dict[str, dict] = {}
    for rec in sorted(records, key=lambda r: r["environment"].get("started", "")):
        env = rec["environment"]
        card = cards.setdefault(env["device"], {"commits": [], "files": {}})
        if env["commit"] in card["commits"]:
            card["commits"].remove(env["commit"])
        card["commits"].insert(0, env["commit"])
        for res in rec["files"]:
            old = card["files"].get(res["file"])
            if res["status"] in RAN or old is None or old["status"] not in RAN:
                card["files"][res["file"]] = {**res, "commit": env["commit"], "started": env.get("started")}
    return cards


def cell(res: dict | None, newest: str) -> str:
    if res is None or res["status"] in ("not run", "pending", "running"):
        return "not run" + (f" ({res['reason']})" if res and res.get("reason") else "")
    s, n, bad = res["status"], res.get("tests", 0), res["failed"] + res["errors"]
    skipped = f", {res['skipped']} skipped" if res.get("skipped") and s != "skipped" else ""
    text = {"passed": f"pass {res['passed']}{skipped}",
            "failed": f"**FAIL** {bad} of {n}{skipped}",
            "skipped": f"skipped (all {n})",
            "timeout": f"**TIMEOUT** at {res.get('timeout_s')} s ({res['passed']} passed, {bad} failed of "
                       f"{res.get('collected', '?')})",
            "crashed": f"**CRASHED** (exit {res.get('returncode')})",
            "no tests": "no tests"}[s]
    return text + (f" @{res['commit']}" if res["commit"] != newest else "")


def _summary(results: list[dict]) -> str:
    got = Counter("not run" if r["status"] in ("pending", "running") else r["status"] for r in results)
    passed = sum(r.get("passed", 0) for r in results)
    bad = sum(r.get("failed", 0) + r.get("errors", 0) for r in results)
    return ", ".join(f"{k} {v}" for k, v in sorted(got.items())) + f"; tests: {passed} passed, {bad} failed"


def markdown(cards: dict[str, dict], files: list[str]) -> str:
    names = sorted(cards)
    rows = sorted(set(files) | {f for c in cards.values() for f in c["files"]})
    per_card = {n: [cards[n]["files"].get(f, {"file": f, "status": "not run"}) for f in rows] for n in names}
    lines = [f"`tests/gpu` by card: {len(rows)} file(s).", "",
             "| file | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|",
             "| commit | " + " | ".join(", ".join(cards[n]["commits"]) for n in names) + " |"]
    for f in rows:
        cells = [cell(cards[n]["files"].get(f), cards[n]["commits"][0]) for n in names]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    lines.append("| **files** | " + " | ".join(_summary(per_card[n]) for n in names) + " |")
    for n in names:
        failing = [x for r in per_card[n] for x in r.get("failures", [])]
        stuck = [r for r in per_card[n] if r["status"] in ("timeout", "crashed")]
        if failing or stuck:
            lines += ["", f"Failing on {n}:"]
            lines += [f"- `{x['id']}` ({x['kind']})" + (f": {x['message'].splitlines()[0]}" if x["message"] else "")
                      for x in failing]
            lines += [f"- `{r['file']}` {r['status']}" + (f", in `{r['cut_off_in']}`" if r.get("cut_off_in") else "")
                      for r in stuck]
    return "\n".join(lines) + "\n"


def report_main(paths: list[Path], md_path: Path | None, tests_dir: Path, durations_path: Path | None) -> int:
    records = load_records(paths)
    if not records:
        raise SystemExit(f"no gpu_tests records under {', '.join(map(str, paths))}")
    cards = merge(records)
    text = markdown(cards, gs.gpu_test_files(tests_dir))
    print(text, end="")
    md_path = md_path or (paths[0] if paths[0].is_dir() else paths[0].parent) / "REPORT.md"
    md_path.write_text(text)
    print(f"written: {md_path}")
    if durations_path is not None:
        durations = gs.load_durations(durations_path)
        updated = []
        for rec in sorted(records, key=lambda r: r["environment"].get("started", "")):
            if rec["environment"].get("device") != "cpu" and rec.get("jobs", 1) == 1:
                updated += gs.update_durations(durations, rec["files"], rec["environment"])
        gs.save_durations(durations, durations_path)
        print(f"durations: {len(set(updated))} file(s) updated in {durations_path}")
    bad = {"failed", "timeout", "crashed"}
    return 1 if any(r["status"] in bad for c in cards.values() for r in c["files"].values()) else 0
