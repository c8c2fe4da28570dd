"""Contracts of dropout keyed by sample (training/dropout.py), in this process: a sample's mask is a function of (seed,
step, its index, the layer) and of nothing else, drawn on the device; each kind of torch's dropout layer keeps its
proportion and scaling; every nn.Dropout of any model is keyed at set-up, and the dropout a model draws inside its
forward is named once, in one line; train.keyed_dropout=false keeps torch's layers. The runs at other world sizes,
micro-batches and across a resume: tests/contracts/test_dropout_keyed_by_sample_trains_alike_everywhere.py."""

import re

import pytest
import torch
from torch import nn

from accel_train.training.dropout import DropoutKeys, KeyedDropout, kept_where, key_dropout, keyed_bits, layer_salt
from support.commands import train_in_process
from support.locations import USER_RECIPE


class MainProcess:
    is_main_process = True
    device = torch.device("cpu")


def masks(layer: KeyedDropout, keys: list[int], step: int, shape=(6,)) -> torch.Tensor:
    """The kept-or-dropped mask `layer` draws for samples `keys` at `step` (1 kept, 0 dropped)."""
    layer.dropout_keys.keys, layer.dropout_keys.step = torch.tensor(keys), torch.tensor(step)
    return (layer.train()(torch.ones(len(keys), *shape)) != 0).to(torch.int64)


def test_a_samples_mask_is_a_function_of_seed_step_index_and_layer_alone():
    keys = DropoutKeys(True, torch.device("cpu"))
    layer, other_layer = (KeyedDropout(nn.Dropout(0.5), keys, layer_salt(0, name)) for name in ("a.0", "b.0"))
    together = masks(layer, [5, 6, 7], step=3)
    assert torch.equal(masks(layer, [7, 5], step=3), together[[2, 0]])  # another batch, another place: the same
    assert torch.equal(masks(layer, [6], step=3)[0], together[1])
    assert not torch.equal(masks(layer, [5, 6, 7], step=4), together)  # another step
    assert not torch.equal(masks(other_layer, [5, 6, 7], step=3), together)  # another layer
    seeded = KeyedDropout(nn.Dropout(0.5), keys, layer_salt(1, "a.0"))
    assert not torch.equal(masks(seeded, [5, 6, 7], step=3), together)  # another seed


def test_the_bits_behind_the_masks_are_uniform_and_independent_of_their_neighbours():
    bits = keyed_bits(torch.arange(512), torch.tensor(7), 12345, 512)
    drawn = (bits.to(torch.int64) & 0xFFFFFFFF).to(torch.float64) / 2**32  # as unsigned words, in [0, 1)
    assert abs(float(drawn.mean()) - 0.5) < 0.005 and abs(float(drawn.std()) - 12 ** -0.5) < 0.005
    neighbours = torch.corrcoef(torch.stack([drawn[:, :-1].flatten(), drawn[:, 1:].flatten()]))[0, 1]
    samples = torch.corrcoef(torch.stack([drawn[:-1].flatten(), drawn[1:].flatten()]))[0, 1]
    assert abs(float(neighbours)) < 0.01 and abs(float(samples)) < 0.01
    for p in (0.0, 0.1, 0.5, 0.9):
        assert float(kept_where(bits, p).float().mean()) == pytest.approx(1 - p, abs=0.005)


@pytest.mark.parametrize("kind, shape", [(nn.Dropout, (4000,)), (nn.Dropout1d, (200, 20)),
                                         (nn.Dropout2d, (200, 4, 4)), (nn.Dropout3d, (200, 2, 2, 2)),
                                         (nn.AlphaDropout, (4000,)), (nn.FeatureAlphaDropout, (200, 4, 4))])
def test_each_kind_of_dropout_keeps_torchs_proportion_scaling_and_unit(kind, shape):
    """As torch's own layer, in distribution: p of the units (or of the channels) dropped, the mean kept (alpha
    dropout: the mean and the variance of SELU's inputs); channel-wise kinds drop whole channels."""
    torch.manual_seed(0)
    keys = DropoutKeys(True, torch.device("cpu"))
    layer = KeyedDropout(kind(0.25), keys, 99).train()
    keys.keys, keys.step = torch.arange(64), torch.tensor(1)
    inputs = torch.randn(64, *shape) if kind in (nn.AlphaDropout, nn.FeatureAlphaDropout) else torch.ones(64, *shape)
    out = layer(inputs)
    expected = kind(0.25).train()(inputs)
    assert float(out.mean()) == pytest.approx(float(expected.mean()), abs=0.02)
    assert float(out.std()) == pytest.approx(float(expected.std()), rel=0.03)
    if kind not in (nn.AlphaDropout, nn.FeatureAlphaDropout):
        assert float((out == 0).float().mean()) == pytest.approx(0.25, abs=0.02)
    if kind in (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d):  # a channel is dropped whole, or kept whole
        per_channel = (out == 0).flatten(2).float().mean(-1)
        assert set(per_channel.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(layer.eval()(inputs), inputs)  # evaluation: no dropout


def test_every_dropout_layer_of_a_model_is_keyed_and_eval_leaves_inputs_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2), nn.Sequential(nn.Dropout2d(0.1), nn.AlphaDropout(0.1)),
                          nn.Dropout(0.0))
    assert key_dropout(model, 0, MainProcess()).layers == 3
    assert [type(module).__name__ for module in model.modules()][1:] == \
        ["Linear", "KeyedDropout", "Sequential", "KeyedDropout", "KeyedDropout", "Dropout"]  # p=0: nothing to key
    assert key_dropout(nn.Sequential(nn.Linear(2, 2)), 0, MainProcess()).layers == 0


