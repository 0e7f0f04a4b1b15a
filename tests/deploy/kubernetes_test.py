#!/usr/bin/env python3
"""Checks deploy/kubernetes against the binaries it runs.

  kubernetes_test.py manifests EPFABRICD EPCTL DEVICE_PLUGIN   every manifest parses; invariants of every pod spec
                                                              (raw files)
  kubernetes_test.py kustomize EPFABRICD EPCTL DEVICE_PLUGIN   `kubectl kustomize` renders each overlay; the
                                                              invariants again on the rendered objects (exit 77 =
                                                              skipped when kubectl is absent)

Every object has apiVersion, kind and metadata.name; every workload (Pod, Deployment, DaemonSet, StatefulSet, Job,
LeaderWorkerSet's leader and worker templates) has containers with a name and an image.
Invariants of every pod: no privileged container, no privilege escalation, read-only root filesystems, no hostIPC/
hostPID/hostNetwork/shareProcessNamespace; every flag given to epfabricd, epctl or epfabric_device_plugin (as the
container's command and args, or on a command line of a `sh -c` script) is one the binary's --help lists; probes ask
the daemon's own socket, readiness on epfabric.v1.Fabric, and every probed health service is one a real daemon
answers; the socket directory is a mounted volume shared with the pod's other containers that use it; metrics, peer
and data container ports agree with --metrics_listen/--peer_listen/--data_listen, and a daemon whose peer port serves
other hosts gives the socket wire's data listener a fixed port; a peer port off loopback listens on an address that
other pods can dial (not 0.0.0.0: a daemon announces the address it listens on).
Tenancy and credentials (issue #34, item 10): hostPath volumes and NVIDIA_VISIBLE_DEVICES only in pods of a
namespace that enforces Pod Security "privileged" (the per-node agents); every TLS key a daemon reads is on a
cert-manager csi-driver volume (made for that pod, never a Secret that other pods mount too), mounted by that daemon
only, whose Issuer the overlay defines; a LeaderWorkerSet's daemons hold pod certificates of that LWS
(epfabric-member:<lws>:pod:${POD_NAME}) with --ranks_per_pod = the pod's daemons and --fabric_id = the leader's name,
other daemons a CN naming a rank of their --fabric_id; no Secret volume anywhere. Images: every container that runs
our binaries names the image `epfabric` (what the Dockerfile's build line tags), and every overlay pins it with
`images:`.
"""
import os
import re
import shlex
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


BINARIES = ("epfabricd", "epctl", "epfabric_device_plugin")


def invocations(container):
    """(binary, args) for every run of one of our binaries by the container: its command/args, or the command lines
    of a `sh -c` script (continuation lines joined, `exec` dropped)."""
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    if not container.get("command"):
        argv = ["epfabricd"] + argv  # the image's ENTRYPOINT
    if len(argv) >= 3 and argv[0] in ("sh", "/bin/sh", "bash") and argv[1] == "-c":
        found = []
        script = argv[2].replace("\\\n", " ")
        for line in re.split(r"\n|&&|;", script):
            try:
                words = shlex.split(line)
            except ValueError:
                words = line.split()
            while words and words[0] in ("exec", "then", "else", "do"):
                words = words[1:]
            if words and os.path.basename(words[0]) in BINARIES:
                found.append((os.path.basename(words[0]), words[1:]))
        return found
    if argv and os.path.basename(argv[0]) in BINARIES:
        return [(os.path.basename(argv[0]), argv[1:])]
    return []


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
    if kind == "LeaderWorkerSet":
        templates = doc["spec"]["leaderWorkerTemplate"]
        return [templates[t]["spec"] for t in ("leaderTemplate", "workerTemplate") if t in templates]
    return []


def lws_name(doc):
    return doc["metadata"]["name"] if doc.get("kind") == "LeaderWorkerSet" else None


def check_object(where, doc):
    for field in ("apiVersion", "kind"):
        if not doc.get(field):
            fail(where, f"no {field}")
    if doc.get("kind") != "Kustomization" and not (doc.get("metadata") or {}).get("name"):
        fail(where, "no metadata.name")
    for spec in pod_specs(doc):
        containers = spec.get("initContainers", []) + spec.get("containers", [])
        if not spec.get("containers"):
            fail(where, "a pod template without containers")
        for c in containers:
            if not c.get("name") or not c.get("image"):
                fail(where, f"a container without name or image: {c.get('name')}")


def flag_values(args, flag):
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{flag}=")]


def probe_command(container, probe):
    return ((container.get(probe) or {}).get("exec") or {}).get("command") or []


