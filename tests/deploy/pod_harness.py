#!/usr/bin/env python3
"""Runs the deployment examples' containers as local processes and checks that they work (issue 37).

  pod_harness.py BUILD_DIR FAKE_KUBELET [EXAMPLE...]     examples: dockerfile sidecar single-pod per-node multi-node
                                                         (EPF_HARNESS_KEEP=1 keeps the logs of passing examples)

For each example, every container of its pods runs as a process, the way kubelet would start it:
  - the command: `command`/`args` with $(VAR) expanded, the image's ENTRYPOINT/CMD (Dockerfile) where the manifest
    gives none; binaries from this build;
  - the env: `value`, `fieldRef` (pod name, namespace, node name, pod IP = 127.0.0.1), what the device plugin's
    Allocate returned, and what LeaderWorkerSet injects (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX);
  - the volumes: every emptyDir a fresh directory (0777, group fsGroup, setgid, as kubelet makes them), every
    hostPath a directory of the one simulated node (created by DirectoryOrCreate, root-owned 0755), every
    cert-manager csi-driver volume (csi.cert-manager.io) a directory with tls.crt, tls.key and ca.crt made for that
    pod as the driver makes them: the volume's common name, DNS names and key usages with ${POD_NAME},
    ${POD_NAMESPACE}, ${POD_UID} and ${SERVICE_ACCOUNT_NAME} expanded (any other variable is an error, as in the
    driver), signed by a CA per Issuer that the example must define; a container's paths are rewritten to those
    directories;
  - the user: runAsUser/runAsGroup/supplementalGroups/fsGroup, capabilities (drop ALL + add) and no_new_privs
    through setpriv, when the harness runs as root;
  - the network: every pod has its own ports: a listen or dial address 0.0.0.0/127.0.0.1:P of a pod maps to a free
    loopback port of that pod, and a cluster DNS name of a pod (LWS_LEADER_ADDRESS) with port P to that pod's port;
  - probes: startupProbe, then readinessProbe, until they pass (a bounded time), livenessProbe at the end.
Then a serving stand-in in place of the serving container's command (there is no inference image here) does what
epfabric.deep_ep does: finds each local rank's daemon through EPFABRIC_SOCKET, creates the group on rank 0's daemon,
runs one epfabric_worker per local rank (checked dispatch + combine, element by element), deletes the group. The
daemons' /metrics must count the probes' health checks under grpc.health.v1.Health. At the end every process gets
SIGTERM and must exit 0.

What is not real here: no GPU (--backend=cuda runs as --backend=host, --device is dropped), no container images
(binaries of this build, the host's filesystem apart from the volumes), no network namespaces (ports are remapped,
every pod IP is 127.0.0.1), no kubelet (tests/deploy/fake_kubelet stands in for its device-plugin side), no
cert-manager (openssl issues what the csi-driver would), no LeaderWorkerSet controller (the harness names the pods
and sets the env as it does: leader <lws>-<group>, workers <lws>-<group>-<index>).

Each example's pod specs are also checked against the Pod Security Standards: every pod must meet the level its
namespace enforces (pod-security.kubernetes.io/enforce), "restricted" where the example sets none.
"""
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
failures = []


def fail(where, message):
    failures.append(f"{where}: {message}")
    print(f"FAIL {where}: {message}", flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openssl(args):
    done = subprocess.run(["openssl"] + [str(a) for a in args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args[:2]))}: {done.stderr.strip()}")


# ---- Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/) ----

BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}


