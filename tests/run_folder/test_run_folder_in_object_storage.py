"""Contracts of a run folder in object storage (output_dir=s3://...), on moto's S3 server behind the fault proxy
(support.object_store): a run that stops and resumes on another machine (another staging folder) ends as one that
never stopped; a checkpoint counts only once its manifest is written after every object; retention touches nothing
but committed checkpoints of the run; the end of a run waits for its uploads; eval, predict, runs and plot read the
run at its URL; and a store that fails is said in one line.

"Another machine" is another ACCEL_TRAIN_STAGING: each process stages the run on its machine's disk, and nothing of
one machine's staging is left for, or read by, the next start.
"""

import json
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from accel_train.run.layout import read_starts
from support.commands import PYTHON, last_json_line, launch, run_cli, start, start_launch, wait_for
from support.locations import PROBE, REPO
from support.runs import assert_same_run, read_metrics

STEPS_PER_EPOCH = 10
RUN = ["train", "mnist_cnn", "data.synthetic=true", "data.augment=true", "data.train_subset=240",
       "data.eval_subset=50", "train.batch_size=24", "train.epochs=2", "train.log_every_steps=3", "train.plot=false",
       "train.ema_decay=0.9", "train.eval_every_steps=7", "checkpoint.every_steps=4", "data.store_patience_s=5"]
WEIGHTS = ("model.safetensors", "model_ema.safetensors")
# Mid-epoch 0, mid train line (lines every 3 steps), between two checkpoints (every 4); the processes agree on the
# signal at once at an evaluation (train.eval_every_steps)
STOP_STEP = 7


def machine(root: Path, name: str) -> dict:
    """The environment of a process on machine `name`: its own staging folder."""
    return {"ACCEL_TRAIN_STAGING": str(root / name)}


def staged(staging: Path, name: str = "metrics.jsonl") -> list[Path]:
    """A run's file as a machine stages it (every run folder URL, every process)."""
    return sorted(staging.glob(f"*/process-*/{name}"))


def download(store, url: str, to: Path) -> Path:
    """The run folder at `url`, copied whole into `to` (to compare it with a local run)."""
    store.fs().get(url.rstrip("/") + "/", str(to), recursive=True)
    return to


def objects(store, url: str) -> dict[str, int]:
    prefix = url.split("://", 1)[1].rstrip("/") + "/"
    return {path[len(prefix):]: entry["size"] for path, entry in store.fs().find(prefix, detail=True).items()}