def check_pod(where, spec, flags, services_seen, privileged=False, issuers=None, lws=None):
    """flags: binary -> the flags its --help lists; privileged: the pod's namespace enforces Pod Security
    "privileged" (node agents); issuers: the (kind, name) of the cert-manager issuers the overlay defines (None: not
    known here); lws: the name of the LeaderWorkerSet whose template this is (None: another workload)."""
    epctl_flags = flags["epctl"]
    for key in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"):
        if spec.get(key):
            fail(where, f"{key} is set")
    containers = spec.get("initContainers", []) + spec.get("containers", [])
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for volume in volumes.values():
        if "hostPath" in volume and not privileged:
            fail(where, f"volume {volume['name']}: hostPath in a pod outside a privileged namespace (tenants reach "
                        "the daemons through the device plugin)")
        if "secret" in volume:
            fail(where, f"volume {volume['name']}: a Secret volume (TLS keys come per pod from the csi-driver)")
        csi = volume.get("csi")
        if csi and csi.get("driver") == "csi.cert-manager.io" and issuers is not None:
            attributes = csi.get("volumeAttributes", {})
            issuer = (attributes.get("csi.cert-manager.io/issuer-kind", "Issuer"),
                      attributes.get("csi.cert-manager.io/issuer-name"))
            if issuer not in issuers:
                fail(where, f"volume {volume['name']}: {issuer[0]} {issuer[1]} is not defined by the overlay")
    for c in containers:
        cw = f"{where} container {c['name']}"
        runs = invocations(c)
        if runs and c.get("image") != "epfabric":
            fail(cw, f"image {c.get('image')}: our binaries come from image 'epfabric' (the Dockerfile's tag; "
                     "overlays pin it with images:)")
        for binary, args in runs:
            for a in args:
                m = re.match(r"--([a-z_]+)", a)
                if m and m.group(1) not in flags[binary]:
                    fail(cw, f"flag --{m.group(1)} is not in {binary} --help")
        for item in c.get("env", []):
            if item["name"] == "NVIDIA_VISIBLE_DEVICES" and not privileged:
                fail(cw, "sets NVIDIA_VISIBLE_DEVICES outside a privileged namespace: GPUs come through the "
                         "scheduler (a DRA claim, a device plugin's limits)")
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
        daemons = [args for binary, args in runs if binary == "epfabricd"]
        if not daemons:
            continue
        # An epfabricd container.
        args = daemons[0]
        if not flag_values(args, "client_socket"):
            fail(cw, "epfabricd without --client_socket")
            continue
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
        for key in flag_values(args, "tls_key"):
            directory = os.path.dirname(key)
            volume = volumes.get(mounts.get(directory, ""), {})
            if (volume.get("csi") or {}).get("driver") != "csi.cert-manager.io":
                fail(cw, f"--tls_key={key}: not on a cert-manager csi-driver volume of this pod")
                continue
            sharers = [o["name"] for o in containers if o is not c and
                       any(m["name"] == mounts[directory] for m in o.get("volumeMounts", []))]
            if sharers:
                fail(cw, f"the TLS key's volume {mounts[directory]} is mounted by {sharers} too")
            check_member_certificate(cw, args, volume, lws, len([o for o in containers if any(
                b == "epfabricd" for b, _ in invocations(o))]))
        for listen in flag_values(args, "peer_listen") + flag_values(args, "data_listen"):
            if listen.startswith(("0.0.0.0:", "[::]:")) and flag_values(args, "world_size") != ["1"]:
                fail(cw, f"{listen}: a daemon announces the address it listens on, which other pods cannot dial "
                         "(listen on $(POD_IP))")
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


def check_member_certificate(where, args, volume, lws, daemons_in_pod):
    """A daemon's csi-driver certificate: a LeaderWorkerSet pod's daemons hold pod certificates of that LWS
    (epfabric-member:<lws>:pod:${POD_NAME}: one template serves every worker, so a literal rank would be every
    worker's) with --ranks_per_pod = the pod's daemons and --fabric_id = the leader's name; elsewhere the CN names
    the daemon's --fabric_id."""
    cn = (volume.get("csi") or {}).get("volumeAttributes", {}).get("csi.cert-manager.io/common-name", "")
    fabric = (flag_values(args, "fabric_id") or [""])[0]
    if lws is not None:
        wanted = f"epfabric-member:{lws}:pod:${{POD_NAME}}"
        if cn != wanted:
            fail(where, f"certificate CN {cn!r}: a LeaderWorkerSet pod's daemon needs {wanted!r}")
        if flag_values(args, "ranks_per_pod") != [str(daemons_in_pod)]:
            fail(where, f"--ranks_per_pod={flag_values(args, 'ranks_per_pod')}: the pod runs {daemons_in_pod} daemons")
        # $$ is Kubernetes' escape of the shell's $.
        if fabric != "$${LWS_LEADER_ADDRESS%%.*}":
            fail(where, f"--fabric_id={fabric}: a LeaderWorkerSet group's fabric is its leader's name "
                        "($${LWS_LEADER_ADDRESS%%.*})")
        return
    if not re.fullmatch(rf"epfabric-member:{re.escape(fabric)}:(0|[1-9][0-9]*)", cn):
        fail(where, f"certificate CN {cn!r} names no rank of --fabric_id={fabric}")


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