def test_dropout_drawn_inside_a_models_forward_is_named_once_in_one_line(tmp_path, capsys):
    train_in_process(USER_RECIPE, "model.name=user_models:DropoutNet", "model.args.functional=0.25",
                     "train.max_steps=3", "train.plot=false", f"output_dir={tmp_path / 'run'}")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "cannot be keyed" in line]
    assert warnings == ["accel-train: warning: dropout that cannot be keyed by sample: 1 layer(s) draw it inside their "
                        "forward, DropoutNet's forward (F.dropout, p=0.25); their masks are torch's, drawn per "
                        "process, so a run with them trains alike at another world size only within their noise "
                        "(docs/contracts.md; model.dropout=false removes the layers' own dropout, a model's config its "
                        "attention dropout)"], warnings


def test_attention_dropout_inside_a_transformers_model_is_named_by_its_layer(tmp_path, capsys):
    pytest.importorskip("transformers")
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, num_labels=2, attention_probs_dropout_prob=0.1,
                       attn_implementation="sdpa")
    ViTForImageClassification(config).save_pretrained(tmp_path / "vit")
    train_in_process("imagefolder", "data.synthetic=true", "data.train_subset=16", "data.eval_subset=4",
                     f"model.name=hf:{tmp_path / 'vit'}", "data.image_size=16", "train.batch_size=8",
                     "train.max_steps=2", "train.plot=false", "data.num_workers=0", f"output_dir={tmp_path / 'run'}")
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if "cannot be keyed" in line]
    # the attention module by its qualified name (vit.encoder.layer.0.attention in transformers 4, vit.layers.0... in 5)
    named = r"forward, vit\.\S+0\.attention \(scaled_dot_product_attention, dropout_p=0\.1\);"
    assert re.search(named, warning), warning


def test_the_one_list_of_dropout_layers_holds_every_kind_torch_has_and_model_dropout_false_removes_each():
    """A kind torch adds is neither keyed nor removed until it is in the list: this names it."""
    from accel_train.workloads.models import DROPOUT_LAYERS, remove_dropout

    torchs = {kind for kind in vars(nn).values()
              if isinstance(kind, type) and issubclass(kind, nn.Module) and "Dropout" in kind.__name__}
    assert torchs == set(DROPOUT_LAYERS), torchs ^ set(DROPOUT_LAYERS)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(*(kind(0.1) for kind in DROPOUT_LAYERS)))
    remove_dropout(model)
    assert [type(module).__name__ for module in model.modules()][1:] == ["Linear", "Sequential",
                                                                         *["Identity"] * len(DROPOUT_LAYERS)]


def test_the_switch_keeps_torchs_own_dropout_and_model_dropout_false_removes_it(tmp_path):
    from accel_train import hooks

    seen = []

    class Layers(hooks.Hooks):
        def model_prepared(self, model):
            seen.append(sorted({type(module).__name__ for module in model.modules() if "ropout" in
                                type(module).__name__}))

    with hooks.added(Layers()):
        for number, switches in enumerate((["train.keyed_dropout=false"], ["model.dropout=false"], [])):
            train_in_process("mnist_cnn", "data.synthetic=true", "data.train_subset=24", "data.eval_subset=4",
                             "train.batch_size=12", "train.max_steps=1", "train.plot=false", *switches,
                             f"output_dir={tmp_path / str(number)}")
    assert seen == [["Dropout"], [], ["KeyedDropout"]]


@pytest.mark.processes  # inductor runs the C++ compiler
def test_a_compiled_model_draws_the_eager_masks_and_is_traced_once():
    """torch.compile: the keys and the step are device tensors updated in place, so a new step or new samples do not
    trace the layers again (a recompilation every step would cost more than the dropout), and inductor's kernels
    draw the masks the eager layers draw."""
    from torch._inductor.compile_fx import compile_fx

    traced = []

    def counting_inductor(graph, example_inputs):
        traced.append(graph)
        return compile_fx(graph, example_inputs)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Dropout1d(0.3), nn.Linear(32, 4)).train()
    keys = key_dropout(model, 0, MainProcess())
    compiled = torch.compile(model, backend=counting_inductor)
    inputs = torch.randn(6, 8)
    for step in (1, 2, 3):
        indices = torch.arange(6) * 7 + step
        with keys.keyed(indices, step, model):
            eager = model(inputs)
        with keys.keyed(indices, step, model):
            assert torch.allclose(compiled(inputs), eager, atol=1e-6), step
    assert len(traced) == 1


def test_a_run_with_keyed_dropout_leaves_no_loader_worker_behind_when_it_returns(tmp_path):
    """The Python API: a script that trains run after run finds the loader workers of the one before gone when train
    returns, not when the garbage collector next comes by (the keys the model's layers read once held the
    accelerator, which holds the model and the loaders: a cycle that kept 2 workers a run alive)."""
    import gc
    import multiprocessing

    gc.disable()  # only reference counting frees what a run leaves
    try:
        train_in_process("mnist_cnn", "data.synthetic=true", "data.on_device=false", "data.num_workers=2",
                         "data.train_subset=48", "data.eval_subset=8", "train.batch_size=12", "train.max_steps=2",
                         "train.plot=false", f"output_dir={tmp_path / 'run'}")
        left = multiprocessing.active_children()
    finally:
        gc.enable()
    assert not left, f"{len(left)} loader worker(s) outlived the run: {left}"