def checkpoint_names(store, url: str, committed: bool = True) -> list[str]:
    names = {name.split("/")[1] for name in objects(store, url) if name.startswith("checkpoints/")}
    manifests = {name.split("/")[1] for name in objects(store, url)
                 if re.fullmatch(r"checkpoints/[^/]+/checkpoint.json", name)}
    return sorted(manifests if committed else names - manifests)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run at 2 processes, in a local folder."""
    out = tmp_path_factory.mktemp("reference") / "run"
    launch(2, *RUN, f"output_dir={out}")
    return out


def test_a_run_in_a_bucket_stopped_by_sigterm_mid_epoch_resumes_on_another_machine_as_if_never_stopped_reading_its_checkpoint_once(  # noqa: E501
        reference, object_store, tmp_path):
    url = object_store.url("runs/stopped")
    log = tmp_path / "stopped.log"
    job = start_launch(2, *RUN, f"output_dir={url}", "resume=auto", log=log, script=PROBE,
                       env={**machine(tmp_path, "a"), "PROBE_WAIT_FOR_SIGNAL": f"stopped:{STOP_STEP}"})
    wait_for(lambda: any(line.strip() and json.loads(line)["step"] == 6 for path in staged(tmp_path / "a")
                         for line in path.read_text().splitlines()), job, log)
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=120)
    stopped = log.read_text()
    assert (f"stopped by SIGTERM at step {STOP_STEP}; checkpoint saved in {url}/checkpoints/step-0000000{STOP_STEP}"
            in stopped), stopped[-3000:]
    assert re.search(rf"checkpoint step {STOP_STEP} saved in {url}/checkpoints/step-0000000{STOP_STEP}: blocked "
                     r"\d+\.\d\d s, uploaded in \d+\.\d\d s \(\d+\.\d MiB\)", stopped), stopped[-3000:]
    assert not list((tmp_path / "a").rglob("*.json")), "the stopped machine's staging is left behind"

    checkpoint = f"{url}/checkpoints/step-0000000{STOP_STEP}"
    files = json.loads(object_store.fs().cat_file(f"{checkpoint}/checkpoint.json"))["files"]
    object_store.proxy.reset_counts()
    resumed = launch(2, *RUN, f"output_dir={url}", "resume=auto", env=machine(tmp_path, "b"))
    assert f"resuming from {checkpoint}: step {STOP_STEP}, epoch 0" in resumed.stdout
    # its 2 processes on one machine: each object downloaded once, by one of them, for both
    read = object_store.proxy.bytes_read_by_object(checkpoint)
    assert {name: read.get(f"{checkpoint[5:]}/{name}") for name in files} == files, read
    run = download(object_store, url, tmp_path / "downloaded")
    assert_same_run(run, reference, WEIGHTS)  # metrics.jsonl line for line, the weights bit for bit
    assert [start["step"] for start in read_starts(run)] == [0, STOP_STEP]
    assert not list((tmp_path / "b").rglob("*.json")), "the finished run's staging is left behind"


@pytest.mark.parametrize("where", ["bucket", "local folder"])
def test_sigterm_stops_a_run_of_2_processes_at_the_step_after_the_one_it_came_in_saving_it(where, object_store,
                                                                                            tmp_path):
    # Process 0 signals itself during step 5, between evaluations (every 7 steps) and saves (every 4): the processes
    # agree at step 6, whatever the run folder (a bucket's saves are slower, which must not delay the stop). Its save
    # of step 6 ends 3 s after process 1's: process 1 exits 75 first, torch's launcher sends process 0 SIGTERM, and
    # process 0 still ends its save and says so.
    out = object_store.url("runs/signalled") if where == "bucket" else str(tmp_path / "run")
    result = launch(2, *RUN, f"output_dir={out}", script=PROBE, check=False,
                    env={**machine(tmp_path, "a"), "PROBE_SIGTERM_AT": "5", "PROBE_SLOW_SAVED": "6:0:3"})
    text = result.stdout + result.stderr
    assert "SIGTERM received by process 0" in text and "exitcode: 75" in text, text[-3000:]  # each worker's exit
    assert f"stopped by SIGTERM at step 6; checkpoint saved in {out}/checkpoints/step-00000006" in text, text[-3000:]
    if where == "bucket":
        assert checkpoint_names(object_store, out) == ["step-00000004", "step-00000006"]
        assert not list((tmp_path / "a").rglob("*.json")), "the stopped run's staging is left behind"
    else:
        assert sorted(path.name for path in (Path(out) / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]


@pytest.fixture
def finished_run(object_store, tmp_path):
    """A short run trained into the bucket from one process: its URL."""
    url = object_store.url("runs/done")
    run_cli(*RUN[:1], "mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=40",
            "train.batch_size=24", "train.epochs=1", "train.plot=false", f"output_dir={url}",
            env=machine(tmp_path, "trainer"))
    return url


def test_eval_predict_runs_plot_and_train_run_take_a_run_folder_url_and_eval_a_checkpoints_or_weights_files_url(
        finished_run, object_store, tmp_path):
    final = read_metrics(download(object_store, finished_run, tmp_path / "copy"), "test")[-1]
    evaluated = last_json_line(run_cli("eval", finished_run, env=machine(tmp_path, "reader")).stdout)
    assert evaluated["accuracy"] == final["accuracy"] and evaluated["num_samples"] == final["num_samples"] == 40
    checkpoint = f"{finished_run}/checkpoints/step-00000004"  # the last step's: the final weights
    assert last_json_line(run_cli("eval", checkpoint, env=machine(tmp_path, "reader")).stdout) == evaluated
    weights = f"{finished_run}/model.safetensors"  # a weights file's URL, as a local path to one is taken
    assert last_json_line(run_cli("eval", weights, env=machine(tmp_path, "reader")).stdout) == evaluated
    missing = run_cli("eval", f"{finished_run}/model_best.safetensors", check=False, env=machine(tmp_path, "reader"))
    assert missing.returncode == 3 and missing.stderr.strip().splitlines() == [
        f"accel-train: error: eval {finished_run}/model_best.safetensors: no such weights file in the store; pass a "
        "run's output_dir, one of its checkpoints (RUN/checkpoints/step-N) or a .safetensors file there"], \
        missing.stderr[-3000:]
    images = tmp_path / "images"
    images.mkdir()
    for index in range(3):
        Image.new("L", (28, 28), color=index * 80).save(images / f"{index}.png")
    predicted = run_cli("predict", finished_run, f"input={images}", f"output={tmp_path / 'predictions.csv'}",
                        env=machine(tmp_path, "reader"))
    assert len((tmp_path / "predictions.csv").read_text().splitlines()) == 4, predicted.stdout
    into_the_store = object_store.url("predicted/predictions.csv")  # output= a URL: the same CSV, as an object there
    run_cli("predict", finished_run, f"input={images}", f"output={into_the_store}", env=machine(tmp_path, "reader"))
    with object_store.fs().open(into_the_store, "rb") as stored:
        assert stored.read() == (tmp_path / "predictions.csv").read_bytes()
    listed = run_cli("runs", object_store.url("runs"), env=machine(tmp_path, "reader")).stdout
    assert "done" in listed and f"{final['accuracy']:.4f}" in listed, listed
    run_cli("plot", finished_run, f"output={tmp_path / 'curves.png'}", env=machine(tmp_path, "reader"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    beside = run_cli("plot", finished_run, env=machine(tmp_path, "reader")).stdout  # no output=: beside the run
    assert beside.strip() == f"{finished_run}/curves.png" and not (REPO / "curves.png").exists()
    with object_store.fs().open(f"{finished_run}/curves.png", "rb") as drawn:
        assert len(drawn.read()) > 10_000
    again = object_store.url("runs/again")
    run_cli("train", finished_run, f"output_dir={again}", env=machine(tmp_path, "trainer2"))
    assert read_metrics(download(object_store, again, tmp_path / "again"), "test")[-1]["num_samples"] == 40


def test_a_finished_or_refused_run_in_a_bucket_leaves_no_staging_and_a_refusal_names_the_url(finished_run,
                                                                                                 tmp_path):
    assert not list((tmp_path / "trainer").rglob("*")), "the finished run's staging is left behind"
    refused = run_cli("train", "mnist_cnn", "data.synthetic=true", "model.name=resnet18", f"output_dir={finished_run}",
                      "resume=auto", check=False, env=machine(tmp_path, "refused"))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        f"accel-train: error: resume: {finished_run}/checkpoints/step-00000004 is from another run: model.name="), \
        refused.stderr[-3000:]
    assert not (tmp_path / "refused").exists() or not list((tmp_path / "refused").rglob("*")), \
        sorted(str(path) for path in (tmp_path / "refused").rglob("*"))


def test_model_init_from_takes_a_run_a_checkpoint_or_a_weights_file_at_a_url(finished_run, object_store, tmp_path,
                                                                              monkeypatch, capsys):
    """...and eval of a URL holding no run says so naming that URL, not this machine's copy of it."""
    from accel_train import cli
    from accel_train.errors import DataNotFoundError
    from accel_train.run.weights import weights_file

    monkeypatch.setenv("ACCEL_TRAIN_STAGING", str(tmp_path / "reader"))
    for arguments, named in ((["eval", f"{finished_run}-typo"], f"eval {finished_run}-typo"),
                             (["eval", f"checkpoint={finished_run}/checkpoints/step-00000099"],
                              f"eval checkpoint={finished_run}/checkpoints/step-00000099")):
        with pytest.raises(SystemExit) as stopped:
            cli.main(arguments)
        lines = capsys.readouterr().err.splitlines()
        assert stopped.value.code == 3 and len(lines) == 1 and str(tmp_path) not in lines[0], lines
        assert lines[0].startswith(f"accel-train: error: {named}: no run there"), lines
    checkpoint = f"{finished_run}/checkpoints/step-00000004"
    for source, stored in ((finished_run, "model.safetensors"), (f"{checkpoint}/", f"{checkpoint}/model.safetensors"),
                           (f"{finished_run}/model.safetensors", "model.safetensors")):
        with object_store.fs().open(stored if "://" in stored else f"{finished_run}/{stored}", "rb") as weights:
            assert weights_file(source, "model.init_from").read_bytes() == weights.read(), source
    missing = f"{finished_run}/checkpoints/step-00000099"
    with pytest.raises(DataNotFoundError, match=f"model.init_from={missing}: no model.safetensors there"):
        weights_file(missing, "model.init_from")
    trained = run_cli("train", "mnist_cnn", "data.synthetic=true", "data.train_subset=48", "data.eval_subset=40",
                      "train.batch_size=24", "train.max_steps=1", "train.plot=false", f"model.init_from={checkpoint}",
                      f"output_dir={tmp_path / 'from_the_store'}", env=machine(tmp_path, "trainer3"))
    assert read_metrics(tmp_path / "from_the_store", "test")[-1]["num_samples"] == 40, trained.stdout