def all_containers(spec):
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def pod_security_violations(spec):
    """{"baseline": [...], "restricted": [...]}: what keeps the pod from each level (restricted includes baseline)."""
    baseline, restricted = [], []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            baseline.append(field)
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds:
            baseline.append(f"volume {volume['name']}: hostPath")
        if not kinds <= RESTRICTED_VOLUMES:
            restricted.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_sc = spec.get("securityContext", {})
    for c in all_containers(spec):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            baseline.append(f"{name}: privileged")
        caps = sc.get("capabilities", {})
        added = set(caps.get("add", []))
        if added - BASELINE_CAPS:
            baseline.append(f"{name}: adds {sorted(added - BASELINE_CAPS)}")
        if "ALL" not in caps.get("drop", []):
            restricted.append(f"{name}: does not drop ALL capabilities")
        if added - {"NET_BIND_SERVICE"}:
            restricted.append(f"{name}: adds {sorted(added - {'NET_BIND_SERVICE'})}")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                baseline.append(f"{name}: hostPort {port['hostPort']}")
        if sc.get("allowPrivilegeEscalation", True) is not False:
            restricted.append(f"{name}: allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            restricted.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            restricted.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp == "Unconfined":
            baseline.append(f"{name}: seccomp Unconfined")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            restricted.append(f"{name}: seccomp is not RuntimeDefault or Localhost")
    return {"baseline": baseline, "restricted": baseline + restricted}


def check_pod_security(where, spec, level):
    if level == "privileged":
        return
    for problem in pod_security_violations(spec)[level]:
        fail(where, f"Pod Security '{level}': {problem}")


# ---- the simulated node and its pods ----

class Node:
    def __init__(self, root, build, fake_kubelet):
        self.root = pathlib.Path(root)
        self.build = pathlib.Path(build)
        self.fake_kubelet = fake_kubelet
        self.name = "node-a"
        self.processes = []  # (where, Popen)
        self.dns = {}  # cluster DNS name -> Pod (LeaderWorkerSet's leader address)
        self.issuers = {}  # (namespace, issuer) -> (ca.crt, ca.key)
        self.path_env = os.pathsep.join(str(self.build / d) for d in ("daemon", "client", "tools")) + os.pathsep + \
            os.environ.get("PATH", "/usr/bin:/bin")

    def host_path(self, path, create):
        directory = self.root / "node" / path.lstrip("/")
        if create and not directory.exists():
            directory.mkdir(parents=True)
            directory.chmod(0o755)
        return directory

    def issuer_ca(self, namespace, issuer):
        """The CA behind a cert-manager Issuer (made on first use)."""
        key = (namespace, issuer)
        if key not in self.issuers:
            directory = self.root / "issuers" / f"{namespace}.{issuer}"
            directory.mkdir(parents=True)
            openssl(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                     "-keyout", directory / "ca.key", "-out", directory / "ca.crt", "-days", "2",
                     "-subj", f"/CN={issuer}.{namespace}", "-addext", "basicConstraints=critical,CA:TRUE",
                     "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
            self.issuers[key] = (directory / "ca.crt", directory / "ca.key")
        return self.issuers[key]

    def stop_all(self):
        for where, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for where, process in self.processes:
            try:
                code = process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
                fail(where, "did not stop within 10 s of SIGTERM")
                continue
            if code != 0 and not getattr(process, "expected_exit", False):
                fail(where, f"exited {code} after SIGTERM")
        self.processes.clear()


class Pod:
    """One pod of an example on the node: its volumes, ports and environment."""

    def __init__(self, node, name, namespace, spec, image, injected_env=None, issuers=()):
        """injected_env: what a controller adds to every container (LeaderWorkerSet's variables); issuers: the
        cert-manager Issuers the example defines (a csi-driver volume must name one)."""
        self.node, self.name, self.namespace, self.spec, self.image = node, name, namespace, spec, image
        self.injected_env = dict(injected_env or {})
        self.issuers = set(issuers)
        self.uid = str(uuid.uuid4())
        self.dir = node.root / "pods" / name
        self.dir.mkdir(parents=True)
        self.ports = {}
        self.volumes = {}
        fs_group = spec.get("securityContext", {}).get("fsGroup")
        for volume in spec.get("volumes", []):
            if "emptyDir" in volume:
                directory = self.dir / volume["name"]
                directory.mkdir()
                directory.chmod(0o777)
                if fs_group is not None and os.geteuid() == 0:
                    os.chown(directory, 0, fs_group)
                    directory.chmod(0o2777)
            elif "hostPath" in volume:
                kind = volume["hostPath"].get("type", "")
                directory = node.host_path(volume["hostPath"]["path"], create=kind == "DirectoryOrCreate")
                if not directory.exists():
                    raise RuntimeError(f"{name}: hostPath {volume['hostPath']['path']} ({kind}) does not exist")
            elif volume.get("csi", {}).get("driver") == "csi.cert-manager.io":
                directory = self.dir / volume["name"]
                directory.mkdir()
                self.issue_certificate(volume, directory, issuers, fs_group)
            else:
                raise RuntimeError(f"{name}: volume {volume['name']}: the harness knows emptyDir, hostPath and "
                                   "csi.cert-manager.io only")
            self.volumes[volume["name"]] = directory

    def issue_certificate(self, volume, directory, issuers, fs_group):
        """What cert-manager's csi-driver mounts: a key made for this pod and its certificate from the Issuer."""
        attributes = volume["csi"].get("volumeAttributes", {})
        where = f"{self.name} volume {volume['name']}"
        issuer = attributes.get("csi.cert-manager.io/issuer-name")
        kind = attributes.get("csi.cert-manager.io/issuer-kind", "Issuer")
        if (kind, issuer) not in issuers:
            raise RuntimeError(f"{where}: {kind} {issuer!r} is not defined by the example")
        variables = {"POD_NAME": self.name, "POD_NAMESPACE": self.namespace, "POD_UID": self.uid,
                     "SERVICE_ACCOUNT_NAME": self.spec.get("serviceAccountName", "default")}

        def expand_csi(text):
            unknown = [v for v in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text) if v not in variables]
            if unknown:
                raise RuntimeError(f"{where}: undefined variable(s) {unknown}: csi-driver knows {sorted(variables)}")
            return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: variables[m.group(1)], text)

        common_name = expand_csi(attributes.get("csi.cert-manager.io/common-name", ""))
        dns_names = [n.strip() for n in expand_csi(attributes.get("csi.cert-manager.io/dns-names", "")).split(",")
                     if n.strip()]
        usages = {u.strip() for u in attributes.get("csi.cert-manager.io/key-usages", "").split(",") if u.strip()}
        names = {"server auth": "serverAuth", "client auth": "clientAuth", "digital signature": "digitalSignature",
                 "key encipherment": "keyEncipherment"}
        if usages - set(names):
            raise RuntimeError(f"{where}: key usages {sorted(usages - set(names))} unknown to the harness")
        extended = [names[u] for u in sorted(usages) if u in ("server auth", "client auth")]
        basic = [names[u] for u in sorted(usages) if u not in ("server auth", "client auth")]
        extensions = directory.parent / f"{volume['name']}.ext"
        lines = []
        if dns_names:
            lines.append("subjectAltName=" + ",".join(f"DNS:{n}" for n in dns_names))
        if extended:
            lines.append("extendedKeyUsage=" + ",".join(extended))
        if basic:
            lines.append("keyUsage=" + ",".join(basic))
        extensions.write_text("\n".join(lines) + "\n")
        ca_crt, ca_key = self.node.issuer_ca(self.namespace, issuer)
        request = directory.parent / f"{volume['name']}.csr"
        openssl(["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", directory / "tls.key", "-out", request, "-subj", f"/CN={common_name}"])
        openssl(["x509", "-req", "-in", request, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
                 "-out", directory / "tls.crt", "-days", "1", "-extfile", extensions])
        shutil.copy(ca_crt, directory / "ca.crt")
        group = attributes.get("csi.cert-manager.io/fs-group", fs_group)
        for f in ("tls.key", "tls.crt", "ca.crt"):
            if group is not None and os.geteuid() == 0:
                os.chown(directory / f, 0, int(group))
            (directory / f).chmod(0o440 if group is not None else 0o444)
        self.certificates = getattr(self, "certificates", {})
        self.certificates[volume["name"]] = common_name

    def port(self, port):
        if port not in self.ports:
            self.ports[port] = free_port()
        return self.ports[port]

    # -- one container --

    def mounts_of(self, container, extra_mounts=()):
        mounts = {m["mountPath"]: str(self.volumes[m["name"]]) for m in container.get("volumeMounts", [])}
        for container_path, host_path in extra_mounts:
            mounts[container_path] = host_path
        return mounts

    def rewrite(self, text, mounts):
        """Container paths to the volumes' directories, listen/dial ports to this pod's ports, cuda to host."""
        if mounts:
            # A path already under the harness's directory (an Allocate answer, a value rewritten before) stays.
            root = str(self.node.root)
            pattern = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
            text = re.sub(f"(?<![\\w/.-])({pattern})(?=/|$|[^\\w.-])",
                          lambda m: m.group(0) if text.startswith(root, m.start()) else mounts[m.group(1)], text)
        # Cluster DNS names of other pods (with or without .svc[.cluster.local]) dial that pod's port.
        names = "|".join(re.escape(n) for n in sorted(self.node.dns, key=len, reverse=True))
        hosts = r"0\.0\.0\.0|127\.0\.0\.1|localhost" + (f"|{names}" if names else "")

        def port_of(m):
            name = m.group(1)
            pod = self.node.dns.get(name, self)
            return f"127.0.0.1:{pod.port(int(m.group(3)))}"

        text = re.sub(rf"(?<![\w.-])({hosts})((?:\.svc(?:\.cluster\.local)?)?):(\d+)\b", port_of, text)
        return text.replace("--backend=cuda", "--backend=host")

    def env_of(self, container, mounts, extra_env=None):
        env = {"PATH": self.node.path_env, "HOME": "/nonexistent", "LANG": "C.UTF-8"}
        env.update(self.image.get("env", {}))
        env.update(self.injected_env)
        fields = {"metadata.name": self.name, "metadata.namespace": self.namespace, "spec.nodeName": self.node.name,
                  "status.podIP": "127.0.0.1", "metadata.uid": self.uid}
        for item in container.get("env", []):
            if "value" in item:
                value = expand(item["value"], env)
            elif "fieldRef" in item.get("valueFrom", {}):
                value = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                raise RuntimeError(f"{container['name']}: env {item['name']}: unsupported source")
            env[item["name"]] = value
        env.update(extra_env or {})
        # PATH names the build's directories on this machine, not paths inside the container: a mount such as /tmp
        # must not rewrite them (the build may live under it, as a CI clone in /tmp does).
        return {k: v if k == "PATH" else self.rewrite(v, mounts) for k, v in env.items()}

    def argv_of(self, container, env, mounts):
        if "command" in container:
            argv = list(container["command"]) + list(container.get("args", []))
        else:
            argv = list(self.image["entrypoint"]) + list(container.get("args", self.image.get("cmd", [])))
        argv = [self.rewrite(expand(a, env), mounts) for a in argv]
        # No GPU: --device goes, as an argument or inside a shell script's command line.
        argv = [re.sub(r"(?<=\s)--device=\S+", "", a) if re.search(r"\s", a) else a for a in argv]
        return [a for a in argv if not a.startswith("--device=")]

    def setpriv(self, container):
        """setpriv's arguments for the container's user, groups and capabilities (root only)."""
        if os.geteuid() != 0:
            return []
        pod_sc, sc = self.spec.get("securityContext", {}), container.get("securityContext", {})
        uid = sc.get("runAsUser", pod_sc.get("runAsUser", 0))
        gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", 0))
        groups = [str(g) for g in pod_sc.get("supplementalGroups", [])]
        if pod_sc.get("fsGroup") is not None:
            groups.append(str(pod_sc["fsGroup"]))
        args = ["setpriv", f"--reuid={uid}", f"--regid={gid}"]
        args += [f"--groups={','.join(groups)}"] if groups else ["--clear-groups"]
        caps = sc.get("capabilities", {})
        if "ALL" in caps.get("drop", []):
            keep = "".join(f",+{c.lower()}" for c in caps.get("add", []))
            args += [f"--bounding-set=-all{keep}", "--inh-caps=-all"]
        if sc.get("allowPrivilegeEscalation") is False:
            args.append("--no-new-privs")
        return args + ["--"]

    def start(self, container, extra_env=None, extra_mounts=()):
        mounts = self.mounts_of(container, extra_mounts)
        env = self.env_of(container, mounts, extra_env)
        argv = self.argv_of(container, env, mounts)
        log = open(self.dir / f"{container['name']}.log", "w")
        process = subprocess.Popen(self.setpriv(container) + argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   cwd="/")
        self.node.processes.append((f"{self.name}/{container['name']}", process))
        return process

    def run(self, container, argv, extra_env=None, extra_mounts=(), timeout=30):
        """A command in the container's environment (a probe, a stand-in step): (exit code, output)."""
        mounts = self.mounts_of(container, extra_mounts)
        env = self.env_of(container, mounts, extra_env)
        argv = [self.rewrite(expand(a, env), mounts) for a in argv]
        try:
            done = subprocess.run(self.setpriv(container) + argv, env=env, capture_output=True, text=True,
                                  timeout=timeout, cwd="/")
            return done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            return 124, "timed out"

    def log(self, container):
        path = self.dir / f"{container['name']}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def wait_probe(self, container, kind, limit_s=30):
        probe = container.get(kind)
        if probe is None:
            return True
        # A failing startup or liveness probe restarts the container after failureThreshold periods: that bounds the
        # wait. A failing readiness probe only keeps the pod out of service until it passes: `limit_s` bounds it.
        window = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
        deadline = time.monotonic() + (limit_s if kind == "readinessProbe" else min(limit_s, window))
        while True:
            code, output = self.run(container, probe["exec"]["command"], timeout=probe.get("timeoutSeconds", 5) + 5)
            if code == 0:
                return True
            if time.monotonic() > deadline:
                fail(f"{self.name}/{container['name']}", f"{kind} never passed: {output.strip()[-500:]}\n"
                     f"log:\n{self.log(container)}")
                return False
            time.sleep(0.2)


