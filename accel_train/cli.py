"""accel-train command line. Heavy imports (torch, accelerate) happen only inside the commands."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from accel_train.config.trust import TRUST_FLAG
from accel_train.errors import PeerLost, Preempted, UserError, did_you_mean

USAGE = """\
accel-train train RECIPE [KEY=VALUE ...]                 train; RECIPE is a shipped name, a YAML file or a run's
                                                         output_dir (its config.yaml)
accel-train eval RUN [KEY=VALUE ...]                     evaluate a run's exported model with the run's own config
accel-train eval RECIPE checkpoint=PATH [KEY=VALUE ...]  evaluate a run folder, checkpoint or model.safetensors
accel-train predict RUN input=PATH [output=FILE|URL] [predict.top_k=K ...]
                                                         top labels of image files (file, folder or glob) as CSV
accel-train export RUN output=DIR [format=onnx]          the run's model as its own library (transformers, timm)
                                                         loads it, or as ONNX; with a model card
accel-train shard RECIPE [KEY=VALUE ...] output=URL      the recipe's data as shards at a folder or URL (s3://,
                                                         gs://, ...); train from them with data.name=shards
accel-train shard index URL                              index tars of your own (webdataset's) at URL/train, /test
accel-train sweep RECIPE --trials N --metric M [--launch CMD] KEY=DIST(ARGS) ... [KEY=VALUE ...]
                                                         hyperparameter search (Optuna): every trial a run folder
accel-train runs DIR [--diff A B] [--json]               table of the runs under DIR (or of a sweep's trials); config
                                                         keys A and B differ in
accel-train plot RUN [RUN ...] [output=FILE]             loss, eval metrics and LR of runs, overlaid, as a PNG
accel-train recipes                                      list shipped recipes
accel-train keys [RECIPE]                                every config key with its meaning and value (a recipe's)
accel-train photos OUT [--train N] [--test N]            a folder of JPEG photographs made here (ImageNet-shaped)
accel-train profiles                                     list shipped launch profiles (accelerate configs)
accel-train profile NAME                                 the installed file of a profile, for --config_file
accel-train doctor [--config_file F] [--machine_rank R ...]  check this node before a launch (also under a launcher)
accel-train launch [--join_timeout S] ACCELERATE_LAUNCH_ARGS... -m accel_train train RECIPE ...
                                                         accelerate launch, once every machine has joined (says
                                                         who it waits for; gives up after S s, default 300)
accel-train bench [--quick] [RECIPE] [KEY=VALUE ...]     our loop vs plain PyTorch, input pipeline, scaling, FLOP/s
accel-train bench --shards URL [RECIPE] [KEY=VALUE ...]  shards in a store (cold, warm cache) vs ImageFolder vs
                                                         webdataset's loader, same images
accel-train bench --saves [--saves-into URL] [RECIPE]    what a checkpoint save blocks: in the background vs
                                                         synchronous (a local folder, or URL)
accel-train bench --dropout [--quick]                    dropout keyed by sample against torch's: samples/s
accel-train bench --hub [RECIPE] [KEY=VALUE ...]         accel-train against Hugging Face's example loop, same hf:
                                                         model and data
accel-train bench --input [data.root=FOLDER]             images/s per core from image files: decoding alone,
                                                         torchvision's recipe, ours, our shards, webdataset
accel-train --version                                    versions of accel-train, torch, torchvision, accelerate;
                                                         the devices visible
accel-train COMMAND --help                               one command's usage, with examples

Multi-process: accelerate launch --config_file "$(accel-train profile multi_gpu)" -m accel_train train RECIPE
           or: torchrun --nproc_per_node N -m accel_train train RECIPE
"""

OVERRIDES = "KEY=VALUE: dotted config overrides, optional (e.g. train.lr=0.01; `accel-train keys` lists them)"

# name: (one line, usage, examples)
COMMANDS = {
    "train": ("train a recipe", "accel-train train RECIPE [KEY=VALUE ...]", """\
  accel-train train fashion_mnist_cnn
  accel-train train fashion_mnist_cnn train.epochs=3 train.lr=3e-4 output_dir=runs/fm
  accel-train train fashion_mnist_cnn output_dir=runs/fm resume=auto     # continue after a stop
  accel-train train runs/fm output_dir=runs/fm_again                     # the run's config.yaml as the recipe
  accelerate launch --config_file "$(accel-train profile multi_gpu)" -m accel_train train fashion_mnist_cnn"""),
    "eval": ("evaluate a run's exported model",
             "accel-train eval RUN [split=val] [KEY=VALUE ...]\n       accel-train eval RECIPE checkpoint=PATH "
             "[KEY=VALUE ...]", """\
  accel-train eval runs/fm                                  # the run's own config: model, data, image size
  accel-train eval runs/fm data.eval_subset=1000 train.eval_batch_size=500
  accel-train eval runs/fm split=val                        # the validation split the run held out
  accel-train eval runs/fm/checkpoints/step-00000938        # one checkpoint of the run
  accel-train eval fashion_mnist_cnn checkpoint=model.safetensors   # weights without their run folder
Settings that change what the weights mean (model.*, data.name, data.image_size, data.normalize, data.mean,
data.std, data.num_classes, task) must agree with the run's; data.root, data.eval_subset, train.eval_batch_size
and the like may differ. Prints the metrics as JSON on stdout, with num_samples and num_processes."""),
    "predict": ("the top labels of image files, as CSV",
                "accel-train predict RUN input=PATH [output=FILE|URL] [KEY=VALUE ...]", """\
  accel-train predict runs/imagefolder input=photos/                         # -> predictions.csv
  accel-train predict runs/imagefolder input='photos/*.jpg' output=out.csv predict.top_k=3
INPUT is an image file, a folder (searched recursively) or a quoted glob. The class names come from the
run folder's classes.json; as with eval, settings that change what the weights mean must agree with the run's."""),
    "export": ("write a run's model as a folder its own library loads", "accel-train export RUN output=DIR "
               "[format=library|onnx] [checkpoint=PATH]", """\
  accel-train export runs/vit output=exported/vit          # hf: save_pretrained's layout; timm: timm's own
  accel-train export runs/fm output=exported/fm format=onnx  # any model: model.onnx, checked against onnxruntime
  hf upload USER/NAME exported/vit                          # publish it on the Hub (huggingface_hub's CLI)
format=library writes an hf: model as transformers' save_pretrained does (id2label from the run's classes, an image
processor that makes the inputs the run's evaluation made) and a timm: model as timm saves one; each folder gets a
model card (README.md) with the run's data, final metrics and config."""),
    "shard": ("write a recipe's data as shards at a folder or URL", "accel-train shard RECIPE [KEY=VALUE ...] "
              "output=URL [images=auto] [shrink_to=PX] [shard_mb=256] [block_mb=4]\n       accel-train shard index URL "
              "[block_mb=4]", """\
  accel-train shard fashion_mnist_cnn output=s3://bucket/fashion_mnist
  accel-train shard imagefolder data.root=photos/ output=s3://bucket/photos
  accel-train shard imagefolder data.root=photos/ output=s3://bucket/photos_256 images=raw shrink_to=256
  accel-train train fashion_mnist_cnn data.name=shards data.root=s3://bucket/fashion_mnist
  accel-train shard index s3://bucket/my_tars             # train/*.tar and test/*.tar written by webdataset
Each split becomes WebDataset tars (KEY.png, KEY.jpg or KEY.pixels.npy + KEY.cls per sample) and an index.json,
written last. images=raw stores uint8 pixels (nothing to decode; the default for the registry's small images),
images=jpeg re-encodes at quality 90, images=as_given keeps the files' own bytes (the default for ImageFolder);
shrink_to=PX first resizes an image whose short side is longer (at 256, evaluation at 224 px sees the tree's
pixels). Running the same command again finishes a write that was cut short, or says the shards are complete.
Credentials and the endpoint come from the storage's own environment (AWS_PROFILE, AWS_ENDPOINT_URL, ...)."""),
}

DEFAULT_PREDICTIONS = "predictions.csv"  # predict's output= when none is given, in the current folder
# Arguments a command takes as NAME=VALUE beside the config overrides: name -> what it is (None: optional).
COMMAND_ARGUMENTS = {
    "eval": {"checkpoint": None, "split": None},
    "predict": {"checkpoint": None, "input": "input=PATH (an image file, a folder or a glob)", "output": None},
    "shard": {"output": None, "shard_mb": None, "block_mb": None, "images": None, "shrink_to": None},
    "export": {"checkpoint": None, "output": "output=DIR (a new folder)", "format": None},
}
# How a command's function takes its arguments when not parsed by the command line (get_default("arguments")):
UNTOUCHED = "untouched"  # launch: accelerate launch's, passed on as given (argparse would read their flags)
INTERMIXED = "intermixed"  # options and positionals in any order (`eval RUN --trust-code data.root=x`), which
# subcommands do not allow


class _CommandLine(argparse.ArgumentParser):
    """A mistake in the command itself in one line, naming the closest command or the override's spelling, instead of
    argparse's whole usage (27 lines)."""

    def add_subparsers(self, **kwargs):
        self.commands = super().add_subparsers(**kwargs)  # its choices: the commands, by name
        return self.commands

    def error(self, message: str):
        if (unknown := re.search(r"invalid choice: '([^']*)'", message)) is not None:
            message = f"unknown command '{unknown.group(1)}'{did_you_mean(unknown.group(1), self.commands.choices)}"
        self.exit(2, f"accel-train: error: {_dashed_override(message)}; accel-train --help lists the commands\n")


class _Subcommand(argparse.ArgumentParser):
    """A mistake in one command's options in one line: the command, the option and what was wrong (`accel-train
    bench --demand 5k`), instead of the command's usage block; exit 2."""

    def error(self, message: str):
        command = self.prog.removeprefix("accel-train ")
        self.exit(2, f"accel-train: error: {command}: {_dashed_override(message)}; {self.prog} --help shows its "
                  "usage\n")


def _dashed_override(message: str) -> str:
    if (dashed := re.search(r"unrecognized arguments: (--\S*[.=]\S*)", message)) is not None:
        return message + f" (a config override takes no dashes: {dashed.group(1).lstrip('-')})"
    return message


def command_line() -> _CommandLine:
    """The table of commands: each one's parser, in the order --help lists them, and the function that runs it."""
    parser = _CommandLine(prog="accel-train", description="Train PyTorch models on 1 GPU, N GPUs or N machines with "
                          "one code path (Hugging Face Accelerate).", usage=USAGE)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Subcommand)

    def command(name: str, run, arguments: str | None = None, **kwargs) -> argparse.ArgumentParser:
        subcommand = commands.add_parser(name, prog=f"accel-train {name}", **kwargs)  # its own prog: else all USAGE
        subcommand.set_defaults(run=run, arguments=arguments)
        return subcommand

    def on_a_recipe(name: str, run, metavar: str, text: str, nargs: str | None = "?") -> None:
        """RECIPE or RUN, then config overrides; one line, usage and examples from COMMANDS."""
        line, usage, examples = COMMANDS[name]
        recipe = command(name, run, INTERMIXED, help=line, usage=usage,
                         description=line[0].upper() + line[1:] + ".", epilog="examples:\n" + examples,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
        recipe.add_argument("recipe", metavar=metavar, nargs=nargs, help=text)
        recipe.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help=OVERRIDES)
        _trust_argument(recipe)

    on_a_recipe("train", _train, "RECIPE", "a shipped recipe (`accel-train recipes`), a YAML file, or a run's "
                "output_dir (the config.yaml it ran with)", nargs=None)
    on_a_recipe("eval", _eval, "RUN", "a training run's output_dir; or a recipe, with checkpoint=PATH")
    on_a_recipe("predict", _predict, "RUN", "a training run's output_dir; or a recipe, with checkpoint=PATH")
    on_a_recipe("export", _export, "RUN", "a training run's output_dir (or one of its checkpoints)")
    on_a_recipe("shard", _shard, "RECIPE", "the recipe whose data to write (a shipped one or a YAML file); or `index`, "
                "then the URL")
    _sweep_arguments(command("sweep", _sweep, INTERMIXED, **SWEEP_HELP))
    _bench_arguments(command("bench", _bench, help="benchmark: overhead, input pipeline, scaling, FLOP/s"))
    runs = command("runs", _runs, help="table of runs: recipe, processes, precision, steps, best and final eval "
                   "metric, wall time, samples/s")
    runs.add_argument("folder", metavar="DIR", help="a run's output_dir, or a folder holding runs (e.g. runs)")
    runs.add_argument("--diff", nargs=2, metavar=("A", "B"), help="the config keys two runs (folders, or names "
                      "under DIR) differ in")
    runs.add_argument("--json", action="store_true", help="the same as JSON, for scripts")
    plot = command("plot", _plot, help="train loss, eval metrics and LR against optimizer steps, runs overlaid")
    plot.add_argument("runs", nargs="+", metavar="RUN", help="run folders (or folders holding runs); "
                      "output=FILE sets the PNG (default curves.png)")
    photos = command("photos", _photos, help="make an ImageNet-shaped folder of JPEG photographs offline (from "
                     "Debian's mate-backgrounds): OUT/train/<class>/*.jpg and OUT/test/<class>/*.jpg",
                     epilog="examples:\n  accel-train photos photos/\n  accel-train train imagefolder "
                     "data.root=photos/ train.epochs=3\n  accel-train bench --input data.root=photos/",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    photos.add_argument("folder", metavar="OUT", help="a new folder (or one this command made)")
    photos.add_argument("--train", type=int, default=1024, help="training images (default 1024)")
    photos.add_argument("--test", type=int, default=256, help="test images (default 256)")
    photos.add_argument("--seed", type=int, default=0, help="the same seed and counts make the same files")
    command("launch", _launch, UNTOUCHED, help="accelerate launch once every machine has joined (accel-train launch "
            "--help)")
    command("recipes", _recipes, help="list shipped recipes")
    command("profiles", _profiles, help="list shipped launch profiles")
    profile = command("profile", _profile, help="print the installed file of a launch profile")
    profile.add_argument("name", help="a profile name from `accel-train profiles`, e.g. multi_gpu")
    keys = command("keys", _keys, help="list config keys with their meaning and values",
                   usage="accel-train keys [RECIPE] [KEY=VALUE ...]",
                   epilog="examples:\n  accel-train keys\n  accel-train keys imagefolder\n"
                   "  accel-train keys runs/fm          # what a run ran with",
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    keys.add_argument("recipe", nargs="?", metavar="RECIPE", help="show this recipe's values (a shipped name, a "
                      "YAML file or a run's output_dir) instead of the defaults")
    keys.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help=OVERRIDES)
    from accel_train.launch.settings import add_arguments  # the accelerate launch flags doctor checks

    add_arguments(command("doctor", _doctor, help="check this node before a launch: devices, backend, mixed precision, "
                          "accelerate config, multi-node network; exit 1 on any problem"))
    return parser


def _trust_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(TRUST_FLAG, dest="trust_code", action="store_true",
                        help="run the code (import paths) that a run folder's config.yaml names: only for a folder "
                        "whose writer you trust (your own runs need no flag: docs/user-code.md)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] in (["--version"], ["-V"]):
            return _print_versions()
        _dispatch(command_line(), argv)
        sys.stdout.flush()  # here, where a reader that left is caught, not at the interpreter's exit
    except BrokenPipeError:  # `accel-train keys | head`: the reader left; no traceback, as other tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
        sys.exit(141)  # 128 + SIGPIPE, as the shell reports a command the pipe ended
    except UserError as err:
        _report(err)
        sys.exit(err.exit_code)
    except Preempted as stop:
        _report(stop, prefix="accel-train: ")
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as err:
        if "torch" not in sys.modules:
            raise
        from accel_train.distributed.collectives import lost_a_peer

        if not lost_a_peer(err):
            raise
        _report(PeerLost(f"a collective failed ({str(err).splitlines()[0]}): another process died or stopped "
                         "answering (its own log says why); under --max_restarts the launcher restarts the group, "
                         "which resumes from the newest checkpoint"))
        sys.exit(PeerLost.exit_code)


def _dispatch(parser: _CommandLine, argv: list[str]) -> None:
    """Call the chosen command's function with its parsed arguments (launch: the arguments as given)."""
    chosen = parser.commands.choices.get(argv[0]) if argv else None
    arguments = chosen.get_default("arguments") if chosen is not None else None
    if arguments == UNTOUCHED:
        return chosen.get_default("run")(argv[1:])
    args = chosen.parse_intermixed_args(argv[1:]) if arguments == INTERMIXED else parser.parse_args(argv)
    args.run(args)


def _print_versions() -> None:
    from accel_train.versions import version_problems, versions

    for name, version in versions().items():
        print(f"{name:12s} {version}")
    from accel_train.distributed.devices import visible_devices  # imports torch: after the versions, which need none

    print(f"{'devices':12s} {visible_devices()[3]}")
    for problem in version_problems():
        print(f"problem: {problem}")


def _report(err: Exception, prefix: str = "accel-train: error: ") -> None:
    from accel_train.distributed.environment import launcher_environment

    launcher = launcher_environment()
    if getattr(err, "on_every_process", True):  # the same line on every process: the main one says it
        if launcher.is_reporting_process:
            print(f"{prefix}{err}", file=sys.stderr, flush=True)
        return
    several = (launcher.world_size or 1) > 1
    print(f"{prefix}{f'process {launcher.rank}: ' if several else ''}{err}", file=sys.stderr, flush=True)


# The commands, in the table's order. Those that load torch check the versions first: an old library fails later
# with errors that blame something else. Torch loads only once the config is known to be valid: the API checks first
# (and, for eval and predict, that it agrees with the run).


def _train(args: argparse.Namespace) -> None:
    _check_versions()
    recipe, _, overrides = _recipe_and_arguments(args, "train")
    from accel_train import api

    api.train(recipe, overrides, trust_code=args.trust_code)


def _eval(args: argparse.Namespace) -> None:
    _check_versions()
    recipe, given, overrides = _recipe_and_arguments(args, "eval")
    from accel_train import api
    from accel_train.distributed.environment import launcher_environment

    split = given.get("split", "test")  # a run folder is its own recipe; a recipe given must agree with the run
    config, checkpoint = api.run_config(recipe, given.get("checkpoint"), overrides, "eval", split=split,
                                        trust_code=args.trust_code)
    if launcher_environment().is_reporting_process:  # torch and the data take seconds: say what is coming
        print(f"accel-train eval: evaluating {checkpoint} ({config.model.name} on {config.data.name} {split})...",
              file=sys.stderr, flush=True)
    metrics = api.evaluate_run(config, checkpoint, split=split)
    if launcher_environment().is_reporting_process:
        print(f"accel-train eval: {checkpoint}: {_described(metrics)}", file=sys.stderr, flush=True)
        print(json.dumps(metrics), flush=True)


def _predict(args: argparse.Namespace) -> None:
    _check_versions()
    recipe, given, overrides = _recipe_and_arguments(args, "predict")
    from accel_train import api
    from accel_train.distributed.environment import launcher_environment

    config, checkpoint = api.run_config(recipe, given.get("checkpoint"), overrides, "predict", split="test",
                                        trust_code=args.trust_code)
    output = given.get("output", DEFAULT_PREDICTIONS)
    if "output" not in given and Path(output).exists():  # a file given is the user's to write over; this is not
        raise UserError(f"predict: {output} is already here (an earlier predict's?); give output=FILE (a file "
                        "given is written over), or move that one away")
    rows = api.predict_run(config, checkpoint, given["input"], output)
    if launcher_environment().is_reporting_process:
        print(f"predicted {len(rows)} file(s): {output}", flush=True)


def _export(args: argparse.Namespace) -> None:
    _check_versions()
    recipe, given, overrides = _recipe_and_arguments(args, "export")
    from accel_train import api

    config, checkpoint = api.run_config(recipe, given.get("checkpoint"), overrides, "export",
                                        trust_code=args.trust_code)
    from accel_train.tools.export import export_run

    files = export_run(config, checkpoint, given["output"], given.get("format", "library"))
    print(f"exported {checkpoint} to {given['output']}: {', '.join(files)}", flush=True)


def _shard(args: argparse.Namespace) -> None:
    _check_versions()
    recipe, given, overrides = _recipe_and_arguments(args, "shard")
    from accel_train.config import load_config
    from accel_train.config.trust import check_code
    from accel_train.data.shards.writer import index_tars, write_shards

    sizes = {}
    for name in ("shard_mb", "block_mb"):
        if name in given:
            try:
                sizes[name] = float(given[name])
            except ValueError:
                sizes[name] = -1.0
            if not sizes[name] > 0:
                raise UserError(f"shard: {name}={given[name]}: a size in MB greater than 0")
    stored = {"images": given["images"]} if "images" in given else {}
    if "shrink_to" in given:
        if not given["shrink_to"].isdigit() or int(given["shrink_to"]) < 1:
            raise UserError(f"shard: shrink_to={given['shrink_to']}: the short side in pixels, a whole number above 0")
        stored["shrink_to"] = int(given["shrink_to"])
    if recipe == "index":
        if len(overrides) != 1 or "output" in given or "shard_mb" in given or stored:
            raise UserError("shard index takes one URL: accel-train shard index URL [block_mb=4]")
        return index_tars(overrides[0], **{key: value for key, value in sizes.items() if key == "block_mb"})
    if recipe is None or "output" not in given:
        raise UserError(f"shard needs a recipe and output=URL: {COMMANDS['shard'][1].splitlines()[0]}")
    config = load_config(recipe, overrides)
    check_code(config, args.trust_code)
    write_shards(config.data, given["output"], recipe=recipe, **sizes, **stored)


SWEEP_HELP = dict(
    help="hyperparameter search with Optuna: every trial a normal, resumable run folder (accel-train sweep --help)",
    formatter_class=argparse.RawDescriptionHelpFormatter,
    usage="accel-train sweep RECIPE --trials N --metric METRIC [--direction max|min] [--launch COMMAND] "
          "KEY=DISTRIBUTION(ARGS) ... [KEY=VALUE ...] [output_dir=FOLDER]",
    description="Search hyperparameters with Optuna (pip install 'accel-train[sweep]'): a seeded TPE sampler and "
                "a median pruner.\nEach trial is `accel-train train` in FOLDER/trial-NNNN under the launch "
                "command; a trial the pruner\nrejects gets SIGTERM, saves its checkpoint and exits 75. Run the "
                "same command again after a stop:\nthe running trial resumes from its checkpoint, then new ones "
                "are sampled until N are done.\nDistributions: uniform(LOW,HIGH), loguniform(LOW,HIGH), "
                "int(LOW,HIGH), logint(LOW,HIGH), choice(A,B,...).",
    epilog="""examples:
  accel-train sweep fashion_mnist_cnn --trials 20 --metric accuracy 'train.lr_base=loguniform(1e-4,1e-1)' \\
      'train.batch_size=choice(64,128,256)' 'train.label_smoothing=uniform(0,0.2)' data.val_fraction=0.1 \\
      output_dir=sweeps/fm      # train.lr_base: each trial's train.lr follows its batch size
  accel-train sweep fashion_mnist_cnn --trials 20 --metric accuracy \\
      --launch "accelerate launch --config_file $(accel-train profile multi_gpu)" \\
      'train.lr_base=loguniform(1e-4,1e-2)' 'train.batch_size=choice(256,512,1024)' output_dir=sweeps/fm_gpus
  accel-train runs sweeps/fm            # one row per trial, sorted by the metric
  accel-train plot sweeps/fm            # the best trials' curves; parameters.png: the metric against each value
  accel-train eval sweeps/fm/trial-0003 # a trial is a run folder""")


def _sweep_arguments(sweep: argparse.ArgumentParser) -> None:
    _trust_argument(sweep)
    sweep.add_argument("recipe", metavar="RECIPE", help="a shipped recipe, a YAML file or a run's output_dir")
    sweep.add_argument("overrides", nargs="*", default=[], metavar="KEY=DISTRIBUTION(ARGS) | KEY=VALUE",
                       help="searched keys (e.g. 'train.lr=loguniform(1e-4,1e-1)', quoted for the shell) and fixed "
                       "overrides; output_dir=FOLDER holds the sweep (default sweeps/RECIPE)")
    sweep.add_argument("--trials", type=int, required=True, help="trials to finish (complete, pruned or failed)")
    sweep.add_argument("--metric", required=True, help="the evaluation metric to optimize, e.g. accuracy or loss "
                       "(on the validation split with data.val_fraction, else on the test split)")
    sweep.add_argument("--direction", choices=("max", "min"), help="maximize or minimize it (default: the task's "
                       "way for the metric: max for accuracy, min for loss)")
    sweep.add_argument("--launch", metavar="COMMAND", help="what runs `-m accel_train train ...` for each trial, e.g. "
                       "\"accelerate launch --num_processes 2\" or \"torchrun --nproc_per_node 8\" (default: one "
                       "process, this Python)")
    sweep.add_argument("--seed", type=int, default=0, help="the sampler's seed: the same seed samples the same "
                       "values (default 0)")
    sweep.add_argument("--startup_trials", type=int, default=5, help="the first K trials are sampled at random "
                       "(then TPE), and none is pruned until K are complete (default 5)")
    sweep.add_argument("--pruner", choices=("median", "none"), default="median", help="median: stop a trial whose "
                       "best evaluation so far is worse than the median of the complete trials at that evaluation")


def _sweep(args: argparse.Namespace) -> None:
    from accel_train.run.place import RunPlace, StagingClaimed
    from accel_train.storage import PATIENCE_S, check_url_form
    from accel_train.sweep.runner import LOCK_FILE, Sweep, run_sweep
    from accel_train.sweep.space import parse_space

    if args.trials < 1 or args.startup_trials < 0:
        raise UserError("sweep: --trials must be 1 or more and --startup_trials 0 or more")
    given, overrides = _arguments(args.overrides, {"output_dir": None, "resume": None}, "sweep")
    if "resume" in given:
        raise UserError("sweep: resume is the sweep's to set (each trial runs with resume=auto); leave it out")
    parameters, fixed = parse_space(overrides)
    folder = given.get("output_dir") or str(Path("sweeps") / Path(args.recipe.rstrip("/")).stem)
    check_url_form(folder, "output_dir")
    # A sweep folder at a URL: mirrored whole (its study, logs and trial runs) from this machine's staging
    try:
        place = RunPlace.open(folder, PATIENCE_S, whole=True, ignore=(LOCK_FILE,))
    except StagingClaimed as claimed:  # as the sweep's own lock says it of a local folder
        raise UserError(f"sweep: another sweep (process {claimed.pid}) is running in {folder} on this machine; let "
                        f"it end, or stop it (kill {claimed.pid}: its trial saves a checkpoint), then run this again"
                        ) from None
    try:
        run_sweep(Sweep(args.recipe, sorted(parameters, key=lambda p: p.key), fixed, args.metric,
                        args.direction or "max", args.seed, args.startup_trials, args.pruner, args.trials, place,
                        args.launch, given_direction=args.direction is not None, trust_code=args.trust_code))
    finally:
        place.drain(PATIENCE_S * 10)  # however the sweep ends, a store gets all of it


def _bench_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--quick", action="store_true", help="short windows, one round (CPU / CI friendly)")
    bench.add_argument("--processes", type=int, help="processes for the scaling table (default: GPUs, or 2 on CPU)")
    bench.add_argument("--peak-tflops", type=float, help="device peak for the utilisation (default: measured matmul)")
    bench.add_argument("--steps", type=int, help="optimizer steps per timed window (default 10 quick, 50 full)")
    bench.add_argument("--shards", metavar="URL", help="instead: the input pipeline over the recipe's images as shards "
                       "at URL (cold and warm cache), as an ImageFolder tree, and through webdataset's loader")
    bench.add_argument("--input", action="store_true", help="instead: images/s per CPU core of each way to feed a "
                       "step from image files (decoding alone, torchvision's recipe, ours, shards, webdataset), at one "
                       "core and all; recipe imagefolder, data.root=FOLDER or a folder of photographs made here")
    bench.add_argument("--hub", action="store_true", help="instead: accel-train against Hugging Face's own Accelerate "
                       "example loop (run_image_classification_no_trainer.py) on the same hf: model and data, batch "
                       "and workers; without names, a ResNet-18-shaped model on photographs made here")
    bench.add_argument("--dropout", action="store_true", help="instead: training samples/s with dropout keyed by "
                       "sample against torch's own, on the demo CNN and ViT-B-sized blocks, eager and compiled")
    bench.add_argument("--demand", type=float, metavar="IMAGES_PER_S", help="with --input: the images/s a GPU takes, "
                       "for the cores-per-GPU column (default 2470: ResNet-50, 224 px, mixed precision, one A100)")
    bench.add_argument("--overhead", action="store_true", help="only the overhead row: our loop against a plain "
                       "PyTorch loop, at the launch's mixed precision (ACCELERATE_MIXED_PRECISION=bf16 ...)")
    bench.add_argument("--saves", action="store_true", help="instead: how long a checkpoint holds training, saved "
                       "in the background against a synchronous save (recipe default cifar10_resnet50)")
    bench.add_argument("--saves-into", metavar="URL", help="with --saves: save into this folder or URL (s3://...) "
                       "instead of a temporary local folder")
    _trust_argument(bench)
    bench.add_argument("recipe", nargs="?", help="recipe to measure (fashion_mnist_fast; with --saves "
                       "cifar10_resnet50, --shards fashion_mnist_cnn, --input imagefolder)")
    bench.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help=OVERRIDES)


def _bench(args: argparse.Namespace) -> None:
    from accel_train.config import load_config
    from accel_train.config.trust import check_code

    _check_versions()
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # only overrides given: they are not a recipe name
        recipe, overrides = None, [recipe, *overrides]
    # each bench's own default recipe where none is named
    recipe = recipe or ("cifar10_resnet50" if args.saves else "imagefolder" if args.input or args.hub
                        else "fashion_mnist_cnn" if args.shards else "fashion_mnist_fast")
    if args.steps is not None and args.steps < 1 or args.processes is not None and args.processes < 1:
        raise UserError("bench: --steps and --processes must be 1 or more")
    check_code(load_config(recipe, overrides), args.trust_code)  # config mistakes answer before torch loads
    if args.demand is not None and args.demand <= 0:
        raise UserError(f"bench: --demand {args.demand:g}: give the images per second a GPU takes, above 0 "
                        "(ResNet-50 at 224 px on one A100: about 2470)")
    if args.demand is not None and not args.input:
        raise UserError(f"bench: --demand {args.demand:g} goes with --input (the input bench); add --input, or "
                        "leave it out")
    from accel_train.storage import check_location

    for option, location in (("--saves-into", args.saves_into), ("--shards", args.shards)):
        if location:  # s3:/bucket would become a local folder named "s3:"
            check_location(location, f"bench {option}")
    if args.saves_into and not args.saves:
        raise UserError(f"bench: --saves-into {args.saves_into} goes with --saves (the save benchmark); add "
                        "--saves, or leave it out")
    if args.saves:
        from accel_train.tools.bench_saves import run_saves_bench

        return run_saves_bench(recipe, overrides, args.saves_into)
    if args.dropout:
        from accel_train.tools.bench_dropout import run_dropout_bench

        return run_dropout_bench(load_config(recipe, ["output_dir=runs/bench_dropout", *overrides]).output_dir,
                                 args.steps, args.quick)
    if args.hub:
        from accel_train.tools.bench_hub import run_hub_bench

        return run_hub_bench(recipe, overrides, args.steps, rounds=1 if args.quick else 2)
    if args.input:
        from accel_train.tools.bench_input import run_input_bench

        return run_input_bench(recipe, overrides, args.steps, args.demand)
    if args.shards:
        from accel_train.tools.bench_shards import run_shards_bench

        return run_shards_bench(recipe, overrides, args.shards, args.steps)
    from accel_train.tools.bench import run_bench

    run_bench(recipe, overrides, args.quick, args.processes, args.peak_tflops, args.steps, args.overhead)


def _runs(args: argparse.Namespace) -> None:
    """Reads run folders only (no torch), as `plot` does."""
    from accel_train.run import summaries as runs
    from accel_train.run.layout import find_runs, run_folder
    from accel_train.run.read_cache import readable_runs
    from accel_train.sweep import results as sweep_results

    root = readable_runs(args.folder)
    if sweep_results.is_sweep(root) and not args.diff:
        found = sweep_results.rows(root)
        print(json.dumps(found, indent=1) if args.json else sweep_results.table(root, found) if found
              else f"the sweep in {root} has no trials yet")
        return
    if args.diff:
        a, b = (run_folder(name, root) for name in args.diff)
        differences = runs.config_diff(a, b)
        print(json.dumps([{"key": key, "a": x, "b": y} for key, x, y in differences], indent=1) if args.json
              else runs.diff_table(*args.diff, differences))
        return
    found = find_runs(root)
    summaries = [runs.summarize(folder, name) for folder, name in zip(found, runs.run_names(found))]
    print(json.dumps(summaries, indent=1) if args.json else runs.table(summaries) if summaries
          else f"no runs under {root}")


def _plot(args: argparse.Namespace) -> None:
    from accel_train.run import summaries as runs
    from accel_train.run.layout import CONFIG_FILE, CURVES_FILE, METRICS_FILE, find_runs
    from accel_train.run.read_cache import readable_runs
    from accel_train.storage import check_url_form, is_remote
    from accel_train.sweep import results as sweep_results

    given, folders = _arguments(args.runs, {"output": None}, "plot")
    if "output" in given:
        check_url_form(given["output"], "output")
        if is_remote(given["output"]):
            raise UserError(f"output={given['output']}: plot draws a local PNG; give output=FILE (a local path)")
    if len(folders) == 1 and sweep_results.is_sweep(Path(folders[0])):  # into the sweep folder, as its summary
        found = sweep_results.rows(Path(folders[0]))
        if not found:
            raise UserError(f"plot: the sweep in {folders[0]} has no trials yet")
        output = Path(given.get("output", Path(folders[0]) / CURVES_FILE))
        print("\n".join(map(str, sweep_results.draw(Path(folders[0]), found, output))), flush=True)
        return
    local = [readable_runs(folder) for folder in folders]  # runs in a store: copied into the read cache
    found = [run for folder in local for run in find_runs(folder)]
    if not found:
        raise UserError(f"plot: no run folder (one holding {CONFIG_FILE} and {METRICS_FILE}) in "
                        f"{' '.join(folders)}")
    from accel_train.errors import writing
    from accel_train.run.plots import plot_runs

    # one run at a URL: drawn beside it, in the store (as training draws it), not into the current folder
    beside_url = "output" not in given and len(folders) == len(found) == 1 and is_remote(folders[0])
    output = Path(given["output"]) if "output" in given else found[0] / CURVES_FILE if beside_url else \
        plot_output(folders if not any(map(is_remote, folders)) else [*folders, ""], found)
    with writing(output, "drawing the plot", "choose another output=FILE"):
        drawn = plot_runs(found, output, runs.run_names(found))
    if beside_url:
        from accel_train.storage import Store

        Store(folders[0], "run").put(drawn, CURVES_FILE)
        drawn = f"{folders[0].rstrip('/')}/{CURVES_FILE}"
    print(drawn, flush=True)


def plot_output(folders: list[str], found: list) -> Path:
    """Where `plot` draws without output=FILE: one run's own curves.png (what training draws there); for several
    runs, curves.png here, never over a file that is already there."""
    from accel_train.run.layout import CURVES_FILE

    if len(found) == 1 and len(folders) == 1:
        return found[0] / CURVES_FILE
    output = Path(CURVES_FILE)
    if output.exists():
        raise UserError(f"plot: {output} is already here; give output=FILE (a file given is written over), or plot "
                        "from another folder")
    return output


def _photos(args: argparse.Namespace) -> None:
    from accel_train.tools.photos import make_photo_folder

    if args.train < 1 or args.test < 1:
        raise UserError(f"photos: --train {args.train} --test {args.test}: 1 image or more in each split")
    root = make_photo_folder(Path(args.folder), args.train, args.test, args.seed)
    print(f"{root}: {args.train} training and {args.test} test photographs; train on them with: accel-train "
          f"train imagefolder data.root={root}", flush=True)


def _launch(arguments: list[str]) -> None:
    from accel_train.launch.command import main as launch

    launch(arguments)


def _recipes(args: argparse.Namespace) -> None:
    from accel_train.config import list_recipes

    for name, description in list_recipes().items():
        print(f"{name:24s} {description}")


def _profiles(args: argparse.Namespace) -> None:
    from accel_train.launch.profiles import list_profiles, profile_summary

    for name, path in list_profiles().items():
        print(f"{name:24s} {profile_summary(path)}")


def _profile(args: argparse.Namespace) -> None:
    from accel_train.launch.profiles import profile_path

    print(profile_path(args.name))


def _keys(args: argparse.Namespace) -> None:
    from accel_train.config import Config, describe_keys, load_config, spelled

    recipe, overrides = _recipe_or_override(args.recipe, args.overrides)
    values = load_config(recipe if recipe is not None else Config(), overrides) if recipe or overrides else None
    for key, type_name, text, value in describe_keys(values):
        print(f"{key:24s} {type_name:12s} {'default' if values is None else 'value'} {spelled(value):10s} {text}")


def _doctor(args: argparse.Namespace) -> None:
    from accel_train.launch.doctor import run

    sys.exit(run(args))


def _check_versions() -> None:
    from accel_train.versions import check_versions

    check_versions()


def _recipe_and_arguments(args: argparse.Namespace, command: str) -> tuple[str | None, dict[str, str], list[str]]:
    """RECIPE (or RUN), the command's NAME=VALUE arguments and the config overrides."""
    recipe, overrides = _recipe_or_override(args.recipe, args.overrides)
    given, overrides = _arguments(overrides, COMMAND_ARGUMENTS.get(command, {}), command)
    return recipe, given, overrides


def _recipe_or_override(recipe: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`eval checkpoint=RUN` and `keys train.lr=1`: the first argument is an override, not a recipe."""
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        return None, [recipe, *overrides]
    return recipe, list(overrides)


PATH_ARGUMENTS = ("checkpoint", "input", "output", "output_dir")  # NAME=VALUE arguments that name a path (or URL)


def _arguments(overrides: list[str], names: dict, command: str) -> tuple[dict[str, str], list[str]]:
    """Split NAME=VALUE command arguments (checkpoint=, input=, output=) from the config overrides; `~` expanded in
    those that are paths, as in a config key (sh and zsh leave it in `output=~/x`, and so does bash in
    `output='~/x'`)."""
    from accel_train.config.schema import expand_home

    given = {}
    for override in overrides:
        name, sep, value = override.partition("=")
        if sep and name in names:
            given[name] = expand_home(value) if name in PATH_ARGUMENTS else value
    missing = [text for name, text in names.items() if text and name not in given]
    if missing:
        raise UserError(f"{command} needs {' and '.join(missing)}: {COMMANDS[command][1]}")
    return given, [o for o in overrides if o.partition("=")[0] not in names]


def _described(metrics: dict) -> str:
    """The eval line for people (stdout holds the JSON for scripts)."""
    shown = ", ".join(f"{name}={value:.4f}" for name, value in metrics.items()
                      if name not in ("num_samples", "num_processes") and isinstance(value, float))
    return f"{metrics.get('num_samples', '?')} samples on {metrics['num_processes']} process(es): {shown}"