@pytest.mark.floors  # s3fs, accelerate and torch at their floors: the upload, the manifest, the fetch
def test_kill_9_during_an_upload_leaves_a_partial_checkpoint_the_next_start_ignores_saying_so(object_store, tmp_path):
    url = object_store.url("runs/killed")
    args = [*RUN[:1], "mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=40",
            "train.batch_size=24", "train.epochs=2", "train.plot=false", "checkpoint.every_steps=2",
            "train.log_every_steps=1", f"output_dir={url}", "resume=auto"]
    object_store.proxy.inject("hold", match=lambda method, path: method == "PUT" and
                              "checkpoints/step-00000004/model.safetensors" in path)
    log = tmp_path / "killed.log"
    job = start([PYTHON, "-m", "accel_train", *args], log, env=machine(tmp_path, "a"))
    # Training goes on while the upload is held (it blocks at the next save, step 6): killed once step 5 is trained
    wait_for(lambda: object_store.proxy.holding.is_set() and any(
        json.loads(line)["step"] >= 5 for path in staged(tmp_path / "a") for line in path.read_text().splitlines()
        if line.endswith("}")), job, log)
    job.kill()
    job.wait(timeout=30)
    object_store.proxy.release()
    assert checkpoint_names(object_store, url) == ["step-00000002"]
    assert checkpoint_names(object_store, url, committed=False) == ["step-00000004"]
    resumed = run_cli(*args, env=machine(tmp_path, "b"))
    assert f"ignoring {url}/checkpoints/step-00000004: a save that did not complete" in resumed.stderr
    assert f"resuming from {url}/checkpoints/step-00000002: step 2" in resumed.stdout
    reference = run_cli(*args[:-2], f"output_dir={tmp_path / 'reference'}")
    assert reference.returncode == 0
    assert_same_run(download(object_store, url, tmp_path / "resumed"), tmp_path / "reference")
    # the partial upload of the killed start is not this start's to delete; the resumed run saved step 4 anew
    assert "step-00000004" in checkpoint_names(object_store, url, committed=False) or \
        "step-00000004-1" in checkpoint_names(object_store, url)


