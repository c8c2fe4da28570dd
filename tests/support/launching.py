"""The run every launch path trains (README's launching table), and the check that a path trains and evaluates it
with the numbers of one plain process."""

import pytest
import yaml

from support.commands import last_json_line
from support.nodes import run_nodes
from support.runs import read_metrics

# 48 samples / global batch 24 = 2 steps per epoch; 101 eval samples split evenly across no 2 processes.
RUN = ["mnist_cnn", "data.synthetic=true", "data.train_subset=48", "data.eval_subset=101", "model.dropout=false",
       "train.batch_size=24", "train.eval_batch_size=50", "train.epochs=2", "train.log_every_steps=1",
       "train.schedule=exponential", "train.lr_gamma=0.5", "train.plot=false"]
STEPS = 4


def check_path(path, world_size, nodes, reference, tmp_path, evaluate=True, apart_s=0):
    """Train and evaluate through the path (nodes started `apart_s` seconds apart); returns the training run of its
    first node."""
    out = tmp_path / "run"
    trained_by = run_nodes([(command + ["train", *RUN, f"output_dir={out}"], env) for command, env in nodes(tmp_path)],
                           apart_s=apart_s)
    run = yaml.safe_load((out / "config.yaml").read_text())["run"]
    assert (run["world_size"], run["mixed_precision"]) == (world_size, "no")
    assert run["distributed_type"] == ("MULTI_CPU" if world_size > 1 else "NO")
    losses = [line["loss"] for line in read_metrics(out, "train")]
    expected = [line["loss"] for line in read_metrics(reference, "train")]
    assert len(losses) == STEPS and losses == pytest.approx(expected, rel=1e-5)
    trained, reference_eval = read_metrics(out, "test")[-1], read_metrics(reference, "test")[-1]
    assert (trained["num_samples"], trained["correct"]) == (101, reference_eval["correct"])
    assert trained["loss"] == pytest.approx(reference_eval["loss"], rel=1e-5)
    if not evaluate:
        print(f"\n{path}: world size {world_size}, step {STEPS}: train loss {losses[-1]:.6f}; eval of its own "
              f"weights: accuracy {trained['accuracy']:.4f} loss {trained['loss']:.6f}")
        return trained_by[0]

    first_node = run_nodes([(command + ["eval", *RUN, f"checkpoint={reference}"], env)
                            for command, env in nodes(tmp_path)])[0]
    evaluated = last_json_line(first_node.stdout)
    assert (evaluated["num_samples"], evaluated["correct"]) == (101, reference_eval["correct"])
    assert evaluated["num_processes"] == world_size
    assert evaluated["loss"] == pytest.approx(reference_eval["loss"], rel=1e-6)
    print(f"\n{path}: world size {world_size}, step {STEPS}: train loss {losses[-1]:.6f}; eval of the shared "
          f"checkpoint: accuracy {evaluated['accuracy']:.4f} loss {evaluated['loss']:.6f}")
    return trained_by[0]
