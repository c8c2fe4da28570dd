"""The world-size and resume contracts on a model and data from the Hugging Face Hub by name: an hf: model (a tiny ViT,
save_pretrained's folder) on an hf: dataset (one-colour images, a parquet repository), launched through the
multi_gpu profile (a gloo group on the CPU) at 1, 2 and 3 processes: the same weights within the N x B tolerance and
the same evaluation over exactly its samples; and a checkpoint saved by 2 processes in the middle of an epoch
continues at 3 like the uninterrupted run. Augmentation is keyed on this data too:
data/test_data_paths_and_keyed_augmentation.py (hf_dataset_augmented)."""

import pytest
from safetensors.torch import load_file

from support.commands import launch
from support.hub import COLOURS, as_parquet_repository, colour_dataset, tiny_vit
from support.runs import read_metrics

# 24 training images, global batch 12: 2 steps an epoch; 7 evaluation images split evenly across neither 2 nor 3
RUN = ["train", "imagefolder", "data.augment=false", "data.num_workers=1", "train.batch_size=12",
       "train.eval_batch_size=4", "train.epochs=2", "train.schedule=constant", "train.warmup_steps=0", "train.lr=0.01",
       "train.log_every_steps=1", "model.pretrained=true", "train.plot=false"]


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_contracts")
    model = tiny_vit(root / "vit", list(COLOURS), dropout=0.1)  # its nn.Dropout layers: keyed by sample
    data = as_parquet_repository(colour_dataset({"train": (tuple(COLOURS), 8), "validation": (("blue", "red"), 4)}),
                                 root / "parquet")
    args = [*RUN, f"model.name=hf:{model}", f"data.name=hf:{data}", "data.eval_subset=7"]
    runs = {}
    for processes in (1, 2, 3):
        runs[processes] = root / f"run{processes}"
        launch(processes, *args, "train.max_steps=4", f"output_dir={runs[processes]}", timeout=300)
    stopped = root / "stopped"  # 2 processes to step 3, mid-epoch 1; then 3 processes on to step 4
    launch(2, *args, "train.max_steps=3", "checkpoint.every_steps=3", f"output_dir={stopped}", timeout=300)
    (stopped / "model.safetensors").unlink()
    launch(3, *args, "train.max_steps=4", "checkpoint.every_steps=3", f"output_dir={stopped}", "resume=auto",
           timeout=300)
    runs["2 then 3"] = stopped
    return runs


def assert_weights_agree(a, b, tolerance: float = 1e-5) -> None:
    """Within the N x B contract's relative tolerance; for a tensor that stays near zero (attention's key bias, whose
    gradient is zero but for rounding: softmax ignores a shift), within 1e-7 of it."""
    one, other = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert one.keys() == other.keys()
    for name, reference in one.items():
        difference = (other[name] - reference).norm()
        assert difference <= tolerance * reference.norm() + 1e-7, \
            f"{name}: {difference:.2e} apart, {reference.norm():.2e} in norm"


@pytest.mark.parametrize("processes", [2, 3])
def test_an_hf_model_on_an_hf_dataset_trains_alike_and_evaluates_exactly_at_any_world_size(hub_run, processes):
    assert_weights_agree(hub_run[1], hub_run[processes])
    one, many = (read_metrics(hub_run[n], "test")[-1] for n in (1, processes))
    assert one["num_samples"] == many["num_samples"] == 7
    assert many["accuracy"] == one["accuracy"] and many["loss"] == pytest.approx(one["loss"], rel=1e-5)
    losses = [[line["loss"] for line in read_metrics(hub_run[n], "train")] for n in (1, processes)]
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_a_checkpoint_of_2_processes_mid_epoch_continues_at_3_like_the_uninterrupted_run(hub_run):
    assert_weights_agree(hub_run[2], hub_run["2 then 3"])
    lines = read_metrics(hub_run["2 then 3"], "train")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    uninterrupted = [line["loss"] for line in read_metrics(hub_run[2], "train")]
    assert [line["loss"] for line in lines] == pytest.approx(uninterrupted, rel=1e-5)
    assert (hub_run["2 then 3"] / "model.safetensors").is_file()  # the resumed run's own export


@pytest.fixture(scope="module")
def hub_args(hub_run):
    """The arguments of hub_run's runs (its model and data folders beside them)."""
    root = hub_run[1].parent
    return [*RUN, f"model.name=hf:{root / 'vit'}", f"data.name=hf:{root / 'parquet'}", "data.eval_subset=7",
            "train.max_steps=4"]


def test_an_hf_model_under_the_fsdp_profile_trains_like_one_plain_process(hub_run, hub_args, tmp_path):
    """Accelerate's FSDP2 prepare over a gloo group (tests/launched_probe.py's PROBE_FSDP_ON_CPU, as the FSDP
    contract's tests take it on a CPU), the profile's full state dicts: the export is the plain model's."""
    from support.locations import PROBE

    launch(2, *hub_args, f"output_dir={tmp_path / 'fsdp'}", profile="fsdp.yaml", script=PROBE,
           launcher_args=("--mixed_precision", "no"), env={"PROBE_FSDP_ON_CPU": "1"}, timeout=300)
    assert_weights_agree(hub_run[1], tmp_path / "fsdp")


def test_an_hf_model_with_an_automatic_micro_batch_and_compiled_trains_like_the_plain_run(hub_run, hub_args, tmp_path):
    """train.micro_batch_size=auto (the largest that fits, accumulated to the same global batch) and train.compile:
    the same training, the same names in the exported weights."""
    from support.commands import train_in_process

    arguments = [argument for argument in hub_args[2:] if not argument.startswith("data.num_workers")]
    train_in_process("imagefolder", *arguments, "data.num_workers=0", "train.micro_batch_size=auto",
                     "train.compile=true", f"output_dir={tmp_path / 'auto'}")
    assert_weights_agree(hub_run[1], tmp_path / "auto", tolerance=1e-4)  # compiled kernels round otherwise