def test_retention_keeps_the_checkpoint_a_start_resumed_from_until_a_newer_one_is_committed_and_nothing_else_is_touched(
        object_store, tmp_path):
    url = object_store.url("runs/kept")
    args = [*RUN[:1], "mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=40",
            "train.batch_size=24", "train.epochs=2", "train.plot=false", "checkpoint.every_steps=2",
            "checkpoint.keep_last=1", f"output_dir={url}", "resume=auto"]
    fs = object_store.fs()
    bystanders = {f"{object_store.bucket}/runs/kept-other/checkpoints/step-00000002/checkpoint.json": b"{}",
                  f"{object_store.bucket}/runs/kept/checkpoints-old/note.txt": b"mine",
                  f"{object_store.bucket}/runs/kept/checkpoints/step-99999999/model.safetensors": b"another upload"}
    for path, data in bystanders.items():
        fs.pipe(path, data)
    first = tmp_path / "first.log"
    object_store.proxy.inject("hold", match=lambda method, path: method == "PUT" and
                              "checkpoints/step-00000006/model.safetensors" in path)
    job = start([PYTHON, "-m", "accel_train", *args], first, env=machine(tmp_path, "a"))
    wait_for(object_store.proxy.holding.is_set, job, first)
    job.kill()
    job.wait(timeout=30)
    object_store.proxy.release()
    assert checkpoint_names(object_store, url) == ["step-00000004"]  # keep_last=1: step 2 went once 4 was committed

    object_store.proxy.inject("hold", match=lambda method, path: method == "PUT" and
                              "checkpoints/step-00000006-1/model.safetensors" in path)
    log = tmp_path / "resumed.log"
    job = start([PYTHON, "-m", "accel_train", *args], log, env=machine(tmp_path, "b"))
    wait_for(object_store.proxy.holding.is_set, job, log)
    assert checkpoint_names(object_store, url) == ["step-00000004"], "the resumed-from checkpoint went first"
    object_store.proxy.release()
    job.wait(timeout=120)
    assert job.returncode == 0, log.read_text()[-3000:]
    assert checkpoint_names(object_store, url) == ["step-00000008"]
    assert all(fs.cat(path) == data for path, data in bystanders.items())
    assert "step-00000006" in checkpoint_names(object_store, url, committed=False), "another start's upload went"


