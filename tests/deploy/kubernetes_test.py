#!/usr/bin/env python3
"""Checks deploy/kubernetes against the binaries it runs.

  kubernetes_test.py manifests EPFABRICD EPCTL   every manifest parses; invariants of every pod spec (raw files)
  kubernetes_test.py kustomize EPFABRICD EPCTL   `kubectl kustomize` renders each overlay; the invariants again on
                                                 the rendered objects (exit 77 = skipped when kubectl is absent)

Invariants: no privileged container, no privilege escalation, read-only root filesystems, no hostIPC/hostPID/
hostNetwork/shareProcessNamespace; every epfabricd flag exists in `epfabricd --help` and every epctl flag in
`epctl --help`; probes ask the daemon's own socket, readiness on epfabric.v1.Fabric, and every probed health service
is one a real daemon answers; the socket directory is a mounted volume shared with the pod's other containers that
use it; metrics, peer and data container ports agree with --metrics_listen/--peer_listen/--data_listen, and a daemon
whose peer port serves other hosts gives the socket wire's data listener a fixed port.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KUBE = os.path.join(ROOT, "deploy", "kubernetes")
OVERLAYS = ["sidecar", "single-pod", "per-node", "multi-node"]
failures = []


def library_env():
    """The EPFABRIC_* variables that the library, the Python package and the tools read."""
    names = set()
    for folder in ("python/epfabric", "client", "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".py", ".cc", ".h")):
                    names |= set(re.findall(r"\b(EPFABRIC_[A-Z_]+)\b", open(os.path.join(dirpath, name)).read()))
    return names


LIBRARY_ENV = library_env()


def fail(where, message):
    failures.append(f"{where}: {message}")


def flags_of(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
    return set(re.findall(r"--([a-z_]+)", out))


def manifest_files():
    for dirpath, _, names in os.walk(KUBE):
        for name in sorted(names):
            if name.endswith((".yaml", ".yml")):
                yield os.path.join(dirpath, name)


def pod_specs(doc):
    kind = doc.get("kind")
    if kind == "Pod":
        return [doc.get("spec", {})]
    if kind in ("Deployment", "DaemonSet", "StatefulSet", "Job", "ReplicaSet"):
        return [doc["spec"]["template"]["spec"]]
    return []


def flag_values(args, flag):
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{flag}=")]


def probe_command(container, probe):
    return ((container.get(probe) or {}).get("exec") or {}).get("command") or []


def check_pod(where, spec, daemon_flags, epctl_flags, services_seen):
    for key in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"):
        if spec.get(key):
            fail(where, f"{key} is set")
    containers = spec.get("initContainers", []) + spec.get("containers", [])
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in containers:
        cw = f"{where} container {c['name']}"
        for item in c.get("env", []):
            if item["name"].startswith("EPFABRIC_") and item["name"] not in LIBRARY_ENV:
                fail(cw, f"env {item['name']}: nothing in python/epfabric, client/ or tools/ reads it")
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            fail(cw, "privileged")
        if sc.get("allowPrivilegeEscalation", True):
            fail(cw, "allowPrivilegeEscalation is not false")
        if not sc.get("readOnlyRootFilesystem"):
            fail(cw, "readOnlyRootFilesystem is not true")
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                fail(cw, f"mounts volume {m['name']} that the pod does not define")
        args = c.get("args") or []
        if "epfabric" not in c.get("image", "") or not any(a.startswith("--client_socket=") for a in args):
            continue
        # An epfabricd container.
        for a in args:
            m = re.match(r"--([a-z_]+)", a)
            if m and m.group(1) not in daemon_flags:
                fail(cw, f"flag --{m.group(1)} is not in epfabricd --help")
        socket = flag_values(args, "client_socket")[0]
        socket_dir = os.path.dirname(socket)
        if socket_dir not in mounts:
            fail(cw, f"the socket directory {socket_dir} is not a mounted volume")
        # Off loopback the peer port needs mutual TLS (or the test-only --insecure_peer_port); on loopback a daemon
        # makes its own credential when none is named (docs/security.md, "A first run").
        loopback = ("127.", "localhost:", "[::1]")
        off_loopback = [v for v in flag_values(args, "peer_listen") if not v.startswith(loopback)]
        if off_loopback and not (flag_values(args, "tls_cert") or "--insecure_peer_port" in args):
            fail(cw, f"--peer_listen={off_loopback[0]} without --tls_* (or --insecure_peer_port)")
        for secret in flag_values(args, "fabric_secret_file"):
            if os.path.dirname(secret) not in mounts:
                fail(cw, f"{secret} is not on a mounted volume")
        for flag, port_prefix in (("metrics_listen", "metrics"), ("peer_listen", "peer"), ("data_listen", "data")):
            for value in flag_values(args, flag):
                port = int(value.rsplit(":", 1)[1])
                declared = [p for p in c.get("ports", []) if p.get("name", "").startswith(port_prefix)]
                if flag != "peer_listen" and not any(p["containerPort"] == port for p in declared):
                    fail(cw, f"--{flag}={value} but no container port {port} named {port_prefix}*")
                if flag == "peer_listen" and declared and not any(p["containerPort"] == port for p in declared):
                    fail(cw, f"--{flag}={value} disagrees with the declared peer port")
        # Peers on other hosts: the socket wire's data listener would otherwise take a random port, which no
        # network policy or firewall rule can name.
        reachable = [v for v in flag_values(args, "peer_listen") if not v.startswith(("127.", "localhost:", "[::1]"))]
        data = flag_values(args, "data_listen")
        if reachable and (not data or int(data[0].rsplit(":", 1)[1]) == 0):
            fail(cw, f"--peer_listen={reachable[0]} serves other hosts but --data_listen has no fixed port")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            command = probe_command(c, probe)
            if not command or command[0] != "epctl" or "health" not in command:
                fail(cw, f"{probe} is not `epctl ... health`")
                continue
            for a in command[1:]:
                m = re.match(r"--([a-z_]+)", a)
                if m and m.group(1) not in epctl_flags:
                    fail(cw, f"{probe}: flag --{m.group(1)} is not in epctl --help")
            if f"--socket={socket}" not in command:
                fail(cw, f"{probe} does not ask the daemon's socket {socket}")
            service = (flag_values(command, "service") or [""])[0]
            services_seen.add(service)
            if probe == "readinessProbe" and service != "epfabric.v1.Fabric":
                fail(cw, "readiness must ask epfabric.v1.Fabric (SERVING only in a complete fabric)")
        # Other containers of the pod that use the daemon's socket directory mount the same volume there.
        for other in containers:
            other_mounts = {m["mountPath"]: m["name"] for m in other.get("volumeMounts", [])}
            if socket_dir in other_mounts and other_mounts[socket_dir] != mounts.get(socket_dir):
                fail(cw, f"{other['name']} mounts another volume at {socket_dir}")


def check_services_against_daemon(daemon, epctl, services):
    """Every probed service is one a real daemon answers (SERVING or NOT_SERVING, not NOT_FOUND)."""
    work = tempfile.mkdtemp(prefix="epf-k8s-")
    sock = os.path.join(work, "d.sock")
    proc = subprocess.Popen([daemon, f"--client_socket={sock}", "--insecure_peer_port", "--backend=host",
                             "--log_level=warn"], stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        for service in sorted(services):
            r = subprocess.run([epctl, f"--socket={sock}", "health", f"--service={service}"], capture_output=True,
                               text=True, timeout=30)
            if r.returncode != 0 and "NOT_SERVING" not in r.stdout:
                fail("probes", f"health service '{service}' is not one the daemon answers: {r.stdout}{r.stderr}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("manifests", "kustomize"):
        print(__doc__)
        return 2
    mode, daemon, epctl = sys.argv[1:]
    daemon_flags, epctl_flags = flags_of(daemon), flags_of(epctl)
    if "metrics_listen" not in daemon_flags:
        fail(daemon, "--help lists no --metrics_listen")
    services = set()
    if mode == "manifests":
        count = 0
        for path in manifest_files():
            rel = os.path.relpath(path, ROOT)
            try:
                docs = [d for d in yaml.safe_load_all(open(path)) if d]
            except yaml.YAMLError as e:
                fail(rel, f"does not parse: {e}")
                continue
            for doc in docs:
                count += 1
                if "apiVersion" not in doc or "kind" not in doc:
                    fail(rel, "an object without apiVersion/kind")
                for spec in pod_specs(doc):
                    check_pod(f"{rel} {doc['kind']}/{doc['metadata']['name']}", spec, daemon_flags, epctl_flags,
                              services)
        for overlay in OVERLAYS:
            if not os.path.exists(os.path.join(KUBE, overlay, "kustomization.yaml")):
                fail(overlay, "no kustomization.yaml")
        print(f"{count} objects in {len(list(manifest_files()))} files")
    else:
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            print("SKIPPED: kubectl is not installed; `kubectl kustomize` cannot render the overlays here")
            return 77
        for overlay in OVERLAYS:
            r = subprocess.run([kubectl, "kustomize", os.path.join(KUBE, overlay)], capture_output=True, text=True,
                               timeout=60)
            if r.returncode != 0:
                fail(overlay, f"kubectl kustomize failed: {r.stderr}")
                continue
            docs = [d for d in yaml.safe_load_all(r.stdout) if d]
            workloads = [d for d in docs if pod_specs(d)]
            if not workloads:
                fail(overlay, "renders no workload")
            for doc in workloads:
                check_pod(f"{overlay} {doc['kind']}/{doc['metadata']['name']}", pod_specs(doc)[0], daemon_flags,
                          epctl_flags, services)
                for c in pod_specs(doc)[0].get("initContainers", []) + pod_specs(doc)[0].get("containers", []):
                    if c["image"] == "epfabric":
                        fail(overlay, f"container {c['name']}: image not pinned by the overlay")
            print(f"{overlay}: {len(docs)} objects")
    if services:
        check_services_against_daemon(daemon, epctl, services)
    for f in failures:
        print("FAIL", f)
    print("OK" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
