#!/usr/bin/env python3
"""The GPU proof in one command: install the carried wheels, run the ``gpu`` tests and the GPU benchmarks,
write a log and a JSON of figures. See docs/transfer.md ("The GPU pack").

Made for a machine with Python, torch (with CUDA) and nothing else -- no package registry, no vLLM, no
redis-server: the wheels made by ``scripts/gpu-wheels.sh`` are installed with
``pip install --no-index --no-deps --target DIR`` and put on ``PYTHONPATH`` beside the repository. Every
step runs even when an earlier one failed; the exit status is 0 only when every step passed. Without a
CUDA device the GPU tests skip, and every GPU figure in the JSON says it was not measured.

    python3 scripts/gpu_pack.py [--wheels wheels] [--out gpu-pack-out] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Only what the GPU run needs: these modules import without vLLM, mooncake or a redis-server.
TEST_PATHS = ["tests/transfer", "tests/vllm/kv/test_gpu.py", "tests/vllm/ec/test_units.py"]
NOT_MEASURED = "not measured"

# (name, target text, where the value is in the figures, how it is checked)
TARGETS: list[tuple[str, str, tuple[str, ...], str, float]] = [
    (
        "h2d_loader_vs_raw_16MiB_to_256MiB",
        ">= 0.9",
        ("bench_transfer", "gpu", "h2d", "*", "loader_vs_raw"),
        ">=",
        0.9,
    ),
    ("overlap_step_vs_max", "<= 1.1", ("bench_transfer", "gpu", "overlap", "step_vs_max"), "<=", 1.1),
    ("kv_load_vs_raw_h2d", ">= 0.8", ("bench_gpu", "kv_load", "worker_vs_raw"), ">=", 0.8),
    ("kv_save_snapshot_vs_raw_d2h", ">= 0.9", ("bench_gpu", "kv_save", "snapshot_vs_raw"), ">=", 0.9),
    ("ec_install_host_p50_us", "<= 20", ("bench_gpu", "ec_install", "host_p50_us"), "<=", 20.0),
]


class Log:
    """Everything goes to the console and to the log file."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.file.write(text)
        self.file.flush()

    def section(self, title: str) -> None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
        self.write(f"\n===== {stamp} {title} =====\n")