def test_the_end_of_a_run_waits_for_its_last_upload(object_store, tmp_path):
    url = object_store.url("runs/end")
    held = "checkpoints/step-00000004/optimizer.bin"
    object_store.proxy.inject("hold", match=lambda method, path: method == "PUT" and held in path)
    ended = threading.Event()

    def release_2_s_after_the_hold():  # the run's end has to wait that long for its last upload
        while not (object_store.proxy.holding.is_set() or ended.is_set()):
            time.sleep(0.02)
        time.sleep(2)
        object_store.proxy.release()

    releaser = threading.Thread(target=release_2_s_after_the_hold)
    releaser.start()
    result = run_cli(*RUN[:1], "mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=40",
                     "train.batch_size=24", "train.epochs=1", "train.plot=false", f"output_dir={url}",
                     env=machine(tmp_path, "a"))
    ended.set()
    releaser.join()
    assert object_store.proxy.holding.is_set(), "the last upload was never held: the run ended before it"
    assert checkpoint_names(object_store, url) == ["step-00000004"], result.stdout[-2000:]
    assert "model.safetensors" in objects(object_store, url)
    assert re.search(r"checkpoints: 1 saved; training blocked \d+\.\d\d s by them, uploaded in \d+\.\d\d s in all",
                     result.stdout), result.stdout[-2000:]


def test_a_store_down_at_a_save_is_one_warning_and_training_goes_on_unless_uploads_are_required(object_store,
                                                                                                  tmp_path):
    url = object_store.url("runs/down")
    args = [*RUN[:1], "mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=40",
            "train.batch_size=24", "train.epochs=2", "train.plot=false", "checkpoint.every_steps=2",
            "data.store_patience_s=1"]
    failing = lambda method, path: method == "PUT" and "checkpoints/step-00000002/" in path  # noqa: E731
    object_store.proxy.inject("503", times=1000, match=failing)
    result = run_cli(*args, f"output_dir={url}", env=machine(tmp_path, "a"))
    warnings = [line for line in result.stderr.splitlines() if "did not reach the store" in line]
    assert len(warnings) == 1 and "the checkpoint of step 2" in warnings[0], result.stderr[-3000:]
    assert checkpoint_names(object_store, url)[-1] == "step-00000008"
    object_store.proxy.clear_faults()

    object_store.proxy.inject("503", times=1000, match=failing)
    required = run_cli(*args, f"output_dir={object_store.url('runs/required')}", "checkpoint.require_upload=true",
                       env=machine(tmp_path, "b"), check=False)
    assert required.returncode == 3, required.stderr[-3000:]
    assert required.stderr.splitlines()[-1].startswith(
        f"accel-train: error: cannot write {object_store.url('runs/required')}/checkpoints/step-00000002/"), \
        required.stderr[-3000:]


def test_the_run_folder_retries_the_store_for_its_own_patience_key_else_the_datas(object_store, tmp_path,
                                                                                  monkeypatch):
    from accel_train import api
    from accel_train.config import load_config

    class Opened(Exception):
        """Raised with the place api.train opens, once it is opened: nothing is trained."""

    open_place = api.RunPlace.open

    def opened(*args, **kwargs):
        raise Opened(open_place(*args, **kwargs))

    monkeypatch.setenv("ACCEL_TRAIN_STAGING", str(tmp_path))
    monkeypatch.setattr(api.RunPlace, "open", opened)
    for given, patience in ((["checkpoint.store_patience_s=2", "data.store_patience_s=60"], 2),
                            (["data.store_patience_s=7"], 7)):
        config = load_config("mnist_cnn", [f"output_dir={object_store.url('runs/patient')}", *given])
        with pytest.raises(Opened) as place:
            api.train(config)
        assert place.value.args[0].mirror.store.patience_s == patience, given


@pytest.mark.parametrize("problem", ["unknown bucket", "no credentials"])
def test_an_unreachable_run_folder_is_one_line_and_exit_2_before_any_training(problem, object_store, tmp_path,
                                                                              monkeypatch):
    url = "s3://no-such-bucket/runs/a" if problem == "unknown bucket" else object_store.url("runs/a")
    if problem == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = run_cli("train", "mnist_cnn", "data.synthetic=true", f"output_dir={url}", check=False,
                     env=machine(tmp_path, "a"))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("accel-train: error:") and ("bucket" in lines[0] or "credentials" in lines[0])
    assert "training" not in result.stdout
