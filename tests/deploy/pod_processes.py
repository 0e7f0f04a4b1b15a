"""What pod_harness.py runs pods with: local processes standing in for a node and its pods (volumes as
directories, runAsUser through setpriv, probes), Pod Security checks, and the shared failure list."""
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid

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