def run_step(log: Log, title: str, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run one step; its output goes to the log; returns (exit status, stdout)."""
    log.section(title)
    log.write("$ " + " ".join(argv) + "\n")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        log.write(out + f"\n[timed out after {timeout:.0f}s]\n")
        return 124, out
    log.write(proc.stdout)
    if proc.stderr:
        log.write(proc.stderr)
    log.write(f"[exit {proc.returncode} after {time.monotonic() - t0:.1f}s]\n")
    return proc.returncode, proc.stdout


def json_of(text: str) -> Any:
    """The JSON object a ``--json`` benchmark printed (log lines before it are skipped)."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except json.JSONDecodeError:
        return None


def pick(data: Any, path: tuple[str, ...]) -> list[Any]:
    """Values at ``path`` ("*" walks a list); empty when anything on the way is missing or a string."""
    if not path:
        return [data]
    if isinstance(data, list) and path[0] == "*":
        return [v for item in data for v in pick(item, path[1:])]
    if isinstance(data, dict) and path[0] in data:
        return pick(data[path[0]], path[1:])
    return []


def judge(figures: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, target, path, op, bound in TARGETS:
        values = [v for v in pick(figures, path) if isinstance(v, int | float)]
        if not values:
            out.append({"target": name, "wanted": target, "value": NOT_MEASURED, "met": None})
            continue
        met = all(v >= bound for v in values) if op == ">=" else all(v <= bound for v in values)
        out.append(
            {"target": name, "wanted": target, "value": values if len(values) > 1 else values[0], "met": met}
        )
    return out


def junit_counts(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    return {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}


def _installed(project: str) -> bool:
    try:
        importlib.metadata.distribution(project)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, default=ROOT / "wheels", help="folder of carried wheels")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-pack-out", help="folder for the log and JSON")
    parser.add_argument("--target", type=Path, default=None, help="install dir (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="fewer benchmark repeats (a rehearsal)")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu-pack.log")
    target = (args.target or Path(tempfile.mkdtemp(prefix="asyncconn-gpu-site-"))).resolve()
    target.mkdir(parents=True, exist_ok=True)
    # The repository is used in place, not installed: its backends/ folder installs as
    # `asyncconn_backends`, so that name is made importable here by a link in the install dir, and
    # devtools/ (the asyncconn-tools package: `asyncconn bench`) goes on the path beside the root.
    link = target / "asyncconn_backends"
    if not link.exists():
        link.symlink_to(ROOT / "backends", target_is_directory=True)
    env = dict(os.environ)
    paths = (str(ROOT), str(ROOT / "devtools"), str(target), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    py = sys.executable
    steps: dict[str, Any] = {}

    carried = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    # A distribution the machine has already stays as it is (its numpy is the one its torch was built with).
    present = [w.name for w in carried if _installed(w.name.split("-")[0])]
    wheels = [str(w) for w in carried if w.name not in present]
    if present:
        log.section("install")
        log.write(f"already installed here, not installed again: {present}\n")
    if wheels:
        rc, _ = run_step(
            log,
            f"install {len(wheels)} wheels into {target}",
            [
                py,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--target",
                str(target),
                *wheels,
            ],
            env,
            600,
        )
    else:
        log.section("install")
        log.write(f"no wheels in {args.wheels}: using what this Python has installed\n")
        rc = 0
    steps["install"] = {"rc": rc, "wheels": [Path(w).name for w in wheels], "kept": present}

    probe = (
        "import json, platform, sys, torch, asyncconn, zmq, xxhash, pytest\n"
        "cuda = torch.cuda.is_available()\n"
        "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__,\n"
        "  'cuda': cuda, 'cuda_version': torch.version.cuda,\n"
        "  'device': torch.cuda.get_device_name() if cuda else None,\n"
        "  'vllm_importable': __import__('importlib.util').util.find_spec('vllm') is not None,\n"
        "  'asyncconn': asyncconn.__file__}))\n"
    )
    rc, text = run_step(log, "environment", [py, "-c", probe], env, 120)
    steps["environment"] = {"rc": rc, **(json_of(text) or {})}

    junit = out / "gpu-tests.xml"
    rc, _ = run_step(
        log,
        "gpu-marked tests",
        [
            py,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rs",
            f"--junitxml={junit}",
            *TEST_PATHS,
        ],
        env,
        900,
    )
    steps["tests"] = {"rc": rc, **junit_counts(junit)}

    quick = ["--repeat", "3"] if args.quick else []
    transfer_quick = ["--loads", "200", "--saves", "200"] if args.quick else []
    figures: dict[str, Any] = {}
    for name, argv_tail in (
        ("bench_transfer", ["transfer", "--json", *quick, *transfer_quick]),
        ("bench_gpu", ["gpu", "--json", *quick]),
    ):
        rc, text = run_step(
            log, f"asyncconn bench {argv_tail[0]}", [py, "-m", "asyncconn", "bench", *argv_tail], env, 900
        )
        figures[name] = json_of(text) if rc == 0 else None
        steps[name] = {"rc": rc}
        if figures[name] is not None:
            (out / f"{name}.json").write_text(json.dumps(figures[name], indent=2) + "\n")

    cuda = bool(steps["environment"].get("cuda"))
    result = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu_measured": cuda,
        "steps": steps,
        "targets": judge(figures),
        "figures": figures,
    }
    if not cuda:
        result["note"] = "no CUDA device: the GPU tests skipped and no GPU figure was measured"
    (out / "figures.json").write_text(json.dumps(result, indent=2) + "\n")
    log.section("summary")
    for row in result["targets"]:
        log.write(f"{row['target']:<40} wanted {row['wanted']:<7} got {row['value']}  met={row['met']}\n")
    failed = sorted(k for k, v in steps.items() if v.get("rc"))
    log.write(f"steps failed: {failed or 'none'}; figures in {out / 'figures.json'}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
