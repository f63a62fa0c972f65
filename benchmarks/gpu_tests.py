"""`tests/gpu` in shards that each fit one 600 s command, and a per-card record of what passed.

Run from the repository root on the GPU machine (nothing is installed; pytest and the repository are all it needs):
    python3 -m benchmarks.gpu_tests --list                      the files, their estimates and the packing
    python3 -m benchmarks.gpu_tests --shard 2/5                 shard 2 of 5 of the one-GPU files
    python3 -m benchmarks.gpu_tests --budget-s 480 --shard 2    as many shards as keep each within 480 s; the 2nd
    python3 -m benchmarks.gpu_tests --group multi --shard 1/2   the files that need 2+ GPUs (skipped with fewer)
    python3 -m benchmarks.gpu_tests --all --jobs 3              every one-GPU file, three pytest processes at a time
    python3 -m benchmarks.gpu_tests --rerun DIR                 the files DIR's records did not see pass, one at a time
    python3 -m benchmarks.gpu_tests --files test_a.py test_b.py these files
    python3 -m benchmarks.gpu_tests --report DIR... [--markdown PATH] [--update-durations]

Each file runs in its own pytest process under its own timeout: an engine's GPU memory, a CUDA context left broken
by an illegal access, NCCL state or a hung graph capture ends with its file instead of failing every file after it,
and a file cut off by its timeout leaves the others' results whole. The cost is a Python start and torch import per
file (``startup_s`` in the durations file, ~10 s). The record (JSON, rewritten after each file so a command killed at
its limit still leaves one) goes to --out, default $OUT when set, else benchmarks/results/gpu_tests/; pytest's log and
junit XML of each file go beside it under logs/.

With --jobs N, N files run at once from one queue, longest first, sharing the GPU: each file's engines plan within
0.9 / N of the card (GRAPHSERVE_GPU_MEMORY_FRACTION), so engines beside each other start. The suite then takes a
fraction of its serial time; a failure that comes from the company (memory, a timeout) is told from a real one by
running the file again alone: the files that did not pass run one at a time, in the time left before the deadline,
into a second record (group "...-alone"; --no-alone leaves them), and --rerun DIR does the same in a later command
for the files a folder's records did not see pass. A record of files run beside each other says `"jobs": N`, and
its times, inflated by the company, never go into the durations file.

The durations file changes only when asked (--update-durations): shards packed from one durations file in one call
after another must see the same estimates, or a file moved by an update between them would run twice or never. Fold a
whole suite's records in at once with --report DIR... --update-durations, and commit tests/gpu/durations.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks import gpu_shards as gs
from graphserve import env

RESULTS = gs.REPO / "benchmarks" / "results" / "gpu_tests"
# Of the command's 600 s: past it no file starts and a running one is cut off (up to 15 s to end its processes), so
# the record lands with the stamp's ~10 s before it.
DEADLINE_S = 540.0
MIN_TIMEOUT_S = 120.0
SHARED_MEMORY = 0.9  # --jobs N: each file's engines plan within 0.9 / N of the card
MIN_START_S = 30.0  # a file started with less left would only be cut off: its process start alone takes ~10 s
_STAMP = ("import json, torch; from graphserve.tuning.timing import environment; e = environment(); "
          "e['device_count'] = torch.cuda.device_count(); print(json.dumps(e))")
_PROGRESS = re.compile(r"^(\S.*?::.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)
_RUNNING = re.compile(r"^(\S.*?::\S+) ?$")


def stamp(python: str = sys.executable) -> dict:
    """The card, versions and commit (graphserve.tuning.timing.environment, as the benchmarks stamp), read in a
    child so this process never holds a CUDA context beside the tests'."""
    proc = subprocess.run([python, "-c", _STAMP], cwd=gs.REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise SystemExit(f"cannot stamp the run: {why}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _test_id(rel: str, classname: str, name: str) -> str:
    parts = classname.split(".")
    stem = Path(rel).stem
    classes = parts[len(parts) - parts[::-1].index(stem):] if stem in parts else []
    return "::".join([rel, *classes, name])


def parse_junit(path: Path, rel: str) -> dict:
    """Counts, pytest's own suite time and the failing ids of one file's junit XML."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    out = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": [], "skip_reasons": {},
           "pytest_seconds": float(suite.get("time", 0.0))}
    for case in suite.iter("testcase"):
        tid = _test_id(rel, case.get("classname", ""), case.get("name", ""))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            out["failed" if bad.tag == "failure" else "errors"] += 1
            out["failures"].append({"id": tid, "kind": bad.tag, "message": (bad.get("message") or "")[:300]})
        elif case.find("skipped") is not None:
            out["skipped"] += 1
            reason = (case.find("skipped").get("message") or "")[:200]
            out["skip_reasons"][reason] = out["skip_reasons"].get(reason, 0) + 1
        else:
            out["passed"] += 1
    return out


def parse_progress(log: str) -> dict:
    """What a file cut off before its junit XML got done, from pytest -v's progress lines, and the test it was in."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": [], "skip_reasons": {},
           "pytest_seconds": None}
    for tid, word in _PROGRESS.findall(log):
        key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}.get(word, "skipped")
        out[key] += 1
        if key in ("failed", "errors"):
            out["failures"].append({"id": tid, "kind": key, "message": ""})
    collected = re.search(r"collected (\d+) items?", log)
    if collected:
        out["collected"] = int(collected.group(1))
    running = [line for line in log.splitlines() if _RUNNING.match(line) and not _PROGRESS.match(line)]
    if running:
        out["cut_off_in"] = running[-1].strip()
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_file(rel: str, cwd: Path, log_dir: Path, timeout_s: float, python: str = sys.executable,
             extra_env: dict[str, str] | None = None) -> dict:
    """One test file in its own pytest process (its own session, so a timeout ends the ranks and servers it
    started too): counts, failing ids, wall and pytest seconds, and a status."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(rel).stem
    junit, log = log_dir / f"{stem}.xml", log_dir / f"{stem}.log"
    junit.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations=10", f"--junitxml={junit}", rel]
    t0 = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})})
        try:
            rc, timed_out = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = proc.returncode, True
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    counts = parse_junit(junit, rel) if junit.exists() and not timed_out else parse_progress(text)
    tests = counts["passed"] + counts["failed"] + counts["skipped"] + counts["errors"]
    if timed_out:
        status = "timeout"
    elif counts["failed"] or counts["errors"]:
        status = "failed"
    elif rc == 5 or (rc == 0 and tests == 0):
        status = "no tests"
    elif rc == 0:
        status = "skipped" if counts["skipped"] == tests else "passed"
    else:  # killed by a signal (a crash in a kernel or the driver) or pytest's own error, with nothing failed
        status = "crashed"
    return {"file": Path(rel).name, "status": status, **counts, "failed_ids": [f["id"] for f in counts["failures"]],
            "tests": tests, "seconds": round(wall, 1),
            "timeout_s": round(timeout_s), "returncode": rc, "log": str(log),
            "junit": str(junit) if junit.exists() else None,
            **({"log_tail": text[-2000:]} if status in ("crashed", "timeout") else {})}


def record_name(environment: dict, group: str, index: int, total: int) -> str:
    card = re.sub(r"[^a-z0-9]+", "-", environment.get("device", "unknown").lower()).strip("-")
    return f"gpu_tests_{card}_{environment.get('commit', 'unknown')}_{group}_{index}of{total}.json"


def run_shard(files: list[str], estimates: dict[str, float], environment: dict, out_dir: Path, *, group: str,
              index: int, total: int, tests_dir: Path, cwd: Path, deadline_s: float = DEADLINE_S,
              not_run_reason: str | None = None, min_timeout_s: float = MIN_TIMEOUT_S,
              min_start_s: float = MIN_START_S, jobs: int = 1) -> tuple[Path, dict]:
    """Run ``files`` one process each, in order (``jobs`` at a time, each taking the next as it ends), each under min(max(min_timeout_s, 3 x its estimate), the time
    left before ``deadline_s``); files the deadline leaves less than ``min_start_s`` for, or all of them where
    ``not_run_reason`` says why, are recorded "not run". The record is rewritten after every file."""
    start = time.monotonic()
    path = out_dir / record_name(environment, group, index, total)
    log_dir = out_dir / "logs" / path.stem
    record = {"kind": "gpu_tests", "environment": environment, "group": group, "shard": index, "shards": total,
              "tests_dir": str(tests_dir), "complete": False, "jobs": max(1, jobs),
              "files": [{"file": f, "status": "pending", "estimate_s": round(estimates[f])} for f in files]}
    out_dir.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        path.write_text(json.dumps(record, indent=1) + "\n")

    lock = threading.Lock()
    queue = list(enumerate(files))
    # files beside each other each plan their engines within a share of the card (graphserve/engine/gpu_share.py)
    share = {}
    if jobs > 1 and not env.is_set("GRAPHSERVE_GPU_MEMORY_FRACTION"):
        share = {"GRAPHSERVE_GPU_MEMORY_FRACTION": f"{SHARED_MEMORY / jobs:.3f}"}
        record["memory_fraction"] = float(share["GRAPHSERVE_GPU_MEMORY_FRACTION"])

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i, name = queue.pop(0)
                left = deadline_s - (time.monotonic() - start)
                if not_run_reason or left < min_start_s:
                    reason = not_run_reason or f"the shard's {deadline_s:.0f} s deadline came first"
                    record["files"][i].update(status="not run", reason=reason)
                    continue
                record["files"][i]["status"] = "running"
                write()
            rel = os.path.relpath(tests_dir / name, cwd)
            timeout = min(max(min_timeout_s, 3 * estimates[name]), left)
            result = run_file(rel, cwd, log_dir, timeout, extra_env=share)
            result["log"] = os.path.relpath(result["log"], out_dir)
            result["junit"] = result["junit"] and os.path.relpath(result["junit"], out_dir)
            with lock:
                record["files"][i] = {**record["files"][i], **result}
                write()
                print(f"{name:40s} {result['status']:9s} {result['passed']:4d} passed {result['failed']:3d} failed "
                      f"{result['skipped']:4d} skipped {result['errors']:3d} errors {result['seconds']:7.1f} s",
                      flush=True)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record["complete"] = True
    record["seconds"] = round(time.monotonic() - start, 1)
    write()
    return path, record


def _parse_shard(text: str) -> tuple[int, int | None]:
    index, _, total = text.partition("/")
    return int(index), int(total) if total else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_tests", description=__doc__.split("\n")[0])
    ap.add_argument("--shard", help="I/N: the I-th of N shards (1-based); with --budget-s, I alone")
    ap.add_argument("--budget-s", type=float,
                    help=f"pack into as few shards as keep each within this (--shard I/N: {gs.BUDGET_S:.0f} s, notes)")
    ap.add_argument("--group", choices=("single", "multi"), default="single",
                    help="single: files that run on one GPU; multi: files that skip below 2 GPUs")
    ap.add_argument("--all", action="store_true", help="every file of --group in one record (with --jobs)")
    ap.add_argument("--files", nargs="+", metavar="FILE", help="these files of the tests folder in one record")
    ap.add_argument("--rerun", nargs="+", type=Path, metavar="DIR",
                    help="the files of --group that these records, of this card and commit, did not see pass or "
                         "skip, one at a time")
    ap.add_argument("--jobs", type=int, default=1, help="files run at once on the GPU (notes: times not kept)")
    ap.add_argument("--no-alone", action="store_true",
                    help="with --jobs: leave what did not pass as it is (default: run it again alone in the time left)")
    ap.add_argument("--list", action="store_true", help="print the files, their estimates and the packing; run nothing")
    ap.add_argument("--out", type=Path, help="record folder (default $OUT, else benchmarks/results/gpu_tests)")
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    ap.add_argument("--tests-dir", type=Path, default=gs.TESTS_DIR)
    ap.add_argument("--durations", type=Path, default=gs.DURATIONS)
    ap.add_argument("--report", nargs="+", type=Path, metavar="DIR", help="merge records into a file x card table")
    ap.add_argument("--markdown", type=Path, help="where --report writes its table (default DIR/REPORT.md)")
    ap.add_argument("--update-durations", action="store_true",
                    help="fold the times measured (of this shard, or with --report of every record) into --durations")
    args = ap.parse_args(argv)

    if args.report:
        from benchmarks.gpu_tests_report import report_main

        return report_main(args.report, args.markdown, args.tests_dir,
                           args.durations if args.update_durations else None)

    tests_dir = args.tests_dir.resolve()
    durations = gs.load_durations(args.durations)
    files = [f for f in gs.gpu_test_files(tests_dir) if gs.group_of(tests_dir / f) == args.group]
    est = gs.estimates(files, durations, tests_dir)
    picked = sum(bool(x) for x in (args.all, args.files, args.rerun, args.shard))
    if picked > 1:
        ap.error("give one of --shard, --all, --files, --rerun")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: must be at least 1")
    if args.all or args.files or args.rerun:
        return _run_listed(args, files, est, durations, tests_dir)
    try:
        index, total = _parse_shard(args.shard) if args.shard else (None, None)
    except ValueError:
        ap.error(f"--shard {args.shard}: expected I/N (e.g. 2/5), or I with --budget-s")
    if total is not None and args.budget_s is not None:
        ap.error("give --shard I/N, or --budget-s S with --shard I, not both")
    if not args.list and (index is None or (total is None and args.budget_s is None)):
        ap.error("--shard I/N, or --budget-s S with --shard I, or --all, --files, --rerun")
    budget = args.budget_s or gs.BUDGET_S
    try:
        shards = gs.pack(est, shards=total if args.budget_s is None else None, budget_s=budget)
    except ValueError as e:
        ap.error(str(e))
    for note in gs.packing_notes(shards, budget):
        print(f"note: {note}")
    if args.list:
        for sh in shards:
            print(f"shard {sh.index}/{len(shards)} ({args.group}): {sh.seconds:.0f} s estimated")
            for f in sh.files:
                entry = durations["files"].get(f, {"source": "estimate (not in durations.json)"})
                print(f"  {f:40s} {est[f]:6.0f} s  {entry['source']}")
        return 0
    if not 1 <= index <= len(shards):
        ap.error(f"--shard {index}: the {args.group} files pack into {len(shards)} shard(s), 1 to {len(shards)}")
    shard = shards[index - 1]
    environment = stamp()
    return _run(args, shard.files, est, durations, tests_dir, environment, args.group, index, len(shards),
                f"shard {index}/{len(shards)} ({args.group}), {len(shard.files)} file(s), {shard.seconds:.0f} s estimated")


def _run(args: argparse.Namespace, files: list[str], est: dict[str, float], durations: dict, tests_dir: Path,
         environment: dict, group: str, index: int, total: int, heading: str) -> int:
    """Run ``files`` into one record (``group``, shard ``index`` of ``total``): not run, with the reason, where they
    need more GPUs than the machine shows (one-GPU files skip themselves without CUDA)."""
    needed = max([gs.gpus_needed(tests_dir / f) for f in files], default=1)
    reason = None
    if needed > 1 and environment["device_count"] < needed:
        reason = f"needs {needed} GPUs, {environment['device_count']} visible"
    out = args.out or Path(os.environ.get("OUT") or RESULTS)
    print(f"{environment['device']} at {environment['commit']}: {heading}", flush=True)
    # one at a time, shortest first: a file that overruns its estimate then cuts off only itself at the deadline;
    # several at once, longest first, so the queue's last files are short and the lanes end together
    order = sorted(files, key=lambda f: (-est[f] if args.jobs > 1 else est[f], f))
    cwd = gs.REPO if gs.REPO in tests_dir.parents else tests_dir.parent
    start = time.monotonic()
    path, record = run_shard(order, est, environment, out, group=group, index=index, total=total,
                             tests_dir=tests_dir, deadline_s=args.deadline_s, cwd=cwd, not_run_reason=reason,
                             jobs=args.jobs)  # fmt: skip
    again = [f["file"] for f in record["files"] if f["status"] not in ("passed", "skipped", "not run")]
    if args.jobs == 1 or args.no_alone or not again:
        return _finish(args, path, record, durations, environment, reason)
    # what failed beside other files (out of its share of memory, cut off by a timeout the company stretched, or
    # failing for real) runs again alone, in the time left, into a record of its own whose times are the files' own
    print(f"alone: {len(again)} file(s) that did not pass beside others, one at a time", flush=True)
    alone_path, alone = run_shard(sorted(again, key=lambda f: (est[f], f)), est, environment, out,
                                  group=f"{group}-alone", index=index, total=total, tests_dir=tests_dir,
                                  deadline_s=args.deadline_s - (time.monotonic() - start), cwd=cwd)  # fmt: skip
    _finish(args, path, record, durations, environment, reason, update=False)
    rc = _finish(args, alone_path, alone, durations, environment, reason)
    return 0 if rc == 0 and all(f["status"] in ("passed", "skipped") for f in record["files"]
                                if f["file"] not in again) else 1  # fmt: skip


def _finish(args: argparse.Namespace, path: Path, record: dict, durations: dict, environment: dict,
            reason: str | None, update: bool = True) -> int:
    print(f"record: {path}")
    if args.update_durations and record["jobs"] > 1:
        if update:
            print("durations: not updated (files ran beside each other: their times are not their own)")
    elif args.update_durations and update and environment["device"] != "cpu":
        updated = gs.update_durations(durations, record["files"], environment)
        gs.save_durations(durations, args.durations)
        print(f"durations: {len(updated)} file(s) updated in {args.durations}")
    ok = {"passed", "skipped", "not run"} if reason else {"passed", "skipped"}
    return 0 if all(f["status"] in ok for f in record["files"]) else 1


def rerun_files(dirs: list[Path], files: list[str], environment: dict) -> list[str]:
    """Of ``files``, those the records under ``dirs`` of this card and commit never saw pass or skip."""
    from benchmarks.gpu_tests_report import load_records

    ok: set[str] = set()
    for rec in load_records(dirs):
        env = rec["environment"]
        if (env.get("device"), env.get("commit")) == (environment.get("device"), environment.get("commit")):
            ok |= {r["file"] for r in rec["files"] if r["status"] in ("passed", "skipped")}
    return [f for f in files if f not in ok]


def _run_listed(args: argparse.Namespace, files: list[str], est: dict[str, float], durations: dict,
                tests_dir: Path) -> int:
    """--all, --files or --rerun: one record of the files named (longest first, so ``--jobs`` packs them)."""
    if args.files:
        unknown = [f for f in args.files if not (tests_dir / f).is_file()]
        if unknown:
            raise SystemExit(f"--files: no such file in {tests_dir}: {', '.join(unknown)}")
        files = list(args.files)
        est = gs.estimates(files, durations, tests_dir)
    environment = stamp()
    label = "all" if args.all else "files"
    if args.rerun:
        files, label = rerun_files(args.rerun, files, environment), "rerun"
        print(f"rerun: {len(files)} file(s) not seen to pass at {environment['commit']} on {environment['device']}")
    return _run(args, files, est, durations, tests_dir, environment, f"{args.group}-{label}", 1, 1,
                f"{label}, {len(files)} file(s), {sum(est[f] for f in files):.0f} s estimated one at a time, "
                f"{args.jobs} at once")

if __name__ == "__main__":
    sys.exit(main())
