"""The OpInfo conformance sweep.

    .venv/bin/python -m conformance.sweep [--ops REGEX] [--subset fast|full] [--max-samples N]
                                          [--shard i/n] [--json PATH] [--markdown PATH]
    .venv/bin/python -m conformance.sweep --merge a.json b.json ... --markdown docs/conformance.md

The OpInfos run in a worker process; if it crashes or hangs, the case it was running is
recorded as a failure and a new worker carries on with the next case.  ``--in-process`` runs
without the worker (faster start, no crash isolation: a crash ends the sweep, and with
``--progress`` the last "start" line on stderr names the case; a fatal signal also dumps the
Python stack there).  The JSON's meta holds the disk cache's counts for the run
(``disk_cache``: deferfuse.exec.diskcache.counts(), summed over the workers that finished).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import faulthandler
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Optional

from .subset import FAST_MAX_SAMPLES, FAST_OPS

# The full run compares the first N samples of every (OpInfo, dtype): with always_compile each
# sample compiles an XLA computation per variant, and an uncapped run takes several hours on one
# core.  See docs/conformance.md for what the cap leaves out.
FULL_MAX_SAMPLES = 5
HANG_SECONDS = 600          # the driver kills a worker that reports nothing for this long
SAMPLE_TIMEOUT = 60.0       # SIGALRM inside the worker, per sample


# --------------------------------------------------------------------------------------------
# Selecting OpInfos

def select_ops(db: list, *, regex: Optional[str], subset: str, shard: Optional[tuple[int, int]]) -> list:
    from .cases import op_name
    ops = list(db)
    if subset == "fast":
        wanted = set(FAST_OPS)
        ops = [op for op in ops if op_name(op) in wanted]
        missing = wanted - {op_name(op) for op in ops}
        if missing:
            raise SystemExit(f"fast subset names not in op_db: {sorted(missing)}")
    if regex:
        pattern = re.compile(regex)
        ops = [op for op in ops if pattern.search(op_name(op))]
    if shard is not None:
        i, n = shard
        ops = [op for k, op in enumerate(ops) if k % n == i]
    return ops


def _parse_shard(text: Optional[str]) -> Optional[tuple[int, int]]:
    if not text:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise SystemExit(f"--shard expects i/n with 0 <= i < n, got {text!r}")
    return int(m.group(1)), int(m.group(2))


# --------------------------------------------------------------------------------------------
# Running

def prepare() -> None:
    """Settings for a sweep process: no warnings noise, a Python stack on a fatal signal, and
    no on-disk executable cache unless DEFERFUSE_CACHE_DIR asks for one (a sweep checks
    lowerings: by default every case compiles, as it would after a change)."""
    import warnings
    warnings.simplefilter("ignore")
    if not faulthandler.is_enabled():
        faulthandler.enable()
    import deferfuse
    if "DEFERFUSE_CACHE_DIR" not in os.environ:
        deferfuse.config.set("cache_dir", "")


def run_in_process(ops: list, *, max_samples: Optional[int], sink=None, skip_keys: Iterable[str] = (),
                   progress: bool = False) -> list:
    from . import cases
    prepare()
    from deferfuse import engine
    from deferfuse.capture import meta
    skip = set(skip_keys)
    results = []
    for op in ops:
        def on_start(key: str) -> None:
            if progress:
                print(f"start    {key}", file=sys.stderr, flush=True)
            if sink is not None:
                sink.write(json.dumps({"event": "start", "key": key}) + "\n")
                sink.flush()
                # Testing the crash isolation: the worker dies hard at this case.
                if os.environ.get("CONFORMANCE_TEST_CRASH_AT") == key:
                    os._exit(3)
        for result in cases.run_op(op, max_samples=max_samples, sample_timeout=SAMPLE_TIMEOUT,
                                   on_start=on_start, skip_keys=skip):
            results.append(result)
            if sink is not None:
                sink.write(json.dumps({"event": "case", "case": result.to_json()}) + "\n")
                sink.flush()
            if progress:
                print(f"{result.status:8s} {result.key:50s} {result.seconds:6.1f}s {result.reason[:100]}",
                      file=sys.stderr, flush=True)
        # Bound memory over thousands of OpInfos: compiled executables and meta entries of one
        # OpInfo are of no use to the next.
        engine.clear_cache()
        meta.clear_cache()
    return results


def run_isolated(ops: list, *, max_samples: Optional[int], progress: bool = False,
                 disk_counts: Optional[collections.Counter] = None) -> list:
    """Run ``ops`` in worker processes, restarting after a crash or a hang.  The disk cache
    counts of the workers that finished are added to ``disk_counts``."""
    from .cases import CaseResult, enumerate_cases, op_name
    names = [op_name(op) for op in ops]
    all_keys = [f"{op_name(op)}|{d}|{v}" for op, d, v in enumerate_cases(ops)]
    done: dict[str, CaseResult] = {}
    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
        names_file = os.path.join(tmp, "ops.json")
        with open(names_file, "w") as f:
            json.dump(names, f)
        attempt = 0
        while True:
            attempt += 1
            log = os.path.join(tmp, f"worker{attempt}.jsonl")
            skip_file = os.path.join(tmp, f"skip{attempt}.json")
            with open(skip_file, "w") as f:
                json.dump(sorted(done), f)
            cmd = [sys.executable, "-m", "conformance.sweep", "--worker", names_file, "--worker-log", log,
                   "--worker-skip", skip_file, "--max-samples", str(max_samples or 0)]
            if progress:
                cmd.append("--progress")
            proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            last_size, last_change, hung = -1, time.monotonic(), False
            while proc.poll() is None:
                time.sleep(1.0)
                size = os.path.getsize(log) if os.path.exists(log) else 0
                if size != last_size:
                    last_size, last_change = size, time.monotonic()
                elif time.monotonic() - last_change > HANG_SECONDS:
                    hung = True
                    proc.kill()
                    proc.wait()
            current = None
            if os.path.exists(log):
                with open(log) as f:
                    for line in f:
                        try:
                            event = json.loads(line)
                        except ValueError:
                            continue    # a line cut by the crash
                        if event["event"] == "start":
                            current = event["key"]
                        elif event["event"] == "disk_cache":
                            if disk_counts is not None:
                                disk_counts.update(event["counts"])
                        elif event["event"] == "case":
                            case = CaseResult.from_json(event["case"])
                            done[case.key] = case
                            current = None
            if proc.returncode == 0 and current is None:
                break
            if current is None:      # died between cases (or before the first)
                pending = [k for k in all_keys if k not in done]
                if not pending:
                    break
                current = pending[0]
            op, dtype, variant = current.split("|")
            why = (f"worker hung (no progress for {HANG_SECONDS}s)" if hung
                   else f"worker crashed (exit code {proc.returncode})")
            done[current] = CaseResult(op, dtype, variant, status="fail", reason=why)
            print(f"conformance: {current}: {why}; restarting", file=sys.stderr, flush=True)
            if attempt > 50:
                raise SystemExit("conformance: too many worker crashes")
    return [done[k] for k in all_keys if k in done]


def worker_main(names_file: str, log: str, skip_file: str, max_samples: int, progress: bool) -> None:
    from .cases import op_db, op_name
    with open(names_file) as f:
        names = json.load(f)
    with open(skip_file) as f:
        skip = json.load(f)
    by_name = {op_name(op): op for op in op_db()}
    ops = [by_name[n] for n in names]
    with open(log, "a") as sink:
        run_in_process(ops, max_samples=max_samples or None, sink=sink, skip_keys=skip, progress=progress)
        from deferfuse.exec import diskcache
        sink.write(json.dumps({"event": "disk_cache", "counts": diskcache.counts()}) + "\n")


# --------------------------------------------------------------------------------------------
# Results files

def versions() -> dict[str, str]:
    import jax
    import torch
    import deferfuse
    return {"torch": torch.__version__, "jax": jax.__version__, "deferfuse": deferfuse.__version__,
            "python": sys.version.split()[0]}


# Why the failures that remain fail, by OpInfo (investigated; printed under the failures table).
# (linalg.matrix_rank's out= failed under any dispatch mode until the recorder's function mode
# wrote it: capture/recorder.py, _OUT_DROPPED_UNDER_A_MODE.)
FAILURE_CAUSES: dict[str, str] = {}


def write_json(path: str, results: list, meta: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "cases": [r.to_json() for r in results]}, f, indent=1)


def read_json(paths: list[str]) -> tuple[list, dict]:
    from .cases import CaseResult
    results, metas = {}, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        for c in data["cases"]:
            case = CaseResult.from_json(c)
            results[case.key] = case
    meta = dict(metas[0]) if metas else {}
    if metas:
        meta["seconds"] = sum(m.get("seconds", 0) for m in metas)
        meta["wall_seconds"] = max(m.get("seconds", 0) for m in metas)
        meta["shards"] = sorted({m.get("shard") or "0/1" for m in metas})
        meta["date"] = max(m.get("date", "") for m in metas)
    return list(results.values()), meta


# --------------------------------------------------------------------------------------------
# Markdown

def _pct(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "-"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def totals(results: list) -> dict[str, int]:
    counts = collections.Counter(r.status for r in results)
    return {s: counts.get(s, 0) for s in ("lowered", "fallback", "fail", "skip")}


def markdown(results: list, meta: dict) -> str:
    t = totals(results)
    n = len(results)
    ran = n - t["skip"]
    lines = [
        "# OpInfo conformance",
        "",
        "Every OpInfo in PyTorch's `op_db` (`torch.testing._internal.common_methods_invocations`),",
        "for the dtypes float32, float64, int64 and bool that it supports on CPU, run on its CPU",
        "sample inputs under strict PyTorch and under `deferfuse.defer()` with `always_compile=True`",
        "(every flush through XLA), each side on fresh clones of the sample. Results and the inputs",
        "after the call (in-place and `out=` writes) must have strict's strides and storage offsets",
        "(along every dimension of more than one element; the computed data too) and are compared with `torch.testing.assert_close`",
        "(`equal_nan=True`; default dtype tolerances, or the OpInfo's own `toleranceOverride` for",
        "TestCommon/TestInductorOpInfo on CPU); where strict raises, defer must raise the same",
        "exception type. Random ops are checked for shape, dtype and sanity (finite, in range), not",
        "values; `empty*`/`resize_*` for shape and dtype only. Variants: `function`, `method`,",
        "`inplace`, `out` and `grad` (float64 only: first-order gradients of",
        "`sum(outputs * fixed random cotangents)` w.r.t. the tensor inputs, backward run inside the",
        "defer block).",
        "",
        "A **case** is (OpInfo, dtype, variant), aggregated over its samples:",
        "**lowered** (every sample agreed, nothing ran eagerly), **fallback** (every sample agreed,",
        "but some aten op ran eagerly: `stats()[\"fallbacks\"]` grew), **fail** (a mismatch, a",
        "missing or wrong exception, a crash or a timeout: the first failing sample's message),",
        "**skip** (nothing to compare, e.g. no samples).",
        "",
        "## Reproduce",
        "",
        "```",
        "make conformance                                   # the full sweep: this page + conformance/results/",
        ".venv/bin/python -m conformance.sweep --subset fast   # the CI subset (tests/test_conformance.py)",
        ".venv/bin/python -m conformance.sweep --ops '^nn\\.functional\\.conv' --markdown /tmp/c.md",
        ".venv/bin/python -m conformance.sweep --shard 0/2 --json conformance/results/shard0.json",
        ".venv/bin/python -m conformance.sweep --merge conformance/results/shard*.json --markdown docs/conformance.md",
        "```",
        "",
        "## This run",
        "",
        f"- date: {meta.get('date', '?')}",
        f"- torch {meta.get('versions', {}).get('torch', '?')}, jax {meta.get('versions', {}).get('jax', '?')}, "
        f"deferfuse {meta.get('versions', {}).get('deferfuse', '?')}, python {meta.get('versions', {}).get('python', '?')}",
        f"- selection: subset `{meta.get('subset', 'full')}`"
        + (f", ops matching `{meta['ops']}`" if meta.get("ops") else "")
        + (f", shards {', '.join(meta['shards'])}" if meta.get("shards") and meta["shards"] != ["0/1"] else ""),
        f"- OpInfos: {len({r.op for r in results})}"
        + (f" of the {meta['opinfos_in_db']} in op_db (the others support none of the four dtypes on CPU)"
           if meta.get("opinfos_in_db") and not meta.get("ops") and meta.get("subset") == "full" else "")
        + f"; cases: {n}",
    ]
    cap = meta.get("max_samples")
    if cap:
        capped = [r for r in results if r.samples_total and r.samples_total > cap]
        lines.append(
            f"- **sample cap**: only the first {cap} samples that `sample_inputs` yields per (OpInfo, dtype) "
            f"were compared (the same samples for every variant). {len(capped)} of {n} cases had more "
            f"samples than that (every sample compiles one XLA computation per variant; from a partial "
            f"uncapped run, ~3.5x the time per case, the uncapped sweep is estimated at about an hour on one "
            f"core); `--max-samples 0` runs them all.")
    else:
        lines.append("- every sample of every case was compared (no sample cap)")
    if meta.get("seconds"):
        shards = meta.get("shards") or []
        lines.append(f"- time: {meta['seconds'] / 60:.1f} min single-process"
                     + (f" (the sum over {len(shards)} shards; the longest took {meta['wall_seconds'] / 60:.1f} min)"
                        if len(shards) > 1 else ""))
    passed = t["lowered"] + t["fallback"]
    lines += [
        "",
        "## Totals",
        "",
        "| | cases | % of cases | % of cases run (not skipped) |",
        "|---|---:|---:|---:|",
    ]
    for s in ("lowered", "fallback", "fail", "skip"):
        lines.append(f"| {s} | {t[s]} | {_pct(t[s], n)} | {_pct(t[s], ran) if s != 'skip' else ''} |")
    lines += [
        f"| **total** | {n} | | |",
        "",
        f"Target (issue 5): >= 97% of cases pass lowered — now {_pct(t['lowered'], ran)} of the cases run; "
        f"100% pass counting fallbacks — now {_pct(passed, ran)}.",
        "",
    ]
    by_variant: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_dtype: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        by_variant[r.variant][r.status] += 1
        by_dtype[r.dtype][r.status] += 1
    lines += ["| by variant / dtype | cases | lowered | fallback | fail | skip |", "|---|---:|---:|---:|---:|---:|"]
    for label, table in (("variant", by_variant), ("dtype", by_dtype)):
        for key in sorted(table):
            c = table[key]
            lines.append(f"| {label} `{key}` | {sum(c.values())} | {c['lowered']} | {c['fallback']} | "
                         f"{c['fail']} | {c['skip']} |")
    fallback_ops: collections.Counter = collections.Counter()
    fallback_reasons: collections.Counter = collections.Counter()
    for r in results:
        if r.status == "fallback":
            for o in r.fallback_ops:
                fallback_ops[o] += 1
            for o in r.fallback_reasons:
                fallback_reasons[o] += 1
    if fallback_ops:
        lines += ["", "## Fallbacks", "",
                  "aten ops that ran eagerly, by the number of `fallback` cases they appear in "
                  "(reasons: " + ", ".join(f"{k} {v}" for k, v in fallback_reasons.most_common()) + ").", "",
                  "| aten op | cases |", "|---|---:|"]
        for o, c in fallback_ops.most_common(40):
            lines.append(f"| `{o}` | {c} |")
    noted = [(r, n) for r in results for n in r.notes
             if not n.startswith("tolerance override") and r.status != "fail"]
    if noted:
        lines += ["", "## Notes on passing cases", "",
                  "Observations that do not fail a case but may be worth a look.", "",
                  "| OpInfo | dtype | variant | note |", "|---|---|---|---|"]
        for r, n in sorted(noted, key=lambda x: (x[0].op, x[0].dtype, x[0].variant)):
            lines.append(f"| `{r.op}` | {r.dtype} | {r.variant} | {_md_escape(n)} |")
    fails = [r for r in results if r.status == "fail"]
    if fails:
        lines += ["", "## Failures", "", "| OpInfo | dtype | variant | reason |", "|---|---|---|---|"]
        for r in sorted(fails, key=lambda r: (r.op, r.dtype, r.variant)):
            lines.append(f"| `{r.op}` | {r.dtype} | {r.variant} | {_md_escape(r.reason)} |")
        causes = sorted({r.op for r in fails} & set(FAILURE_CAUSES))
        if causes:
            lines += ["", "Causes, where known:", ""]
            lines += [f"- `{op}`: {FAILURE_CAUSES[op]}" for op in causes]
    lines += ["", "## Per OpInfo", "",
              "Reasons: failing cases as `dtype/variant`, fallback cases with the aten ops that ran eagerly, "
              "skips with why.", "",
              "| OpInfo | variant | cases | lowered | fallback | fail | skip | reasons |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    per_op: dict[str, list] = collections.defaultdict(list)
    for r in results:
        per_op[r.op].append(r)
    for name in sorted(per_op):
        rs = per_op[name]
        c = collections.Counter(r.status for r in rs)
        base, _, var = _split_variant(name)
        reasons = []
        for r in rs:
            if r.status == "fail":
                reasons.append(f"{r.dtype}/{r.variant}: fail ({r.reason[:90]})")
        fb: collections.Counter = collections.Counter()
        for r in rs:
            if r.status == "fallback":
                fb.update(r.fallback_ops)
        if fb:
            reasons.append("fallback: " + ", ".join(sorted(fb)))
        skips = sorted({r.reason for r in rs if r.status == "skip"})
        if skips:
            reasons.append("skip: " + "; ".join(skips))
        lines.append(f"| `{base}` | {var} | {len(rs)} | {c['lowered']} | {c['fallback']} | {c['fail']} | "
                     f"{c['skip']} | {_md_escape('; '.join(reasons))} |")
    return "\n".join(lines) + "\n"


_OPS_VARIANT_CACHE: dict[str, tuple[str, str]] = {}


def _split_variant(name: str) -> tuple[str, str, str]:
    """OpInfo names hold dots (nn.functional.conv2d); the variant is what op_db calls
    variant_test_name.  Look it up rather than guess."""
    if not _OPS_VARIANT_CACHE:
        try:
            from .cases import op_db, op_name
            for op in op_db():
                _OPS_VARIANT_CACHE[op_name(op)] = (op.name, op.variant_test_name)
        except Exception:  # noqa: BLE001
            pass
    base, var = _OPS_VARIANT_CACHE.get(name, (name, ""))
    return base, "", var


# --------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="regex on OpInfo names (with .variant_test_name)")
    p.add_argument("--subset", choices=("fast", "full"), default="full")
    p.add_argument("--max-samples", type=int, default=None,
                   help=f"first N samples per (OpInfo, dtype); 0: all. Default: {FAST_MAX_SAMPLES} for "
                        f"--subset fast, {FULL_MAX_SAMPLES} for full")
    p.add_argument("--shard", help="i/n: run every n-th OpInfo starting at i")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--markdown", help="write the report here")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge result files into --markdown / --json")
    p.add_argument("--in-process", action="store_true", help="no worker process (no crash isolation)")
    p.add_argument("--progress", action="store_true", help="one line per case on stderr")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-log", help=argparse.SUPPRESS)
    p.add_argument("--worker-skip", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        worker_main(args.worker, args.worker_log, args.worker_skip, args.max_samples or 0, args.progress)
        return 0
    if args.merge:
        results, meta = read_json(args.merge)
    else:
        from .cases import op_db
        shard = _parse_shard(args.shard)
        max_samples = args.max_samples
        if max_samples is None:
            max_samples = FAST_MAX_SAMPLES if args.subset == "fast" else FULL_MAX_SAMPLES
        ops = select_ops(op_db(), regex=args.ops, subset=args.subset, shard=shard)
        start = time.monotonic()
        if args.in_process:
            results = run_in_process(ops, max_samples=max_samples or None, progress=args.progress)
            from deferfuse.exec import diskcache
            disk_counts = collections.Counter(diskcache.counts())
        else:
            disk_counts = collections.Counter()
            results = run_isolated(ops, max_samples=max_samples or None, progress=args.progress,
                                   disk_counts=disk_counts)
        meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "versions": versions(),
                "subset": args.subset, "ops": args.ops, "max_samples": max_samples or None,
                "shard": args.shard, "seconds": round(time.monotonic() - start, 1),
                "opinfos_in_db": len(op_db()), "disk_cache": dict(disk_counts)}
    meta.setdefault("versions", versions())
    if args.json:
        write_json(args.json, results, meta)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(markdown(results, meta))
    t = totals(results)
    n = len(results)
    print(f"conformance: {n} cases: " + ", ".join(f"{k} {v} ({_pct(v, n)})" for k, v in t.items())
          + (f" in {meta['seconds']:.0f}s" if meta.get("seconds") else ""))
    for r in results:
        if r.status == "fail":
            print(f"  FAIL {r.key}: {r.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
