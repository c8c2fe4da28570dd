"""The Kubernetes profiles: elastic PyTorchJobs of Kubeflow's training operator, tested as the SLURM script is: their
fields are the ones the operator needs, and their container command, run on this machine with the environment the
operator gives each pod, trains to the end. accelerate_configs/pytorchjob_elastic.yaml keeps the run folder on a
ReadWriteMany claim every pod mounts; accelerate_configs/pytorchjob_store.yaml keeps it in object storage (s3://),
with credentials from a Secret and nothing shared but the store.

What the operator gives a pod is taken from its source, kubeflow/training-operator at branch release-1.9 (commit
078ec30, 2025-02-13; kubeflow.org/v1): pkg/controller.v1/pytorch/envvar.go (setPodEnv), elastic.go
(ElasticEnvVarGenerator), master.go, and the defaults of pkg/apis/kubeflow.org/v1/pytorch_defaults.go and
pytorch_types.go. `operator_environment` below follows that code; torchrun reads each PET_X as the default of its
--x flag (torch/distributed/argparse_util.py), which is why the container command is plain torchrun.
"""

import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement

from accel_train.run.layout import read_starts
from support.commands import free_port
from support.locations import PROFILES
from support.nodes import run_nodes
from support.runs import read_metrics

ELASTIC, STORE = PROFILES / "pytorchjob_elastic.yaml", PROFILES / "pytorchjob_store.yaml"
MANIFESTS = [pytest.param(ELASTIC, id=ELASTIC.stem), pytest.param(STORE, id=STORE.stem)]
# pytorch_types.go: the container and port the operator looks for, and the port it defaults to.
CONTAINER, PORT_NAME, DEFAULT_PORT = "pytorch", "pytorchjob-port", 23456
TINY = ["data.synthetic=true", "data.train_subset=48", "data.eval_subset=20", "train.batch_size=24", "train.epochs=2",
        "train.log_every_steps=1", "train.plot=false"]


def documents(manifest: Path) -> dict[str, dict]:
    return {document["kind"]: document for document in yaml.safe_load_all(manifest.read_text())}


