"""Kubernetes templates (`python -m ddp_kit.launch k8s`): golden files, pod templates checked offline against the
Kubernetes client's models, and each engine's restart mapping for exit 75.

The engine contracts asserted here come from their sources: kubeflow/trainer (TrainingRuntime and TrainJob in
pkg/apis/trainer/v1alpha1, the torch plugin in pkg/runtime/framework/plugins/torch/torch.go), kubeflow/training-operator
release-1.9 (pkg/apis/kubeflow.org/v1/common_types.go RestartPolicyExitCode, pkg/util/train/train_util.go
IsRetryableExitCode: only 128-255 retry), kubernetes-sigs/jobset (api/jobset/v1alpha2 FailurePolicy), volcano-sh/volcano
(staging/src/volcano.sh/apis/pkg/apis/batch/v1alpha1/job.go LifecyclePolicy, the pytorch plugin's flags).
No API server can run here, so the CRDs' own fields are asserted by hand; the pod templates inside them go through the
client's models, which is what the API server would check them against.

Regenerate the golden files with UPDATE_GOLDEN=1 after a deliberate change, and read the diff.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath

import pytest
import yaml

from conftest import run_cmd
from ddp_kit.errors import UserError
from ddp_kit.launch import k8s as launch_k8s

client = pytest.importorskip("kubernetes.client")  # the `test` extra installs it

GOLDEN = Path(__file__).parents[1] / "golden"
TEMPLATES = Path(launch_k8s.__file__).parent / "templates" / "k8s"
BASE = {"image": "ghcr.io/example/ddp_kit:0.1", "pvc": "ckpt", "run_dir": "/mnt/ckpt/mnist", "grace_period_s": 120,
        "name": "mnist", "namespace": "ml", "launch_id": "mnist-0123456789ab"}  # fixed: golden files
TRAIN = ("configs/mnist_mlp.yaml", "--epochs", "3", "--lr", "3e-4")
CASES = {
    "k8s_trainjob.yaml": dict(engine="trainjob", nodes=2, gpus_per_node=4),
    "k8s_pytorchjob_process.yaml": dict(engine="pytorchjob", layout="process", nodes=3, gpus_per_node=1),
    "k8s_pytorchjob_torchrun.yaml": dict(engine="pytorchjob", layout="torchrun", nodes=2, gpus_per_node=8),
    "k8s_volcano_torchrun.yaml": dict(engine="volcano", layout="torchrun", nodes=2, nproc_per_node=2),
    "k8s_volcano_process.yaml": dict(engine="volcano", layout="process", nodes=4, gpus_per_node=1, port=23456),
}


def rendered(capsys, **flags) -> str:
    launch_k8s.k8s(*TRAIN, **{**BASE, **flags, "dry_run": True})
    return capsys.readouterr().out


def docs(text: str) -> dict:
    return {d["kind"]: d for d in yaml.safe_load_all(text)}


# ---- a strict offline check against the Kubernetes client's models ----------------------------------------------
PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str, "date": str}


def model_errors(data, type_name: str, path: str = "$") -> list[str]:
    """Every field of `data` not in the model `type_name`, or of the wrong type, and the required fields it lacks.

    The client's own deserializer ignores unknown fields; this walk does not, and then lets the deserializer check
    the required ones (client-side validation raises ValueError on a missing one)."""
    errors: list[str] = []
    _walk(data, type_name, path, errors)
    if not errors:
        try:
            client.ApiClient()._ApiClient__deserialize(data, type_name)
        except (ValueError, TypeError) as err:
            errors.append(f"{path}: {err}")
    return errors


def _walk(data, t: str, path: str, errors: list[str]) -> None:
    if t.startswith("Optional["):
        t = t[len("Optional["):-1]
    if t.lower().startswith("list["):
        if not isinstance(data, list):
            errors.append(f"{path}: expected a list for {t}, got {type(data).__name__}")
            return
        for i, item in enumerate(data):
            _walk(item, t[5:-1], f"{path}[{i}]", errors)
    elif t.lower().startswith(("dict(", "dict[")):
        if not isinstance(data, dict):
            errors.append(f"{path}: expected a mapping for {t}, got {type(data).__name__}")
            return
        for key, value in data.items():
            _walk(value, t[t.index(",") + 1:-1].strip(), f"{path}.{key}", errors)
    elif t == "object":  # IntOrString and the like: any scalar
        return
    elif t in PRIMITIVES:
        ok = isinstance(data, PRIMITIVES[t]) and not (t in ("int", "float") and isinstance(data, bool))
        if not ok:
            errors.append(f"{path}: expected {t}, got {type(data).__name__} {data!r}")
    else:
        klass = getattr(client, t)
        if not isinstance(data, dict):
            errors.append(f"{path}: expected a {t} mapping, got {type(data).__name__}")
            return
        fields = {json_name: attr for attr, json_name in klass.attribute_map.items()}
        for key, value in data.items():
            if key not in fields:
                errors.append(f"{path}.{key}: not a field of {t}")
            else:
                _walk(value, klass.openapi_types[fields[key]], f"{path}.{key}", errors)


def pod_templates(kind_docs: dict) -> list[tuple[str, dict]]:
    """(where, pod template) for every pod template the manifest holds."""
    out = []
    if "TrainingRuntime" in kind_docs:
        job = kind_docs["TrainingRuntime"]["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]
        out.append(("TrainingRuntime node", job["spec"]["template"]))
    if "PyTorchJob" in kind_docs:
        for role, spec in kind_docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"].items():
            out.append((f"PyTorchJob {role}", spec["template"]))
    if "Job" in kind_docs:
        for task in kind_docs["Job"]["spec"]["tasks"]:
            out.append((f"Volcano task {task['name']}", task["template"]))
    return out


def containers(kind_docs: dict) -> list[dict]:
    return [c for _, t in pod_templates(kind_docs) for c in t["spec"]["containers"]]


# ---- golden files -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("golden", sorted(CASES))
def test_renders_golden_file(golden, capsys):
    text = rendered(capsys, **CASES[golden])
    path = GOLDEN / golden
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{golden} changed: rerun with UPDATE_GOLDEN=1 and read the diff"


@pytest.mark.parametrize("golden", sorted(CASES))
def test_pod_templates_pass_the_kubernetes_models(golden, capsys):
    kind_docs = docs(rendered(capsys, **CASES[golden]))
    templates = pod_templates(kind_docs)
    assert templates
    for where, template in templates:
        assert model_errors(template, "V1PodTemplateSpec") == [], where
    if "TrainingRuntime" in kind_docs:  # the Job around the pod, podFailurePolicy included
        job = kind_docs["TrainingRuntime"]["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]
        assert model_errors(job["spec"], "V1JobSpec") == []
        trainer = kind_docs["TrainJob"]["spec"]["trainer"]
        assert model_errors(trainer["resourcesPerNode"], "V1ResourceRequirements") == []


def test_the_model_check_can_fail(capsys):
    template = pod_templates(docs(rendered(capsys, engine="pytorchjob", layout="process")))[0][1]
    c = template["spec"]["containers"][0]
    broken = [
        ({**c, "volumeMount": c["volumeMounts"]}, "not a field of V1Container"),  # a typo'd field name
        ({**c, "env": {"DDP_KIT_GRACE_PERIOD_S": "120"}}, "expected a list"),  # a mapping where a list goes
        ({k: v for k, v in c.items() if k != "name"}, "name"),  # a required field missing
    ]
    for container, why in broken:
        spec = {**template["spec"], "containers": [container]}
        errors = model_errors({"spec": spec}, "V1PodTemplateSpec")
        assert errors and why in " ".join(errors), (why, errors)
    bad_grace = {"spec": {**template["spec"], "terminationGracePeriodSeconds": "120"}}
    assert "expected int" in " ".join(model_errors(bad_grace, "V1PodTemplateSpec"))


# ---- what every pod must hold -----------------------------------------------------------------------------------
@pytest.mark.parametrize("golden", sorted(CASES))
def test_grace_period_env_pvc_and_gpus(golden, capsys):
    flags = CASES[golden]
    kind_docs = docs(rendered(capsys, **flags))
    for where, template in pod_templates(kind_docs):
        spec = template["spec"]
        assert spec["terminationGracePeriodSeconds"] == 120, where
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
        assert list(claims.values()) == ["ckpt"], where
        for c in spec["containers"]:
            env = {e["name"]: e["value"] for e in c["env"]}
            assert env["DDP_KIT_GRACE_PERIOD_S"] == "120", where
            mounts = [m["mountPath"] for m in c["volumeMounts"] if m["name"] in claims]
            assert any(PurePosixPath(BASE["run_dir"]).is_relative_to(m) for m in mounts), (where, mounts)
            gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            if "TrainJob" not in kind_docs:
                assert gpus == (str(flags["gpus_per_node"]) if flags.get("gpus_per_node") else None), where
    if "TrainJob" in kind_docs:  # Trainer v2 takes the GPUs per node from the TrainJob, not the runtime
        assert kind_docs["TrainJob"]["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "4"


def test_the_training_command_gets_run_dir_and_the_train_args(capsys):
    for flags in CASES.values():
        kind_docs = docs(rendered(capsys, **flags))
        args = (kind_docs["TrainJob"]["spec"]["trainer"]["args"] if "TrainJob" in kind_docs
                else containers(kind_docs)[0]["args"])
        i = args.index("ddp_kit.train")
        assert args[i + 1:] == [*TRAIN, "--run_dir", BASE["run_dir"]]


# ---- the restart mapping ------------------------------------------------------------------------------------------
def test_trainjob_ignores_75_and_disruptions_and_caps_failures(capsys):
    kind_docs = docs(rendered(capsys, engine="trainjob", nodes=2, gpus_per_node=4, max_restarts=5))
    runtime, trainjob = kind_docs["TrainingRuntime"], kind_docs["TrainJob"]
    assert trainjob["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"], "apiGroup": "trainer.kubeflow.org",
                                              "kind": "TrainingRuntime"}
    jobset = runtime["spec"]["template"]["spec"]
    node = jobset["replicatedJobs"][0]
    # The torch plugin finds the trainer by this label and the container named node (torch.go, constants.go).
    assert node["name"] == "node"
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert [c["name"] for c in node["template"]["spec"]["template"]["spec"]["containers"]] == ["node"]
    job = node["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs Never
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onExitCodes": {"containerName": "node", "operator": "In", "values": [75]}}
    assert rules[1]["action"] == "Ignore" and rules[1]["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert rules[2]["action"] == "FailJob" and rules[2]["onExitCodes"]["values"] == [2]
    assert not any(1 in r.get("onExitCodes", {}).get("values", []) for r in rules)  # exit 1 falls to backoffLimit 0
    policy = jobset["failurePolicy"]
    assert policy["maxRestarts"] == 5
    assert policy["rules"] == [{"name": "UserErrorFailsJobSet", "action": "FailJobSet",
                                "onJobFailureReasons": ["PodFailurePolicy"]}]
    trainer = trainjob["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 4 and trainer["command"][-2:] == ["75", "0"]
    assert not any(e["name"].startswith("PET_") for e in trainer.get("env", []))  # reserved by the plugin


@pytest.mark.parametrize("layout,nproc", [("process", "1"), ("torchrun", "8")])
def test_pytorchjob_maps_75_to_a_retryable_code(layout, nproc, capsys):
    job = docs(rendered(capsys, engine="pytorchjob", layout=layout, nodes=3,
                        gpus_per_node=1 if layout == "process" else 8, max_restarts=2, max_preemptions=7))["PyTorchJob"]
    assert job["spec"]["nprocPerNode"] == nproc and job["spec"]["runPolicy"]["backoffLimit"] == 9
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Master": 1, "Worker": 2}
    for spec in specs.values():
        assert spec["restartPolicy"] == "ExitCode"
        (c,) = spec["template"]["spec"]["containers"]
        assert c["name"] == "pytorch"  # the operator reads this container's exit code and port
        assert {"name": "pytorchjob-port", "containerPort": 29500} in c["ports"]
        preempted, offset = int(c["command"][-2]), int(c["command"][-1])
        assert preempted >= 128 + 64 and preempted <= 255  # retryable under ExitCode, and no signal's 128 + n
        assert 128 + 64 < offset + 1 and offset + 3 <= 255  # the retryable failures 1 and 3 too
        assert (c["args"][:3] == ["python", "-m", "torch.distributed.run"]) == (layout == "torchrun")


@pytest.mark.parametrize("layout", ["process", "torchrun"])
def test_volcano_gang_and_policies(layout, capsys):
    job = docs(rendered(capsys, engine="volcano", layout=layout, nodes=4, max_restarts=1, max_preemptions=4,
                        nproc_per_node=1 if layout == "process" else 2))["Job"]
    spec = job["spec"]
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1"
    assert spec["minAvailable"] == 4 == sum(t["replicas"] for t in spec["tasks"])
    assert spec["schedulerName"] == "volcano" and spec["maxRetry"] == 5
    assert [t["name"] for t in spec["tasks"]] == ["master", "worker"]
    assert "--master=master" in spec["plugins"]["pytorch"] and "--port=29500" in spec["plugins"]["pytorch"]
    assert "svc" in spec["plugins"]
    policies = spec["policies"]
    # Policies are tried in order and an event policy matches before a later exit code one: 75 comes first.
    assert policies[0] == {"exitCode": 75, "action": "RestartJob"}
    assert {"exitCode": 2, "action": "TerminateJob"} in policies
    assert {"event": "PodFailed", "action": "RestartJob"} == policies[-1]
    for task in spec["tasks"]:
        c = task["template"]["spec"]["containers"][0]
        assert task["template"]["spec"]["restartPolicy"] == "Never" and c["command"][-2:] == ["75", "0"]
        if layout == "torchrun":
            assert "--nnodes=$(WORLD_SIZE)" in c["args"] and "--nproc_per_node=2" in c["args"]


def test_master_address_is_never_hard_coded(capsys):
    for flags in CASES.values():
        text = rendered(capsys, **flags)
        for c in containers(docs(text)):
            assert not {"MASTER_ADDR", "RANK", "WORLD_SIZE"} & {e["name"] for e in c["env"]}


# ---- bad flags: one line ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,start", [
    (dict(engine="mpijob"), "unknown engine 'mpijob'"),
    (dict(engine="trainjob", layout="process"), "a TrainJob always runs torchrun"),
    (dict(engine="pytorchjob", layout="process", gpus_per_node=4), "--layout process runs one rank per pod"),
    (dict(engine="volcano", nproc_per_node=2, gpus_per_node=4), "--nproc_per_node 2 differs from --gpus_per_node 4"),
    (dict(engine="volcano", run_dir="runs/x"), "--run_dir 'runs/x' must be an absolute path"),
    (dict(engine="volcano", mount_path="/data"), "--mount_path '/data' must be a folder above --run_dir"),
    (dict(engine="volcano", name="My_Job"), "--name 'My_Job' is not an RFC 1035 label"),
    (dict(engine="trainjob", name="a" * 60, nodes=2), f"--name '{'a' * 60}' is too long"),
    (dict(engine="trainjob", port=23456), "--port 23456: a TrainJob's torch plugin always uses port 29500"),
    (dict(engine="volcano", grace_period_s=0), "--grace_period_s 0 is not a whole number >= 1"),
    (dict(engine="volcano", image=None), "--image is required"),
    (dict(engine="volcano", shm_size="16G"), "--shm_size '16G' is not a size like 16Gi"),
])
def test_bad_flags_are_one_line(flags, start):
    with pytest.raises(UserError) as err:
        launch_k8s.k8s(*TRAIN, **{**BASE, **flags, "dry_run": True})
    line = err.value.line()
    assert line.startswith(f"ddp_kit: error: {start}") and "(hint: " in line and "\n" not in line


def test_a_second_run_dir_in_the_train_args_is_refused():
    with pytest.raises(UserError, match="the training arguments set --run_dir /mnt/ckpt/other"):
        launch_k8s.k8s("--run_dir", "/mnt/ckpt/other", **{**BASE, "engine": "volcano", "dry_run": True})
    launch_k8s.k8s("--run_dir", BASE["run_dir"], **{**BASE, "engine": "volcano", "dry_run": True})  # the same: fine


def test_without_kubectl_the_file_is_written_and_the_command_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl on this machine's PATH by construction
    launch_k8s.k8s(*TRAIN, **{**BASE, "engine": "volcano", "out_dir": str(tmp_path / "out")})
    out = capsys.readouterr().out.strip()
    path = tmp_path / "out" / "mnist.volcano.yaml"
    assert out.splitlines() == [f"ddp_kit: wrote {path}; kubectl is not on PATH, so apply it where it is: "
                                f"kubectl apply -f {path}"]
    assert docs(path.read_text())["Job"]["metadata"]["name"] == "mnist"


# ---- the entrypoint scripts, for real ---------------------------------------------------------------------------
WORKER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.3), sys.exit(75)))  # as ddp_kit: checkpoint, then 75
print("ready", flush=True)
time.sleep(60)
sys.exit(1)
"""