def expand(text, env):
    """Kubernetes' $(VAR) expansion ($$ escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), str(text))


# ---- the image ----

def dockerfile_image():
    """ENTRYPOINT, CMD, ENV, USER and HEALTHCHECK of the Dockerfile's runtime stage."""
    text = (ROOT / "Dockerfile").read_text()
    runtime = text[text.rindex("\nFROM "):]
    joined = re.sub(r"\\\n\s*", " ", runtime)
    image = {"env": {}}
    for line in joined.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "ENTRYPOINT":
            image["entrypoint"] = json.loads(rest)
        elif word == "CMD":
            image["cmd"] = json.loads(rest)
        elif word == "ENV":
            for assignment in shlex.split(rest):
                key, _, value = assignment.partition("=")
                image["env"][key] = value
        elif word == "USER":
            image["user"] = rest.split(":")
        elif word == "HEALTHCHECK":
            image["healthcheck"] = rest[rest.index("CMD ") + 4:]
    image["env"].pop("PATH", None)
    image["env"].pop("LD_LIBRARY_PATH", None)
    return image


# ---- the serving stand-in ----

def serving_standin(pod, container, ranks, extra_env=None, extra_mounts=()):
    """What epfabric.deep_ep does, with epfabric_worker as each local rank's process."""
    serving_standin_across([(pod, container, extra_env, extra_mounts)], ranks)


