"""Contracts of what a distributed run says when it stops: a stop under a launcher that restarts says that the
restart resumes, not to run the command again; a collective that fails because another process is gone is one line,
not gloo's traceback."""

from types import SimpleNamespace

import pytest

from accel_train import hooks
from accel_train.cli import main
from accel_train.distributed.signals import StopSignals

TINY = ["mnist_cnn", "data.synthetic=true", "data.train_subset=24", "data.eval_subset=10", "train.batch_size=12",
        "train.max_steps=2", "train.plot=false", "train.log_with=none"]


@pytest.mark.parametrize("restarts, told", [
    ({}, "run the same command with resume=auto to continue"),
    ({"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"},
     "a restart by the launcher resumes from it (--max_restarts); else run the same command with resume=auto"),
    ({"TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_MAX_RESTARTS": "3"},
     "run the same command with resume=auto to continue"),  # no restart left
], ids=["plain", "restarts left", "none left"])
def test_a_stop_says_how_the_run_goes_on_under_the_launcher_it_runs_under(monkeypatch, restarts, told):
    for name, value in restarts.items():
        monkeypatch.setenv(name, value)
    signals = StopSignals(SimpleNamespace(process_index=0, num_processes=1))
    signals.received = "SIGTERM"
    assert signals.stop_message(12, "runs/a/checkpoints/step-00000012") == (
        f"stopped by SIGTERM at step 12; checkpoint saved in runs/a/checkpoints/step-00000012; {told}")


def test_a_stop_whose_save_was_skipped_says_the_newest_committed_checkpoint_resumes():
    signals = StopSignals(SimpleNamespace(process_index=0, num_processes=1))
    signals.received = "SIGTERM"
    assert signals.stop_message(12, None).startswith(
        "stopped by SIGTERM at step 12; its checkpoint skipped (the newest committed one resumes); ")


class PeerGone(hooks.Hooks):
    """The gradient all-reduce fails as gloo's transport fails when another process died."""

    def after_forward(self, phase, step, model, batch, outputs):
        if phase == "train" and step == 2:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                               "[127.0.0.1]:43211")
        return outputs


def test_a_collective_that_fails_for_a_lost_peer_is_one_line_and_exit_1(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop, hooks.added(PeerGone()):
        main(["train", *TINY, f"output_dir={tmp_path}"])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.startswith("accel-train: error:")]
    assert stop.value.code == 1 and "Traceback" not in stderr and len(lines) == 1, stderr
    assert lines[0] == ("accel-train: error: a collective failed ([../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                        "Connection closed by peer [127.0.0.1]:43211): another process died or stopped answering "
                        "(its own log says why); under --max_restarts the launcher restarts the group, which resumes "
                        "from the newest checkpoint")


def test_any_other_error_keeps_its_traceback(tmp_path):
    class Bug(hooks.Hooks):
        def after_forward(self, phase, step, model, batch, outputs):
            raise RuntimeError("a bug of ours, not a lost peer")

    with pytest.raises(RuntimeError, match="a bug of ours"), hooks.added(Bug()):
        main(["train", *TINY, f"output_dir={tmp_path}"])
