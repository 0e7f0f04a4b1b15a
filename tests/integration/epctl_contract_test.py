"""epctl's operations contract against a real daemon (issue 37).

  epctl_contract_test.py EPFABRICD EPCTL SOURCE_DIR

- every command's --json answer matches its schema (docs/epctl-json/COMMAND.schema.json, which must equal
  `epctl schema --command=COMMAND`), its keys come in the schema's order, and the same answer prints the same bytes;
- delete-group --json prints a result; leases --json has no lease_id;
- $EPFABRIC_SOCKET is the default socket (a template is refused); epctl --version;
- health --wait_ms waits for a daemon that starts later;
- health over the peer port without a credential fails (the Ops call is refused) instead of printing SERVING;
- create-group over --address says to use --socket; UNAVAILABLE over --address names TLS;
- the daemon's messages give file modes in octal; a single daemon needs no peer credential.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

COMMANDS = ["health", "topology", "fabric", "create-group", "delete-group", "groups", "leases", "stats"]
failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
        print("FAIL:", message, flush=True)


def validate(value, schema, root, path="$"):
    """The subset of JSON Schema that epctl's schemas use: $ref, type, enum, pattern, properties, required,
    additionalProperties, items. Returns a list of problems."""
    if "$ref" in schema:
        name = schema["$ref"].split("/")[-1]
        return validate(value, root["$defs"][name], root, path)
    problems = []
    types = schema.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float),
                 "integer": int}
        ok = any(isinstance(value, kinds[t]) and not (t in ("number", "integer") and isinstance(value, bool))
                 for t in types)
        if not ok:
            return [f"{path}: {type(value).__name__} is not {types}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: {value!r} not in {schema['enum']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        problems.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{path}: no key {key}")
        for key, item in value.items():
            if key in properties:
                problems += validate(item, properties[key], root, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                problems.append(f"{path}: unexpected key {key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                problems += validate(item, schema["additionalProperties"], root, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += validate(item, schema["items"], root, f"{path}[{i}]")
    return problems


def key_order_problems(text, schema):
    """Keys of every object in the order of its schema's properties."""
    problems = []

    def hook(pairs):
        keys = [k for k, _ in pairs]
        for definition in schema["$defs"].values():
            order = list(definition.get("properties", {}))
            if order and set(keys) == set(order) and keys != order:
                problems.append(f"keys {keys} not in .proto order {order}")
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return problems


