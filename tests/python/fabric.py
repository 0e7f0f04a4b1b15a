"""Test support: a fabric of real epfabricd daemons (host backend by default) on Unix sockets and loopback, as
`scripts/epf demo` starts them, plus helpers to run one function per rank concurrently."""
import ctypes
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("EPF_BUILD_DIR", ROOT / "build"))
sys.path.insert(0, str(ROOT / "python"))
os.environ.setdefault("EPFABRIC_LIBRARY", str(BUILD / "client" / "libepfabric_client.so"))

SKIP = 77  # ctest's SKIP_RETURN_CODE for these tests
# EPF_PY_BACKEND=cuda (the GPU machine): cuda daemons on GPU 0, CUDA tensors, one stream per rank.
BACKEND = os.environ.get("EPF_PY_BACKEND", "host")
RANKS = int(os.environ.get("EPF_PY_RANKS", "4"))


def require_torch():
    """Exits with SKIP (ctest reports 'skipped') when torch is not importable by this Python."""
    try:
        import torch  # noqa: F401
    except ImportError as error:
        print(f"SKIPPED: torch is not importable by {sys.executable} ({error}); scripts/epf deps installs Debian's "
              "python3-torch for /usr/bin/python3")
        sys.exit(SKIP)


def _die_with_parent():
    """In the daemon's child before exec: SIGTERM when the test process dies, even by SIGKILL (a ctest timeout), so
    that no daemon outlives its test."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Fabric:
    """`n` daemons of one fabric; sockets[r] is rank r's client socket. Use as a context manager."""

    def __init__(self, n, backend=BACKEND, extra_flags=(), hosts=1):
        """hosts > 1: the daemons act as that many hosts (--host_id, rank r on host r // (n / hosts)) joined by the
        transport's socket wire, as tests/integration/internode_test does."""
        self.n = n
        self.hosts = hosts
        self.backend = backend
        self.extra_flags = list(extra_flags)
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="epf-py-"))
        self.sockets = [str(self.dir / f"d{r}.sock") for r in range(n)]
        self.procs = []
        self.daemon = os.environ.get("EPFABRIC_DAEMON", str(BUILD / "daemon" / "epfabricd"))
        self.epctl = os.environ.get("EPFABRIC_EPCTL", str(BUILD / "client" / "epctl"))

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        secret = self.dir / "fabric.secret"
        secret.write_bytes(os.urandom(32).hex().encode())
        secret.chmod(0o600)
        coordinator = None
        for r in range(self.n):
            flags = [f"--rank={r}", f"--world_size={self.n}", f"--fabric_id=py-{os.getpid()}-{id(self)}",
                     f"--backend={self.backend}", f"--client_socket={self.sockets[r]}", "--peer_listen=127.0.0.1:0",
                     "--log_level=warn", f"--fabric_secret_file={secret}",
                     "--proxy_max_sleep_us=20000"] + self.extra_flags
            if self.hosts > 1:
                flags += [f"--host_id=host-{r // (self.n // self.hosts)}", "--transport=socket"]
            if self.backend == "cuda":
                flags.append("--device=0")
            if coordinator:
                flags.append(f"--coordinator={coordinator}")
            with open(self.dir / f"d{r}.log", "wb") as log:
                self.procs.append(subprocess.Popen([self.daemon] + flags, stdout=log, stderr=log,
                                                   preexec_fn=_die_with_parent))
            self._wait(lambda: os.path.exists(self.sockets[r]), f"daemon {r}'s socket")
            if r == 0:
                topology = json.loads(self.epctl_run(0, "topology", "--json"))
                coordinator = topology["daemon"]["peer_address"]
        for r in range(self.n):  # every member's view, so that a CreateGroup right away sees one epoch everywhere
            self._wait(lambda: self.epctl_run(r, "fabric").count(" UP ") >= self.n, f"{self.n} ranks UP on {r}")

    def epctl_run(self, r, *args):
        return subprocess.run([self.epctl, f"--socket={self.sockets[r]}"] + list(args), check=True,
                              capture_output=True, text=True, timeout=30).stdout

    def _wait(self, ready, what, timeout_s=20):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except subprocess.CalledProcessError:
                pass
            if any(p.poll() is not None for p in self.procs):
                timeout_s = 0  # a daemon exited: say why now
                break
            time.sleep(0.05)
        logs = "\n".join((self.dir / f"d{r}.log").read_text(errors="replace") for r in range(len(self.procs)))
        raise TimeoutError(f"waited for {what} (a daemon exited, or {timeout_s} s passed); daemon logs:\n{logs}")

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def attach_options(n):
    """Buffer.attach options for n ranks sharing GPU 0 as threads of this process (cuda)."""
    if BACKEND != "cuda":
        return {}
    import torch
    return {"low_latency_sms": torch.cuda.get_device_properties(0).multi_processor_count // n}


def to_dev(*tensors):
    """The test's inputs (made on the CPU from seeded generators) on the backend's device."""
    if BACKEND != "cuda":
        return tensors if len(tensors) > 1 else tensors[0]
    moved = tuple(t.cuda() if t is not None else None for t in tensors)
    return moved if len(moved) > 1 else moved[0]


def _to_cpu(value):
    import torch
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


_STREAMS = {}
_WARM = set()  # ranks whose stream's allocator cache was filled (run_ranks)


def run_ranks(n, fn, timeout_s=120):
    """Runs fn(rank) for every rank on its own thread (the library releases the GIL in its calls); returns the
    results in rank order (tensors copied to the CPU) and re-raises the first failure. With CUDA each rank runs on
    its own stream: ranks sharing a GPU must not queue behind each other."""
    results, errors = [None] * n, [None] * n
    # Ranks share one GPU as threads of one process here: a device memory allocation (cudaMalloc) by one thread keeps
    # later kernels from running beside those already running (CUDA's implicit synchronisation), so a rank that makes
    # torch grow its cache while a peer's kernel waits for it stalls until that wait times out. Every thread first
    # fills its stream's cache, and none starts before all have (a real server runs one process per GPU).
    ready = threading.Barrier(n)

    def body(r):
        try:
            if BACKEND == "cuda":
                import torch
                # One stream per rank for the whole test (torch caches memory per stream), never the legacy one.
                stream = _STREAMS.setdefault(r, torch.cuda.Stream())
                with torch.cuda.stream(stream):
                    if r not in _WARM:
                        _WARM.add(r)
                        blocks = [torch.empty(256 << 20, dtype=torch.uint8)]
                        blocks += [torch.empty(64 << 10, dtype=torch.uint8) for _ in range(512)]
                        del blocks
                    ready.wait(timeout_s)
                    value = fn(r)
                stream.synchronize()
                results[r] = _to_cpu(value)
            else:
                results[r] = fn(r)
        except BaseException as error:  # reported below, with the rank
            errors[r] = error

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    for r, t in enumerate(threads):
        if t.is_alive():
            raise TimeoutError(f"rank {r} did not finish within {timeout_s} s")
    for r, error in enumerate(errors):
        if error is not None:
            raise AssertionError(f"rank {r} failed: {error!r}") from error
    return results


def main():
    require_torch()
    unittest.main(verbosity=2)
