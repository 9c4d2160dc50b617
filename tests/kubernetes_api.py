"""A Kubernetes cluster on localhost, as far as jax's cluster detection sees one.

jax detects an indexed Job (or a JobSet's) only through the Kubernetes API, from inside a pod:
``KUBERNETES_SERVICE_HOST``/``PORT``, the service account's token, CA and namespace at
``/var/run/secrets/kubernetes.io/serviceaccount/``, the pod found by its IP, its Job (for the
process count), ``JOB_COMPLETION_INDEX`` (the process id), and the coordinator's name
``<job>-0.<subdomain>`` resolved by DNS (``HOSTNAME`` is the pod's host name).
:func:`api_server` answers the two API requests jax makes, over TLS; :func:`pod_command` runs a
command in a private mount namespace (as root, or as root of a user namespace of its own) where
the service account's files and ``/etc/hosts`` are those a kubelet would mount into the Job's
pod. Every process of the Job is a pod at 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

NAMESPACE = "training"
SERVICE_ACCOUNT = "secrets/kubernetes.io/serviceaccount"


# a mount namespace of its own: as root, else as root of a user namespace of its own
UNSHARE = (
    ["unshare", "--mount", "--propagation", "private"],
    ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"],
)


@functools.cache
def private_mounts() -> list[str] | None:
    """The first of :data:`UNSHARE` that works here, or ``None`` (tried once a process)."""
    for command in UNSHARE:
        if subprocess.run([*command, "true"], capture_output=True).returncode == 0:
            return command
    return None


def unavailable() -> str | None:
    """Why this machine cannot stand in for a pod here, or ``None`` when it can."""
    for tool in ("openssl", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no {tool} on this machine"
    if private_mounts() is None:
        return "no private mount namespace here (unshare --mount, also in a user namespace)"
    return None


def job_objects(job: str, parallelism: int, jobset: str | None) -> tuple[dict, dict]:
    """The pod and the Job the API returns: an indexed Job whose pods run under a headless
    service's subdomain; a JobSet's Job carries the JobSet's label, from which jax takes the
    subdomain (its pods have none here, so only jax's JobSet path finds the coordinator)."""
    spec = {"containers": [{"name": "train", "image": "train"}]}
    if jobset is None:
        spec["subdomain"] = "jaxpods"
    labels = {"job-name": job}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-0-x7k2p",
            "namespace": NAMESPACE,
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job,
                    "uid": "1",
                    "controller": True,
                }
            ],
        },
        "spec": spec,
        "status": {"podIP": "127.0.0.1"},
    }
    job_labels = {} if jobset is None else {"jobset.sigs.k8s.io/jobset-name": jobset}
    template = {"spec": {"containers": [{"name": "train", "image": "train"}]}}
    indexed = {"parallelism": parallelism, "completions": parallelism, "template": template}
    job_object = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job, "namespace": NAMESPACE, "labels": job_labels},
        "spec": {**indexed, "completionMode": "Indexed"},
    }
    return pod, job_object


@contextlib.contextmanager
def api_server(folder: Path, job: str, parallelism: int, jobset: str | None = None) -> Iterator:
    """Serve the API of a cluster running ``job`` over HTTPS on 127.0.0.1, with a certificate
    written to ``folder/ca.crt``. Yields ``(port, requests)``: the paths requested, in order."""
    key, cert = folder / "api.key", folder / "ca.crt"
    names = ["-subj", "/CN=kubernetes", "-addext", "subjectAltName=IP:127.0.0.1"]
    files = ["-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *names, *files],
        check=True,
        capture_output=True,
    )
    pod, job_object = job_objects(job, parallelism, jobset)
    answers = {
        f"/api/v1/namespaces/{NAMESPACE}/pods": {"kind": "PodList", "items": [pod]},
        f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/{job}": job_object,
    }
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            answer = answers.get(self.path.split("?")[0])
            body = json.dumps(answer or {"kind": "Status", "code": 404}).encode()
            self.send_response(200 if answer else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], requests
    finally:
        server.shutdown()
        server.server_close()


def pod_command(folder: Path, coordinator: str, command: list[str]) -> list[str]:
    """``command`` run as in a pod: the service account's token, CA (``folder/ca.crt``) and
    namespace mounted where the kubelet mounts them, and ``/etc/hosts`` naming this pod (the
    machine's host name) and the coordinator's, both at 127.0.0.1, in a mount namespace of its
    own."""
    run = folder / "run"
    account = run / SERVICE_ACCOUNT
    account.mkdir(parents=True, exist_ok=True)
    (account / "token").write_text("token-of-the-job-service-account")
    (account / "namespace").write_text(NAMESPACE)
    shutil.copy(folder / "ca.crt", account / "ca.crt")
    hosts = folder / "hosts"
    hosts.write_text(
        f"127.0.0.1 localhost\n127.0.0.1 {socket.gethostname()}\n127.0.0.1 {coordinator}\n"
    )
    mounts = (
        f"mount --bind {shlex.quote(str(run))} {shlex.quote(os.path.realpath('/var/run'))}"
        f" && mount --bind {shlex.quote(str(hosts))} /etc/hosts"
    )
    inner = f"{mounts} && exec {shlex.join(command)}"
    return [*(private_mounts() or UNSHARE[0]), "sh", "-c", inner]