def run(argv, env=None, timeout=30):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def main():
    epfabricd, epctl, source = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    work = pathlib.Path(tempfile.mkdtemp(prefix="epf-epctl-"))
    daemons = []
    try:
        # Schemas: the binary's and the committed files agree.
        schemas = {}
        for command in COMMANDS:
            printed = run([epctl, "schema", f"--command={command}"])
            check(printed.returncode == 0, f"epctl schema --command={command}: {printed.stderr}")
            committed = source / "docs" / "epctl-json" / f"{command}.schema.json"
            check(committed.exists() and committed.read_text() == printed.stdout,
                  f"{committed} differs from `epctl schema --command={command}` (regenerate: docs/epctl-json.md)")
            schemas[command] = json.loads(printed.stdout)
        bad = run([epctl, "schema", "--command=nope"])
        check(bad.returncode == 2 and "is not one of health" in bad.stderr, f"schema of an unknown command: {bad}")

        version = run([epctl, "--version"])
        check(version.returncode == 0 and re.fullmatch(r"epctl \S+\n", version.stdout), f"--version: {version}")

        # A single daemon: no peer port credential to give.
        sock = str(work / "gpu0.sock")
        daemons.append(subprocess.Popen([epfabricd, f"--client_socket={sock}", "--backend=host",
                                         "--log_level=warn", "--metrics_listen=127.0.0.1:0"]))
        waited = run([epctl, f"--socket={sock}", "--wait_ms=15000", "health"])
        check(waited.returncode == 0 and "SERVING" in waited.stdout, f"health --wait_ms: {waited}")

        answers = {}
        for command, extra in [("health", []), ("topology", []), ("fabric", []),
                               ("create-group", ["--group=contract", "--ranks=0", "--nvl_bytes=1048576"]),
                               ("groups", []), ("leases", []), ("stats", [])]:
            first = run([epctl, f"--socket={sock}", "--json", command] + extra)
            check(first.returncode == 0, f"{command} --json: {first.stderr}")
            answers[command] = first.stdout
        token = json.loads(answers["create-group"])["token"]
        deleted = run([epctl, f"--socket={sock}", "--json", "delete-group", "--group=contract", f"--token={token}"])
        check(deleted.returncode == 0, f"delete-group --json: {deleted.stderr}")
        answers["delete-group"] = deleted.stdout
        check(json.loads(deleted.stdout or "{}") == {"group": "contract", "deleted": True, "forced": False},
              f"delete-group --json printed {deleted.stdout!r}")
        for command, text in answers.items():
            problems = validate(json.loads(text), schemas[command], schemas[command])
            problems += key_order_problems(text, schemas[command])
            check(not problems, f"{command} --json does not match its schema: {problems[:5]}\n{text[:2000]}")
        check("lease_id" not in answers["leases"], "leases --json shows a lease_id key")
        # Deterministic: the same answer prints the same bytes.
        for command in ("groups", "topology"):
            first = run([epctl, f"--socket={sock}", "--json", command]).stdout
            again = run([epctl, f"--socket={sock}", "--json", command]).stdout
            check(first == again, f"{command} --json printed different bytes for the same answer")

        # $EPFABRIC_SOCKET as the default socket; a template names no one socket.
        env = dict(os.environ, EPFABRIC_SOCKET=sock)
        default = run([epctl, "health"], env=env)
        check(default.returncode == 0 and "SERVING" in default.stdout, f"EPFABRIC_SOCKET default: {default}")
        env["EPFABRIC_SOCKET"] = str(work / "gpu{local_rank}.sock")
        template = run([epctl, "health"], env=env)
        check(template.returncode == 2 and "is a template for several ranks" in template.stderr,
              f"EPFABRIC_SOCKET template: {template}")
        env.pop("EPFABRIC_SOCKET")
        neither = run([epctl, "health"], env=env)
        check(neither.returncode == 2 and "EPFABRIC_SOCKET" in neither.stderr, f"no socket at all: {neither}")

        # Over the peer port: no credential, so Ops.GetHealth is refused and the check fails.
        peer = json.loads(answers["topology"])["daemon"]["peer_address"]
        remote = run([epctl, f"--address={peer}", "health"])
        check(remote.returncode == 1 and "UNAUTHENTICATED" in remote.stderr and "SERVING" not in remote.stdout,
              f"health over the peer port without a credential: {remote}")
        control = run([epctl, f"--address={peer}", "create-group", "--group=g", "--ranks=0", "--nvl_bytes=4096"])
        check(control.returncode == 2 and "use --socket=PATH" in control.stderr,
              f"create-group over --address: {control}")
        closed = run([epctl, "--address=127.0.0.1:1", "--timeout_ms=1000", "topology"])
        check(closed.returncode == 1 and "requires TLS: give --tls_ca" in closed.stderr, f"UNAVAILABLE hint: {closed}")

        # --wait_ms waits for a daemon that starts later.
        later = str(work / "later.sock")
        waiting = subprocess.Popen([epctl, f"--socket={later}", "--wait_ms=20000", "health"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        time.sleep(1)
        daemons.append(subprocess.Popen([epfabricd, f"--client_socket={later}", "--backend=host", "--log_level=warn"]))
        out, err = waiting.communicate(timeout=30)
        check(waiting.returncode == 0 and "SERVING" in out, f"health --wait_ms before the daemon started: {out}{err}")

        # File modes in octal.
        secret = work / "secret"
        secret.write_text("0123456789abcdef0123456789abcdef\n")
        secret.chmod(0o644)
        mode = run([epfabricd, f"--client_socket={work / 'x.sock'}", f"--fabric_secret_file={secret}"])
        check(mode.returncode == 2 and "has mode 0644;" in mode.stderr, f"secret mode message: {mode.stderr}")
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    print("epctl_contract_test:", "OK" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
