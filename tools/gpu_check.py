"""The Python side of tools/gpu_check.sh (standard library only: it runs before anything is installed).

    gpu_check.py missing                 the packages to install: those whose module does not import
    gpu_check.py unpack WHEELS SITE      wheels for this Python whose distribution is not installed,
                                         unpacked into SITE (for PYTHONPATH) where pip cannot install
    gpu_check.py versions                python, torch (its CUDA), transformers, numba, ... as JSON
    gpu_check.py warm-parts              supervisor/warmup.py's parts, each in its own process, side by side
    gpu_check.py summary OUT SCALE BUDGET SECONDS
                                         the one JSON object of the check, from the logs in OUT
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

# what the check needs beyond the image: import name -> the package that brings it
NEEDED = {"posix_ipc": "posix_ipc", "crc32c": "crc32c", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
# the versions recorded: import name -> distribution name
VERSIONS = {"torch": "torch", "transformers": "transformers", "numba": "numba", "numpy": "numpy",
            "posix_ipc": "posix_ipc", "crc32c": "crc32c", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
NOT_PASSED = ("failure", "error", "skipped")


def missing() -> int:
    for module, package in NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            print(package)
    return 0


def unpack(wheels: str, site: str) -> int:
    """A wheel is a zip of what site-packages holds: unpacked onto PYTHONPATH it imports, and its
    dist-info keeps its entry points (pytest finds pytest-timeout's)."""
    tags = {"py3", f"cp{sys.version_info.major}{sys.version_info.minor}"}
    for wheel in sorted(Path(wheels).glob("*.whl")):
        dist, _version, python_tag = wheel.name.split("-")[:3]
        if not tags.intersection(python_tag.split(".")):
            continue
        try:
            importlib.metadata.version(dist)
            continue  # installed already
        except importlib.metadata.PackageNotFoundError:
            pass
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        print(f"unpacked {wheel.name}")
    return 0


def versions() -> int:
    out: dict = {"python": platform.python_version()}
    for name, dist in VERSIONS.items():
        try:
            importlib.import_module(name)
            out[name] = importlib.metadata.version(dist)
        except Exception as exc:  # a missing or broken package is a finding of the check, not its failure
            out[name] = f"not importable: {type(exc).__name__}: {exc}"
    try:
        import torch
        import transformers

        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        out["cuda_device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        out["transformers_continuous_batching"] = hasattr(transformers.GenerationMixin, "generate_batch")
    except Exception as exc:
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    return 0


def warm_parts() -> int:
    """Each `warm_*` of supervisor/warmup.py in its own process (numba's cache files are written whole and
    renamed into place, so several compiling processes do not corrupt it); `shmbroker warm` then
    loads them all and compiles whatever a part did not."""
    from shmbroker.supervisor import warmup

    parts = [n for n in vars(warmup) if n.startswith("warm_") and n != "warm_all"]
    procs = [subprocess.Popen([sys.executable, "-c", f"from shmbroker.supervisor import warmup; warmup.{n}()"])
             for n in parts]
    codes = [p.wait() for p in procs]
    print(json.dumps(dict(zip(parts, codes))))
    return max(codes, default=0)


def _text(out: Path, name: str) -> str:
    p = out / name
    return p.read_text(errors="replace") if p.exists() else ""


def _last_json(out: Path, name: str):
    for line in reversed(_text(out, name).splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _tests(out: Path, rc: int | None) -> dict:
    said = _text(out, "tests.out").strip() or _text(out, "tests.err").strip()  # a skipped step says why in .err
    tests: dict = {"rc": rc, "tail": said.splitlines()[-3:]}
    try:
        root = ET.parse(out / "tests.xml").getroot()
    except (OSError, ET.ParseError) as exc:
        tests["junit"] = f"unreadable: {exc}"
        return tests
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    for key in ("tests", "failures", "errors", "skipped"):
        tests[key] = int(suite.get(key, 0)) if suite is not None else None
    tests["not_passed"] = [f"{case.get('name')}: {child.tag}: {(child.get('message') or '')[:200]}"
                           for case in root.iter("testcase") for child in case if child.tag in NOT_PASSED]
    return tests


def summary(out_dir: str, scale: str, budget: str, seconds: str) -> int:
    out = Path(out_dir)
    steps = {}
    for line in _text(out, "steps.txt").splitlines():
        name, rc, secs = line.split()
        steps[name] = {"rc": int(rc), "seconds": int(secs)}
    bench = _last_json(out, "bench_gpu.out")
    if bench is None:
        bench = {"error": _text(out, "bench_gpu.err").strip().splitlines()[-12:]}
    install = _text(out, "install.txt").split()
    print(json.dumps({
        "check": "tools/gpu_check.sh", "seconds": int(seconds), "budget_seconds": int(budget), "scale": float(scale),
        "device": _text(out, "gpu.csv").strip(), "versions": _last_json(out, "versions.out"),
        "install": {"how": install[0] if install else None, "packages": install[1:],
                    "tail": (_text(out, "install.err") + _text(out, "unpack.err")).strip().splitlines()[-3:]},
        "steps": steps, "warm": _text(out, "warm.out").strip(),
        "tests": _tests(out, steps.get("tests", {}).get("rc")), "bench_gpu": bench,
    }))
    return 0


COMMANDS = {"missing": missing, "unpack": unpack, "versions": versions, "warm-parts": warm_parts, "summary": summary}

if __name__ == "__main__":
    sys.exit(COMMANDS[sys.argv[1]](*sys.argv[2:]))
