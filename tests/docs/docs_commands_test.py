"""Every fenced block marked runnable in README.md and docs/*.md runs as written (issue 37).

A block is runnable when the line before its opening fence is `<!-- runnable -->` (invisible on GitHub). `sh`/`bash`
blocks run with `bash -euo pipefail`, `python` blocks with EPF_PYTHON, each from a fresh working directory that looks
like the repository root after `scripts/epf build` (`build/` is this build, `python/` the package), with EPF_PORT set
to a free loopback port. A block passes when it exits 0 within its time and leaves no process of its own running.

Usage: docs_commands_test.py sh|python SOURCE_DIR BUILD_DIR
"""
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77
TIMEOUT_S = 120
MARK = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w+)\s*$")
LANGUAGES = {"sh": "sh", "bash": "sh", "python": "python"}


def runnable_blocks(source):
    """(file, line, language, text) of every marked block."""
    files = [source / "README.md"] + sorted((source / "docs").glob("*.md"))
    blocks = []
    for path in files:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if fence is None or fence.group(1) not in LANGUAGES:
                raise SystemExit(f"{path}:{i + 1}: '{MARK}' must be followed by a ```sh, ```bash or ```python fence")
            end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise SystemExit(f"{path}:{i + 2}: the block never closes")
            text = "\n".join(lines[i + 2:end]) + "\n"
            blocks.append((path.relative_to(source), i + 2, LANGUAGES[fence.group(1)], text))
    return blocks


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def run_block(block, source, build, python):
    where, line, language, text = block
    with tempfile.TemporaryDirectory(prefix="epf-docs-") as work:
        work = pathlib.Path(work)
        (work / "build").symlink_to(build)
        (work / "python").symlink_to(source / "python")
        script = work / ("block.sh" if language == "sh" else "block.py")
        script.write_text(text)
        env = dict(os.environ, EPF_PORT=str(free_port()), EPF_BUILD_DIR=str(build),
                   PYTHONPATH=str(work / "python"), TMPDIR=str(work))
        argv = ["bash", "-euo", "pipefail", str(script)] if language == "sh" else [python, str(script)]
        start = time.monotonic()
        process = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=TIMEOUT_S)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            timed_out = True
        elapsed = time.monotonic() - start
        # Whatever the block started must be gone: a first run that leaves daemons behind is not as written. Helpers
        # that end with their parent (multiprocessing's resource tracker) get a few seconds.
        deadline = time.monotonic() + 5
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = group_alive(process.pid)
        if leftovers:
            ps = subprocess.run(["ps", "-o", "pid,args", "-g", str(process.pid)], capture_output=True, text=True)
            output += f"\nstill running:\n{ps.stdout}"
            os.killpg(process.pid, signal.SIGKILL)
        ok = process.returncode == 0 and not timed_out and not leftovers
        if ok:
            verdict = "ok"
        elif timed_out:
            verdict = "TIMEOUT"
        elif leftovers and process.returncode == 0:
            verdict = "LEFT PROCESSES RUNNING"
        else:
            verdict = f"EXIT {process.returncode}"
        print(f"--- {where}:{line} ({language}, {elapsed:.1f} s): {verdict}")
        if not ok:
            print(output)
        return ok


def main():
    language, source, build = sys.argv[1], pathlib.Path(sys.argv[2]).resolve(), pathlib.Path(sys.argv[3]).resolve()
    python = os.environ.get("EPF_PYTHON", "/usr/bin/python3")
    blocks = [b for b in runnable_blocks(source) if b[2] == language]
    # The docs promise these at least: the README's first run (two blocks) and the Python quickstart.
    expected = {"sh": 2, "python": 1}[language]
    if len(blocks) < expected:
        print(f"FAIL: {len(blocks)} runnable {language} blocks, expected at least {expected}")
        return 1
    if language == "python" and subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0:
        print(f"SKIPPED: torch is not importable by {python}; scripts/epf deps installs Debian's python3-torch")
        return SKIP
    failures = sum(not run_block(block, source, build, python) for block in blocks)
    print(f"docs_commands_test {language}: {len(blocks) - failures} of {len(blocks)} blocks ran as written")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