def overlay_context(objects, default_namespace):
    """The namespaces that enforce Pod Security "privileged" and the cert-manager issuers among `objects`."""
    privileged = {d["metadata"]["name"] for d in objects if d.get("kind") == "Namespace" and
                  (d["metadata"].get("labels") or {}).get("pod-security.kubernetes.io/enforce") == "privileged"}
    issuers = {(d["kind"], d["metadata"]["name"]) for d in objects if d.get("kind") in ("Issuer", "ClusterIssuer")}
    return privileged, issuers


def check_image_name():
    """The Dockerfile's documented build tags the image `epfabric`; every overlay renames exactly that image."""
    dockerfile = open(os.path.join(ROOT, "Dockerfile")).read()
    if not re.search(r"build -t epfabric \.", dockerfile):
        fail("Dockerfile", "its build line does not tag the image 'epfabric', the name the manifests use")
    for overlay in OVERLAYS:
        path = os.path.join(KUBE, overlay, "kustomization.yaml")
        if not os.path.exists(path):
            fail(overlay, "no kustomization.yaml")
            continue
        images = yaml.safe_load(open(path)).get("images") or []
        if [i.get("name") for i in images] != ["epfabric"]:
            fail(overlay, f"kustomization images: {images}: expected one entry renaming 'epfabric'")


def main():
    if len(sys.argv) != 5 or sys.argv[1] not in ("manifests", "kustomize"):
        print(__doc__)
        return 2
    mode, daemon, epctl, plugin = sys.argv[1:]
    flags = {"epfabricd": flags_of(daemon), "epctl": flags_of(epctl), "epfabric_device_plugin": flags_of(plugin)}
    for binary, expected in (("epfabricd", "metrics_listen"), ("epctl", "socket"),
                             ("epfabric_device_plugin", "socket_dir")):
        if expected not in flags[binary]:
            fail(binary, f"--help lists no --{expected}: the flag check would check nothing")
    services = set()
    if mode == "manifests":
        count = 0
        folders = {}
        for path in manifest_files():
            rel = os.path.relpath(path, ROOT)
            try:
                docs = [d for d in yaml.safe_load_all(open(path)) if d]
            except yaml.YAMLError as e:
                fail(rel, f"does not parse: {e}")
                continue
            for doc in docs:
                count += 1
                check_object(rel, doc)
            folders.setdefault(os.path.dirname(path), []).extend((rel, d) for d in docs)
        for folder, entries in sorted(folders.items()):
            kustomization = os.path.join(folder, "kustomization.yaml")
            namespace = (yaml.safe_load(open(kustomization)) or {}).get("namespace") if os.path.exists(
                kustomization) else None
            privileged, issuers = overlay_context([d for _, d in entries], namespace)
            for rel, doc in entries:
                if doc.get("kind") == "Kustomization":
                    continue
                doc_namespace = (doc.get("metadata") or {}).get("namespace") or namespace
                for spec in pod_specs(doc):
                    check_pod(f"{rel} {doc['kind']}/{doc['metadata']['name']}", spec, flags, services,
                              privileged=doc_namespace in privileged, issuers=issuers, lws=lws_name(doc))
        check_image_name()
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
            for doc in docs:
                check_object(overlay, doc)
            privileged, issuers = overlay_context(docs, None)
            workloads = [d for d in docs if pod_specs(d)]
            if not workloads:
                fail(overlay, "renders no workload")
            for doc in workloads:
                namespace = doc["metadata"].get("namespace")
                for spec in pod_specs(doc):
                    rendered = {**spec, "initContainers": [dict(c, image="epfabric") if c["image"].endswith(
                        "/epfabric:0.1.0") else c for c in spec.get("initContainers", [])],
                                "containers": [dict(c, image="epfabric") if c["image"].endswith("/epfabric:0.1.0")
                                               else c for c in spec.get("containers", [])]}
                    check_pod(f"{overlay} {doc['kind']}/{doc['metadata']['name']}", rendered, flags, services,
                              privileged=namespace in privileged, issuers=issuers, lws=lws_name(doc))
                    for c in spec.get("initContainers", []) + spec.get("containers", []):
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
