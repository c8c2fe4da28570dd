"""The Kubernetes profile (accelerate_configs/pytorchjob_elastic.yaml): an elastic PyTorchJob of Kubeflow's training
operator, tested as the SLURM script is: its fields are the ones the operator needs, and its container command,
run on this machine with the environment the operator gives each pod, trains to the end.

What the operator gives a pod is taken from its source, kubeflow/training-operator at branch release-1.9 (commit
078ec30, 2025-02-13; kubeflow.org/v1): pkg/controller.v1/pytorch/envvar.go (setPodEnv), elastic.go
(ElasticEnvVarGenerator), master.go, and the defaults of pkg/apis/kubeflow.org/v1/pytorch_defaults.go and
pytorch_types.go. `operator_environment` below follows that code; torchrun reads each PET_X as the default of its
--x flag (torch/distributed/argparse_util.py), which is why the container command is plain torchrun.
"""

import os
import sys
import time
from pathlib import Path

import yaml

from accel_train.run.layout import read_starts
from support.commands import free_port
from support.locations import PROFILES
from support.nodes import run_nodes
from support.runs import read_metrics

MANIFEST = PROFILES / "pytorchjob_elastic.yaml"
# pytorch_types.go: the container and port the operator looks for, and the port it defaults to.
CONTAINER, PORT_NAME, DEFAULT_PORT = "pytorch", "pytorchjob-port", 23456
TINY = ["data.synthetic=true", "data.train_subset=48", "data.eval_subset=20", "train.batch_size=24", "train.epochs=2",
        "train.log_every_steps=1", "train.plot=false"]


def documents() -> dict[str, dict]:
    return {document["kind"]: document for document in yaml.safe_load_all(MANIFEST.read_text())}


def pytorch_container(job: dict) -> dict:
    (container,) = [container for container in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
                    ["containers"] if container["name"] == CONTAINER]
    return container


def operator_environment(job: dict) -> dict[str, str]:
    """The environment the operator gives each Worker pod of an elastic PyTorchJob without a Master: the container's
    own env, then the operator's (appended after it, so its values win where a name repeats)."""
    spec, container = job["spec"], pytorch_container(job)
    elastic, workers = spec["elasticPolicy"], spec["pytorchReplicaSpecs"]["Worker"]
    env = {variable["name"]: variable["value"] for variable in container.get("env", [])}
    env["PYTHONUNBUFFERED"] = "1"
    # MASTER_ADDR, MASTER_PORT (and their PET_ twins), WORLD_SIZE, RANK and PET_NODE_RANK come only with a Master.
    assert "Master" not in spec["pytorchReplicaSpecs"]
    env["PET_NPROC_PER_NODE"] = spec.get("nprocPerNode", "auto")  # defaulted to auto when elasticPolicy has none
    port = next((port["containerPort"] for port in container.get("ports", []) if port["name"] == PORT_NAME),
                DEFAULT_PORT)
    host = elastic.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    env["PET_RDZV_ENDPOINT"] = f"{host}:{elastic.get('rdzvPort', port)}"
    env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
    low = elastic.get("minReplicas", elastic.get("maxReplicas", workers.get("replicas", 1)))
    high = elastic.get("maxReplicas", low)
    env["PET_NNODES"] = f"{low}:{high}"
    if "maxRestarts" in elastic:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if "nProcPerNode" in elastic:  # deprecated; the webhook refuses it beside spec.nprocPerNode
        env["PET_NPROC_PER_NODE"] = str(elastic["nProcPerNode"])
    if "rdzvId" in elastic:
        env["PET_RDZV_ID"] = elastic["rdzvId"]
    if elastic.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{conf['key']}={conf['value']}" for conf in elastic["rdzvConf"])
    if elastic.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


def test_the_manifest_is_an_elastic_pytorchjob_whose_pods_resume_one_run_on_a_shared_claim():
    claim, job = documents()["PersistentVolumeClaim"], documents()["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1" and set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    elastic, workers = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    assert 1 <= elastic["minReplicas"] < elastic["maxReplicas"], "elastic: fewer pods than the most may train on"
    assert elastic["minReplicas"] <= workers["replicas"] <= elastic["maxReplicas"]
    conf = {entry["key"]: int(entry["value"]) for entry in elastic["rdzvConf"]}
    assert conf["join_timeout"] > conf["last_call_timeout"] > 0
    container = pytorch_container(job)
    assert container["image"], "the webhook refuses a container without an image"
    command = [*container["command"], *container["args"]]
    assert command[:5] == ["torchrun", "-m", "accel_train", "train", "fashion_mnist_cnn"], command
    assert "resume=auto" in command, "every pod restart continues the run instead of refusing its folder"
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    (output_dir,) = [word.split("=", 1)[1] for word in command if word.startswith("output_dir=")]
    (mount,) = [mount for mount in container["volumeMounts"] if Path(output_dir).is_relative_to(mount["mountPath"])]
    (volume,) = [volume for volume in workers["template"]["spec"]["volumes"] if volume["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every pod writes the same output_dir"
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert job["spec"]["nprocPerNode"] == str(gpus), "one process per GPU of the pod"


def test_the_container_command_with_the_operators_environment_trains_both_pods_as_one_run(tmp_path):
    job = documents()["PyTorchJob"]
    container, replicas = pytorch_container(job), job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    env = operator_environment(job)
    assert env["PET_NNODES"] == "1:2" and env["PET_RDZV_BACKEND"] == "c10d" and env["PET_MAX_RESTARTS"] == "3"
    assert env["PET_RDZV_ENDPOINT"] == "accel-train-elastic-worker-0:23456"
    # worker-0's name resolves to its pod in the cluster; here every pod is this machine, so each torchrun offers to
    # hold the rendezvous, and the one that finds the port taken joins it instead (torch's own fallback).
    env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{free_port()}"
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # torchrun, as the image has it
    out = tmp_path / "run"
    command = [f"output_dir={out}" if word.startswith("output_dir=") else word
               for word in [*container["command"], *container["args"]]]
    started = time.monotonic()
    pods = run_nodes([([*command, *TINY], env)] * replicas, timeout=240)
    assert all(pod.returncode == 0 for pod in pods)
    assert (out / "model.safetensors").is_file() and read_metrics(out, "test")[-1]["num_samples"] == 20
    assert [line["step"] for line in read_metrics(out, "train")] == [1, 2, 3, 4]
    assert [(start["world_size"], start["launcher_restart"]) for start in read_starts(out)] == [(2, 0)]
    print(f"\n{replicas} pods of {MANIFEST.name}, the operator's environment: one run of world size 2 in "
          f"{time.monotonic() - started:.1f} s")