def pod_spec(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def pytorch_container(job: dict) -> dict:
    (container,) = [container for container in pod_spec(job)["containers"] if container["name"] == CONTAINER]
    return container


def container_command(job: dict) -> list[str]:
    container = pytorch_container(job)
    return [*container["command"], *container["args"]]


def output_dir_of(command: list[str]) -> str:
    (output_dir,) = [word.split("=", 1)[1] for word in command if word.startswith("output_dir=")]
    return output_dir


def keys_anywhere(node) -> set[str]:
    """Every mapping key in a parsed YAML document, at any depth."""
    if isinstance(node, dict):
        return set(node).union(*(keys_anywhere(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(keys_anywhere(value) for value in node))
    return set()


def operator_environment(job: dict, secret: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the operator gives each Worker pod of an elastic PyTorchJob without a Master: the variables
    of the Secrets the container's envFrom names (`secret`), then the container's own env (which wins over envFrom),
    then the operator's (appended after it, so its values win where a name repeats)."""
    spec, container = job["spec"], pytorch_container(job)
    elastic, workers = spec["elasticPolicy"], spec["pytorchReplicaSpecs"]["Worker"]
    env = dict(secret or {})
    env.update({variable["name"]: variable["value"] for variable in container.get("env", [])})
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


def node_local_folders(job: dict) -> dict[str, dict]:
    """mountPath: volume, for each volume mounted in the container that lives on the pod's node (an emptyDir)."""
    volumes = {volume["name"]: volume for volume in pod_spec(job).get("volumes", [])}
    return {mount["mountPath"]: volumes[mount["name"]] for mount in pytorch_container(job).get("volumeMounts", [])
            if "emptyDir" in volumes[mount["name"]]}


def run_pods(job: dict, output_dir: str, tmp_path: Path, secret: dict[str, str] | None = None) -> list:
    """The container command of every Worker replica, started at once on this machine with the operator's
    environment, `output_dir` in place of the manifest's and the tiny run appended; each pod's node-local folders
    (emptyDirs, /dev/shm aside) are folders of its own under `tmp_path`."""
    env = operator_environment(job, secret)
    assert env["PET_NNODES"] == "1:2" and env["PET_RDZV_BACKEND"] == "c10d" and env["PET_MAX_RESTARTS"] == "3"
    assert env["PET_RDZV_ENDPOINT"] == f"{job['metadata']['name']}-worker-0:23456"
    # worker-0's name resolves to its pod in the cluster; here every pod is this machine, so each torchrun offers to
    # hold the rendezvous, and the one that finds the port taken joins it instead (torch's own fallback).
    env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{free_port()}"
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # torchrun, as the image has it
    command = [f"output_dir={output_dir}" if word.startswith("output_dir=") else word
               for word in container_command(job)]
    pods = []
    for pod in range(job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]):
        on_node = {path: tmp_path / f"pod-{pod}{path}" for path in node_local_folders(job) if path != "/dev/shm"}
        for folder in on_node.values():
            folder.mkdir(parents=True)
        pod_env = {name: next((str(on_node[path]) + value[len(path):] for path in on_node
                               if value == path or value.startswith(f"{path}/")), value) for name, value in env.items()}
        pods.append(([*command, *TINY], pod_env))
    return run_nodes(pods, timeout=240)


def assert_one_run_of_both_pods(out: Path) -> None:
    assert (out / "model.safetensors").is_file() and read_metrics(out, "test")[-1]["num_samples"] == 20
    assert [line["step"] for line in read_metrics(out, "train")] == [1, 2, 3, 4]
    assert [(start["world_size"], start["launcher_restart"]) for start in read_starts(out)] == [(2, 0)]


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_each_kubernetes_profile_is_an_elastic_pytorchjob_whose_pods_resume_one_run_with_plain_torchrun(manifest):
    job = documents(manifest)["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1" and set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    elastic, workers = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    assert 1 <= elastic["minReplicas"] < elastic["maxReplicas"], "elastic: fewer pods than the most may train on"
    assert elastic["minReplicas"] <= workers["replicas"] <= elastic["maxReplicas"]
    assert workers["restartPolicy"] == "OnFailure", "pods whose torchrun exits (worker-0 lost) start again"
    conf = {entry["key"]: int(entry["value"]) for entry in elastic["rdzvConf"]}
    assert conf["join_timeout"] > conf["last_call_timeout"] > 0
    container = pytorch_container(job)
    assert container["image"], "the webhook refuses a container without an image"
    assert {"name": PORT_NAME, "containerPort": DEFAULT_PORT} in container["ports"], "worker-0's rendezvous port"
    command = container_command(job)
    assert command[:5] == ["torchrun", "-m", "accel_train", "train", "fashion_mnist_cnn"], command
    assert not any(word.startswith("--") for word in command), "torchrun's flags come from the operator's PET_*"
    assert "resume=auto" in command, "every pod restart continues the run instead of refusing its folder"
    assert output_dir_of(command)
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    assert node_local_folders(job)["/dev/shm"]["emptyDir"]["medium"] == "Memory", "DataLoader workers' batches"
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert job["spec"]["nprocPerNode"] == str(gpus), "one process per GPU of the pod"


def test_the_elastic_profile_keeps_the_run_folder_on_a_readwritemany_claim_every_pod_mounts():
    claim, job = documents(ELASTIC)["PersistentVolumeClaim"], documents(ELASTIC)["PyTorchJob"]
    output_dir = output_dir_of(container_command(job))
    (mount,) = [mount for mount in pytorch_container(job)["volumeMounts"]
                if Path(output_dir).is_relative_to(mount["mountPath"])]
    (volume,) = [volume for volume in pod_spec(job)["volumes"] if volume["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every pod writes the same output_dir"


def test_the_store_profile_writes_the_run_folder_to_an_s3_url_from_an_image_with_the_s3_extra():
    output_dir = output_dir_of(container_command(documents(STORE)["PyTorchJob"]))
    url = urlsplit(output_dir)
    assert url.scheme == "s3" and url.netloc and url.path.strip("/"), f"output_dir={output_dir}: s3://BUCKET/PATH"
    assert 'pip install "accel-train[s3]"' in STORE.read_text(), "the header names the extra the image needs"
    s3_extra = [Requirement(line) for line in metadata.requires("accel-train") if 'extra == "s3"' in line]
    assert "s3fs" in {requirement.name for requirement in s3_extra}, "the extra the header names brings s3fs"


def test_the_store_profile_needs_no_shared_volume_and_keeps_only_scratch_that_may_vanish_with_the_pod():
    manifest = documents(STORE)
    assert set(manifest) == {"PyTorchJob"}, "no PersistentVolumeClaim (or anything else) to create beside the job"
    assert "persistentVolumeClaim" not in keys_anywhere(manifest["PyTorchJob"]), "no volume of the job is a claim"
    job = manifest["PyTorchJob"]
    assert all(set(volume) == {"name", "emptyDir"} for volume in pod_spec(job)["volumes"]), \
        "every volume is on the pod's node and goes with the pod: the run is in the store only"
    node_local = node_local_folders(job)
    paths = {name: value for name, value in operator_environment(job).items() if value.startswith("/")}
    assert paths, "scratch (the shard block cache, temporary files) is pointed at the node-local volume"
    for name, path in paths.items():
        assert any(Path(path).is_relative_to(mount) for mount in node_local), f"{name}={path}: not on a mounted volume"


def test_the_store_profile_takes_its_credentials_from_a_secret_and_spells_none_of_them():
    job = documents(STORE)["PyTorchJob"]
    container = pytorch_container(job)
    secrets = [source["secretRef"]["name"] for source in container.get("envFrom", []) if "secretRef" in source]
    assert len(secrets) == 1, f"{secrets}: the store's endpoint and credentials come from one Secret, by envFrom"
    (secret,) = secrets
    assert f"kubectl create secret generic {secret} " in STORE.read_text(), "the header makes the Secret it names"
    spelled = [variable["name"] for variable in container.get("env", [])
               if variable["name"].startswith("AWS_") and "value" in variable]
    assert spelled == [], f"{spelled}: credentials and the endpoint come from the Secret, not the manifest"
    assert not [word for word in container_command(job) if "AWS_" in word or "secret" in word.lower()]


def test_the_container_command_with_the_operators_environment_trains_both_pods_as_one_run(tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    run_pods(documents(ELASTIC)["PyTorchJob"], str(out), tmp_path)
    assert_one_run_of_both_pods(out)
    print(f"\n2 pods of {ELASTIC.name}, the operator's environment: one run of world size 2 in "
          f"{time.monotonic() - started:.1f} s")


def test_the_store_profiles_command_with_the_operators_environment_trains_both_pods_as_one_run_in_the_bucket(
        object_store, tmp_path):
    job = documents(STORE)["PyTorchJob"]
    url = urlsplit(output_dir_of(container_command(job)))
    run = url._replace(netloc=object_store.bucket).geturl()  # the manifest's run path, in the test's bucket
    # The Secret's variables as envFrom gives them: the test store's endpoint and credentials.
    started = time.monotonic()
    run_pods(job, run, tmp_path, secret=object_store.env)
    for pod in tmp_path.glob("pod-*"):  # the pods are gone, and their node-local folders with them
        shutil.rmtree(pod)
    out = tmp_path / "run"
    object_store.fs().get(run, str(out), recursive=True)
    assert_one_run_of_both_pods(out)
    print(f"\n2 pods of {STORE.name}, the operator's environment: one run of world size 2 in {run} in "
          f"{time.monotonic() - started:.1f} s")