def _pod(command: list[str], mark: Path, env_extra: dict | None = None) -> subprocess.Popen:
    script = (TEMPLATES / "pod.sh").read_text()
    env = {**os.environ, "DDP_KIT_PREEMPT_MARK": str(mark), **(env_extra or {})}
    return subprocess.Popen(["sh", "-c", script, "ddp_kit-pod", "203", "192", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _term_when_ready(p: subprocess.Popen, ready: int, timeout: float = 60) -> tuple[str, str]:
    lines, deadline = 0, time.monotonic() + timeout
    while lines < ready and time.monotonic() < deadline:
        # Two ranks print on one pipe: their "ready" and newline writes can interleave ("readyready").
        lines += p.stdout.readline().count("ready")
    p.send_signal(signal.SIGTERM)  # what the kubelet sends to PID 1 on eviction
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    return out, err


@pytest.mark.integration
@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_pod_entrypoint_forwards_sigterm_and_maps_75(shell, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    script = (TEMPLATES / "pod.sh").read_text()
    p = subprocess.Popen([shell, "-c", script, "ddp_kit-pod", "203", "192", sys.executable, str(worker)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "DDP_KIT_PREEMPT_MARK": str(tmp_path / "mark")})
    _, err = _term_when_ready(p, ready=1)
    assert p.returncode == 203, err
    assert "exited 75 (preempted); exiting 203" in err
    # PyTorchJob's ExitCode policy retries only >= 128: the retryable failures 1 and 3 go up by 192 (193, 195);
    # everything else passes through unchanged (2 is "do not retry"). Other engines (offset 0): all unchanged.
    for offset, code, want in ((192, 0, 0), (192, 1, 193), (192, 3, 195), (192, 2, 2), (192, 137, 137),
                               (0, 1, 1), (0, 3, 3), (0, 2, 2)):
        res = subprocess.run([shell, "-c", script, "ddp_kit-pod", "203", str(offset), "sh", "-c", f"exit {code}"],
                             env={**os.environ, "DDP_KIT_PREEMPT_MARK": str(tmp_path / "mark")}, timeout=30)
        assert res.returncode == want, (offset, code)


@pytest.mark.integration
def test_torchrun_layout_keeps_75_visible_through_torchrun(tmp_path):
    """torchrun exits 1 when its workers exit 75; rank.sh's mark lets pod.sh still report the preemption."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    rank = (TEMPLATES / "rank.sh").read_text()
    p = _pod([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
              "sh", "-c", rank, "ddp_kit-rank", sys.executable, str(worker)], tmp_path / "mark",
             {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"})
    _, err = _term_when_ready(p, ready=2)
    assert p.returncode == 203, err[-3000:]
    assert (tmp_path / "mark").exists()


@pytest.mark.integration
def test_cli_bad_flag_is_one_line_and_exit_2():
    res = run_cmd([sys.executable, "-m", "ddp_kit.launch", "k8s", "--engine", "trainjob", "--layout", "process",
                   "--image", "x", "--pvc", "ckpt", "--run_dir", "/mnt/ckpt/r", "--dry_run"])
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "ddp_kit: error: a TrainJob always runs torchrun in each pod (the runtime's torch plugin) "
        "(hint: drop --layout process, or use --engine pytorchjob or volcano for one process per pod)"]


def test_no_plain_scalar_reads_as_a_number_elsewhere(capsys):
    """kubectl's YAML reader takes a plain 3e-4 for a float (PyYAML does not), and the API refuses a number in args:
    every string that looks like a number is quoted."""
    number = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
    text = rendered(capsys, engine="volcano", layout="torchrun", nproc_per_node=2)
    assert "--lr" in text
    for root in yaml.compose_all(text):
        stack = [root]
        while stack:
            node = stack.pop()
            if isinstance(node, yaml.ScalarNode):
                if node.tag == "tag:yaml.org,2002:str" and node.style is None:
                    assert not number.fullmatch(node.value), node.value
            elif isinstance(node, yaml.SequenceNode):
                stack += node.value
            elif isinstance(node, yaml.MappingNode):
                stack += [v for _, v in node.value]


def test_each_rendering_is_a_new_launch(capsys):
    """Without --launch_id every rendering (a submission) gets its own DDP_KIT_LAUNCH_ID, so a fixed job
    submitted again under the same name is not refused as a restart of the failed one."""
    flags = {k: v for k, v in BASE.items() if k != "launch_id"}
    ids = []
    for _ in range(2):
        launch_k8s.k8s(*TRAIN, **{**flags, "engine": "pytorchjob", "dry_run": True})
        text = capsys.readouterr().out
        ids += [e["value"] for d in yaml.safe_load_all(text) for e in _envs(d) if e["name"] == "DDP_KIT_LAUNCH_ID"]
    assert len(ids) >= 2 and len(set(ids)) == 2 and all(i.startswith("mnist-") for i in ids), ids


def _envs(node):
    if isinstance(node, dict):
        if "env" in node and isinstance(node["env"], list):
            yield from node["env"]
        for v in node.values():
            yield from _envs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _envs(v)
