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
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

from pod_processes import (
    KUBE, ROOT, Node, Pod, check_pod_security, fail, failures)


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
    """A LeaderWorkerSet group of 3 pods (the manifest's size or more: any size works with pod certificates) as
    "hosts" of one fabric on loopback; pod certificates checked for the ranks and the fabric their pods' names give."""
    folder = KUBE / "multi-node"
    namespace = load(folder / "namespace.yaml")[0]
    level = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    issuers = {(d["kind"], d["metadata"]["name"]) for d in load(folder / "ca-issuer.yaml")
               if d["kind"] in ("Issuer", "ClusterIssuer")}
    lws = next(d for d in load(folder / "leaderworkerset.yaml") if d["kind"] == "LeaderWorkerSet")
    name, templates = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    size = max(templates["size"], 3)
    pods = [lws_pod(node, lws, 0, index, size, namespace, issuers) for index in range(size)]
    for index, pod in enumerate(pods):
        check_pod_security(f"multi-node pod {index}", pod.spec, level)
        node.dns.setdefault(pod.injected_env["LWS_LEADER_ADDRESS"], pod)
    # No pod holds a key of another pod's daemon: every TLS key is on a volume of its own pod, made for that pod, and
    # its certificate names that pod (the ranks and the fabric follow from the name).
    for pod in pods:
        expected = f"epfabric-member:{name}:pod:{pod.name}"
        names = set(getattr(pod, "certificates", {}).values())
        if names != {expected}:
            fail(pod.name, f"its daemons' certificates name {sorted(names)}, not {expected}")
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
    check_other_group_refused(node, lws, pods, namespace, issuers)
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


def lws_pod(node, lws, group, index, size, namespace, issuers, leader_address=None):
    """Pod `index` of group `group`, named and given the env as the LWS controller does (leader <lws>-<group>,
    workers <lws>-<group>-<index>; the leader's address through the headless Service named after the LWS)."""
    name, templates = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    leader_name = f"{name}-{group}"
    template = templates.get("leaderTemplate") if index == 0 else None
    spec = (template or templates["workerTemplate"])["spec"]
    injected = {"LWS_LEADER_ADDRESS": leader_address or f"{leader_name}.{name}.{namespace['metadata']['name']}",
                "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}
    return Pod(node, leader_name if index == 0 else f"{leader_name}-{index}", namespace["metadata"]["name"], spec,
               dockerfile_image(), injected_env=injected, issuers=issuers)


def check_rank_guard(node, pod, size):
    """A daemon whose rank from LWS's env is outside its pod certificate's ranks (the env of another worker) exits 2
    and names the certificate's pod and ranks."""
    container = pod.spec["initContainers"][0]
    stray = Pod(node, f"{pod.name}-as-{size}", pod.namespace, {"volumes": pod.spec["volumes"]},
                pod.image, injected_env=dict(pod.injected_env, LWS_GROUP_SIZE=str(size + 1),
                                             LWS_WORKER_INDEX=str(size)), issuers=set(pod.issuers))
    # It holds the real pod's certificates (the stray's own were issued for its own name).
    for volume in pod.spec["volumes"]:
        if "csi" in volume:
            stray.volumes[volume["name"]] = pod.volumes[volume["name"]]
    process = stray.start(container)
    process.expected_exit = True
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        fail(stray.name, "a daemon with a rank outside its pod certificate's started instead of refusing")
        return
    if code != 2 or f"names pod {pod.name} (ranks" not in stray.log(container):
        fail(stray.name, f"exit {code} (expected 2 naming the certificate's pod {pod.name}): {stray.log(container)}")


def check_other_group_refused(node, lws, pods, namespace, issuers):
    """A worker of group 1 (its own certificate from the same Issuer, its own fabric) whose leader address leads to
    group 0's leader: its daemon starts, group 0's coordinator refuses its Join, and group 0's fabric stays whole."""
    crossed = f"{lws['metadata']['name']}-1.crossed"
    other = lws_pod(node, lws, 1, 1, len(pods), namespace, issuers, leader_address=crossed)
    node.dns[crossed] = pods[0]
    container = other.spec["initContainers"][0]
    other.start(container)
    wanted = f"names pod {other.name} of fabric {lws['metadata']['name']}-1"
    deadline = time.monotonic() + 20
    while wanted not in other.log(container):
        if time.monotonic() > deadline:
            fail(other.name, f"group 0's coordinator did not refuse it ('{wanted}'): {other.log(container)}")
            return
        time.sleep(0.2)
    leader_daemon = pods[0].spec["initContainers"][0]
    code, output = pods[0].run(leader_daemon, probe_socket_command(leader_daemon, "fabric"))
    if code != 0 or "degraded: no" not in output:
        fail(pods[0].name, f"group 0's fabric after group 1's worker tried to join: {output}")


def probe_socket_command(container, verb):
    """epctl on the daemon's own socket (the one its probes ask)."""
    probe = container["startupProbe"]["exec"]["command"]
    return ["epctl"] + [a for a in probe[1:] if a.startswith("--socket=")] + [verb]


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