def serving_standin_across(members, ranks_per_pod):
    """One EP group over every member pod's local ranks (host-major: pod i holds group ranks i x ranks_per_pod ...):
    each local rank finds its daemon through EPFABRIC_SOCKET, the first pod's local rank 0 creates the group over all
    of them (sized for the pods as hosts), one epfabric_worker per rank checks dispatch + combine element by element,
    then the group is deleted. members: (pod, serving container, extra env, extra mounts)."""
    where = " + ".join(f"{pod.name}/{container['name']}" for pod, container, _, _ in members) + " (stand-in)"
    hosts = len(members)
    sockets = []  # per group rank: (member, socket)
    for member in members:
        pod, container, extra_env, extra_mounts = member
        env = pod.env_of(container, pod.mounts_of(container, extra_mounts), extra_env)
        template = env.get("EPFABRIC_SOCKET", "")
        if not template:
            fail(where, f"{pod.name}: no EPFABRIC_SOCKET in the container's environment")
            return
        local = template.split(",") if "," in template else [template.format(local_rank=r, rank=r)
                                                             for r in range(ranks_per_pod)]
        if len(local) != ranks_per_pod:
            fail(where, f"{pod.name}: EPFABRIC_SOCKET names {len(local)} sockets for {ranks_per_pod} local ranks")
            return
        sockets += [(member, s) for s in local]

    def run(member, argv):
        pod, container, extra_env, extra_mounts = member
        return pod.run(container, argv, extra_env, extra_mounts)

    fabric_ranks, host_ids = [], []
    for member, s in sockets:
        code, output = run(member, ["epctl", f"--socket={s}", "--json", "topology"])
        if code != 0:
            fail(where, f"epctl topology on {s}: {output}")
            return
        topology = json.loads(output)
        fabric_ranks.append(topology["daemon"]["rank"])
        host_ids.append(topology.get("host_id", ""))
    world = len(sockets)
    shape = ["--mode=normal", "--tokens=32", "--hidden=256", "--topk=2", f"--experts={2 * world}"]
    sizing = ["epfabric_worker", "--region_bytes", f"--ranks={ranks_per_pod}"]
    if hosts > 1:
        sizing.append(f"--hosts={hosts}")
    code, output = run(members[0], sizing + shape)
    if code != 0:
        fail(where, f"epfabric_worker --region_bytes: {output}")
        return
    sizes = output.split()
    size_flags = [f"--nvl_bytes={sizes[0]}"] + ([f"--rdma_bytes={sizes[1]}"] if len(sizes) > 1 else [])
    group = f"harness-{members[0][0].name}"
    first = sockets[0]
    # A create that could not reach a member is rolled back everywhere; a serving process tries again, and so does
    # the stand-in (a loaded CI machine can stall a TLS handshake past the call's deadline), at most 3 times.
    for attempt in range(3):
        code, output = run(first[0], ["epctl", f"--socket={first[1]}", "--json", "create-group", f"--group={group}",
                                      f"--ranks={','.join(map(str, fabric_ranks))}"] + size_flags)
        if code == 0 or not any(c in output for c in ("UNAVAILABLE", "DEADLINE_EXCEEDED")):
            break
        print(f"  {where}: create-group attempt {attempt + 1}: {output.strip()[-300:]}", flush=True)
        time.sleep(1)
    if code != 0:
        fail(where, f"create-group: {output}")
        return
    token = json.loads(output)["token"]
    workers = []
    for r, (member, s) in enumerate(sockets):
        pod, container, extra_env, extra_mounts = member
        argv = ["epfabric_worker", f"--socket={s}", f"--group={group}", f"--rank={r}", f"--token={token}",
                "--seed=11"] + shape
        m = pod.mounts_of(container, extra_mounts)
        e = pod.env_of(container, m, extra_env)
        workers.append(subprocess.Popen(pod.setpriv(container) + [pod.rewrite(a, m) for a in argv], env=e,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for r, worker in enumerate(workers):
        try:
            output, _ = worker.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            worker.kill()
            output, _ = worker.communicate()
        if worker.returncode != 0 or "ok=1" not in output:
            fail(where, f"group rank {r}: exit {worker.returncode}: {output[-1500:]}")
    code, output = run(first[0], ["epctl", f"--socket={first[1]}", "--json", "delete-group", f"--group={group}",
                                  f"--token={token}"])
    if code != 0 or not json.loads(output).get("deleted"):
        fail(where, f"delete-group: {output}")
    print(f"  {where}: {world} ranks on {hosts} host(s) (fabric ranks {fabric_ranks}, host ids "
          f"{sorted(set(host_ids))}) dispatched and combined, checked", flush=True)


def check_metrics(pod, container):
    """The daemon's /metrics answers and counts the probes' health checks under grpc.health.v1.Health."""
    where = f"{pod.name}/{container['name']}"
    mounts = pod.mounts_of(container)
    listen = [a for a in pod.argv_of(container, pod.env_of(container, mounts), mounts)
              if a.startswith("--metrics_listen=")]
    if not listen:
        return
    try:
        text = urllib.request.urlopen(f"http://{listen[0].split('=', 1)[1]}/metrics", timeout=5).read().decode()
    except OSError as error:
        fail(where, f"/metrics: {error}")
        return
    if 'service="grpc.health.v1.Health"' not in text:
        fail(where, "/metrics counts no health check under service=\"grpc.health.v1.Health\"")
    if 'service="unknown"' in text:
        fail(where, "/metrics has calls of service=\"unknown\"")


# ---- the examples ----

def load(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_template(docs, kind):
    for doc in docs:
        if doc["kind"] == kind:
            template = doc["spec"]["template"] if kind != "Pod" else doc
            return doc, template["spec"]
    raise RuntimeError(f"no {kind}")


def start_pod(pod, skip=(), ready=True):
    """Init containers in order (a sidecar, restartPolicy Always, keeps running; others must exit 0), then the
    containers; every daemon container's startup probe, and with `ready` its readiness probe (a fabric across pods is
    ready only once every pod's daemons run: wait_ready then). Returns the daemon containers."""
    daemons = []
    for container in pod.spec.get("initContainers", []):
        if container.get("restartPolicy") == "Always":
            pod.start(container)
            daemons.append(container)
            if not pod.wait_probe(container, "startupProbe"):
                return None
            continue
        process = pod.start(container)
        process.expected_exit = True
        if process.wait(timeout=30) != 0:
            fail(f"{pod.name}/{container['name']}", f"init container exited {process.returncode}: {pod.log(container)}")
            return None
    for container in pod.spec.get("containers", []):
        if container["name"] in skip:
            continue
        pod.start(container)
        daemons.append(container)
    for container in daemons:
        if not pod.wait_probe(container, "startupProbe"):
            return None
    if ready and not wait_ready(pod, daemons):
        return None
    return daemons


def wait_ready(pod, daemons):
    return all(pod.wait_probe(container, "readinessProbe", limit_s=90) for container in daemons)


def finish_pod(pod, daemons):
    for container in daemons:
        pod.wait_probe(container, "livenessProbe", limit_s=5)
        check_metrics(pod, container)


def example_dockerfile(node):
    """The image's default command and its HEALTHCHECK, as `podman run` would start them."""
    image = dockerfile_image()
    uid, gid = (int(x) for x in image["user"])
    spec = {"securityContext": {"runAsUser": uid, "runAsGroup": gid},
            "volumes": [{"name": "run", "emptyDir": {}}]}
    container = {"name": "epfabricd", "volumeMounts": [{"name": "run", "mountPath": "/run/epfabric"}],
                 "env": [{"name": k, "value": v} for k, v in image["env"].items()],
                 "startupProbe": {"exec": {"command": ["sh", "-c", image["healthcheck"]]}, "periodSeconds": 1,
                                  "failureThreshold": 15}}
    pod = Pod(node, "image", "default", spec, image)
    # The image's RUN made /run/epfabric 0750, owned by the runtime user.
    if os.geteuid() == 0:
        os.chown(pod.volumes["run"], uid, gid)
    pod.volumes["run"].chmod(0o750)
    pod.start(container)
    if pod.wait_probe(container, "startupProbe"):
        serving_standin(pod, container, ranks=1)


def example_sidecar(node):
    docs = load(KUBE / "sidecar" / "inference.yaml")
    _, spec = pod_template(docs, "Deployment")
    check_pod_security("sidecar", spec, "restricted")
    pod = Pod(node, "inference", "default", spec, dockerfile_image())
    daemons = start_pod(pod, skip={"server"})
    if daemons is not None:
        serving_standin(pod, next(c for c in spec["containers"] if c["name"] == "server"), ranks=1)
        finish_pod(pod, daemons)


def example_single_pod(node):
    docs = load(KUBE / "single-pod" / "deployment.yaml")
    _, spec = pod_template(docs, "Deployment")
    check_pod_security("single-pod", spec, "restricted")
    pod = Pod(node, "moe-server", "default", spec, dockerfile_image())
    daemons = start_pod(pod, skip={"server"})
    if daemons is not None:
        server = next(c for c in spec["containers"] if c["name"] == "server")
        serving_standin(pod, server, ranks=8)
        if not pod.wait_probe(server, "readinessProbe", limit_s=5):
            return
        finish_pod(pod, daemons)


def example_per_node(node):
    docs = load(KUBE / "per-node" / "daemonset.yaml")
    namespace = load(KUBE / "per-node" / "namespace.yaml")[0]
    _, spec = pod_template(docs, "DaemonSet")
    enforce = "pod-security.kubernetes.io/enforce"
    check_pod_security("per-node daemonset", spec, namespace["metadata"]["labels"][enforce])
    if not spec.get("priorityClassName") == "system-node-critical":
        fail("per-node daemonset", "priorityClassName is not system-node-critical")
    plugin_dir = node.host_path("/var/lib/kubelet/device-plugins", create=True)
    kubelet_log = open(node.root / "fake_kubelet.log", "w")
    kubelet = subprocess.Popen([node.fake_kubelet, f"--plugin_dir={plugin_dir}", "serve"], stdout=kubelet_log,
                               stderr=subprocess.STDOUT)
    node.processes.append(("fake kubelet", kubelet))
    pod = Pod(node, "epfabricd-node-a", "epfabric-system", spec, dockerfile_image())
    daemons = start_pod(pod, skip={"device-plugin"})
    if daemons is None:
        return
    plugin = next(c for c in spec["containers"] if c["name"] == "device-plugin")
    pod.start(plugin)
    deadline = time.monotonic() + 15
    while "epfabric.io/ep-slot" not in (node.root / "fake_kubelet.log").read_text():
        if time.monotonic() > deadline:
            fail("per-node device plugin", f"never registered with kubelet: {pod.log(plugin)}")
            return
        time.sleep(0.1)

    tenant_docs = load(KUBE / "per-node" / "tenant-example.yaml")
    tenant_ns = next(d for d in tenant_docs if d["kind"] == "Namespace")
    tenant_pod_doc, tenant_spec = pod_template(tenant_docs, "Pod")
    check_pod_security("per-node tenant", tenant_spec, tenant_ns["metadata"]["labels"][enforce])
    server = tenant_spec["containers"][0]
    slots = int(server["resources"]["limits"]["epfabric.io/ep-slot"])
    # What kubelet does when it starts the tenant's container: ask the plugin for `slots` devices.
    allocated = subprocess.run([node.fake_kubelet, f"--plugin_dir={plugin_dir}", f"--size={slots}", "allocate"],
                               capture_output=True, text=True, timeout=30)
    if allocated.returncode != 0:
        fail("per-node tenant", f"Allocate: {allocated.stdout}{allocated.stderr}")
        return
    response = json.loads(allocated.stdout)
    mounts = [(m["container_path"], m["host_path"]) for m in response["mounts"]]
    tenant = Pod(node, tenant_pod_doc["metadata"]["name"], tenant_ns["metadata"]["name"], tenant_spec,
                 dockerfile_image())
    serving_standin(tenant, server, ranks=slots, extra_env=response["envs"], extra_mounts=mounts)
    finish_pod(pod, daemons)


def example_multi_node(node):
    """A LeaderWorkerSet group: the leader pod and its workers as "hosts" of one fabric on loopback."""
    folder = KUBE / "multi-node"
    namespace = load(folder / "namespace.yaml")[0]
    level = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    issuers = {(d["kind"], d["metadata"]["name"]) for d in load(folder / "ca-issuer.yaml")
               if d["kind"] in ("Issuer", "ClusterIssuer")}
    lws = next(d for d in load(folder / "leaderworkerset.yaml") if d["kind"] == "LeaderWorkerSet")
    name, templates = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    size = templates["size"]
    # As the LWS controller names group 0's pods and addresses its leader (the headless Service named after the LWS).
    leader_name = f"{name}-0"
    leader_address = f"{leader_name}.{name}.{namespace['metadata']['name']}"
    pods = []
    for index in range(size):
        template = templates.get("leaderTemplate") if index == 0 else None
        spec = (template or templates["workerTemplate"])["spec"]
        check_pod_security(f"multi-node pod {index}", spec, level)
        injected = {"LWS_LEADER_ADDRESS": leader_address, "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}
        pod = Pod(node, leader_name if index == 0 else f"{leader_name}-{index}", namespace["metadata"]["name"], spec,
                  dockerfile_image(), injected_env=injected, issuers=issuers)
        if index == 0:
            node.dns[leader_address] = pod
        pods.append(pod)
    # No pod holds a key of another pod's daemon: every TLS key is on a volume of its own pod, made for that pod.
    names = [cn for pod in pods for cn in getattr(pod, "certificates", {}).values()]
    if len(names) != len(set(names)):
        fail("multi-node", f"two daemons' certificates have one name: {sorted(names)}")
    check_rank_guard(node, pods[-1], size)
    started = []
    for pod in pods:
        daemons = start_pod(pod, skip={"server"}, ready=False)
        if daemons is None:
            return
        started.append(daemons)
    for pod, daemons in zip(pods, started):
        if not wait_ready(pod, daemons):
            return
    members = []
    for pod in pods:
        server = next(c for c in pod.spec["containers"] if c["name"] == "server")
        members.append((pod, server, None, ()))
    ranks_per_pod = len(started[0])
    serving_standin_across(members, ranks_per_pod)
    leader_server = members[0][1]
    pods[0].wait_probe(leader_server, "readinessProbe", limit_s=5)
    for pod, daemons in zip(pods, started):
        finish_pod(pod, daemons)


def check_rank_guard(node, pod, size):
    """A daemon whose rank from LWS's env is not its certificate's (a group of another size) exits 2 and says so."""
    container = pod.spec["initContainers"][0]
    stray = Pod(node, f"{pod.name}-of-{size + 1}", pod.namespace, {"volumes": pod.spec["volumes"]},
                pod.image, injected_env=dict(pod.injected_env, LWS_GROUP_SIZE=str(size + 1),
                                             LWS_WORKER_INDEX=str(size)), issuers=set(pod.issuers))
    process = stray.start(container)
    process.expected_exit = True
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        fail(stray.name, "a daemon of a group of another size started instead of refusing")
        return
    if code != 2 or "certificate names rank" not in stray.log(container):
        fail(stray.name, f"exit {code} (expected 2 with the certificate's rank): {stray.log(container)}")


EXAMPLES = {"dockerfile": example_dockerfile, "sidecar": example_sidecar, "single-pod": example_single_pod,
            "per-node": example_per_node, "multi-node": example_multi_node}


def main():
    build, fake_kubelet = sys.argv[1], sys.argv[2]
    names = sys.argv[3:] or list(EXAMPLES)
    for name in names:
        start = time.monotonic()
        root = tempfile.mkdtemp(prefix=f"epf-pod-{name}-")
        os.chmod(root, 0o755)
        node = Node(root, build, fake_kubelet)
        before = len(failures)
        try:
            EXAMPLES[name](node)
        except Exception as error:  # a harness error is a failure of this example, not a crash of the rest
            fail(name, f"{type(error).__name__}: {error}")
        finally:
            node.stop_all()
        if len(failures) > before:
            print(f"--- {name}: FAILED ({time.monotonic() - start:.1f} s); logs in {root}")
        else:
            print(f"--- {name}: ok ({time.monotonic() - start:.1f} s)")
            if os.environ.get("EPF_HARNESS_KEEP") == "1":
                print(f"    logs kept in {root} (EPF_HARNESS_KEEP=1)")
            else:
                shutil.rmtree(root, ignore_errors=True)
    if failures:
        print(f"pod_harness: {len(failures)} failures")
        return 1
    print("pod_harness: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
