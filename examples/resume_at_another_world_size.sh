#!/usr/bin/env bash
# The proof that a run is a function of its config, not of its machines (docs/checkpoints.md):
# train at 2 processes without stopping; train again at 2 and stop it in the middle of an epoch (SIGTERM to
# the launcher, as a preemption: it saves the step it stops at); continue that checkpoint at 3 processes and,
# from a copy, at 1; then compare both with the uninterrupted run.
#
#   bash examples/resume_at_another_world_size.sh [OUTPUT_ROOT] [KEY=VALUE ...]
#
# PROFILE (default: the shipped multi_gpu profile, which forms a gloo group on CPUs), STOP_AFTER_STEP (default 300:
# 100 steps into the second of 2 epochs of 200) and LAUNCH_TARGET (default: -m accel_train; a script that wraps the
# CLI instead, as the test suite's tests/launched_probe.py does) may be set in the environment. The model's dropout
# is keyed by sample (train.keyed_dropout), so its masks are the same at any world size.
set -euo pipefail

root=${1:-runs/world_size}
shift || true
profile=${PROFILE:-$(accel-train profile multi_gpu)}
stop_after=${STOP_AFTER_STEP:-300}
read -r -a target <<< "${LAUNCH_TARGET:--m accel_train}"
run=(fashion_mnist_cnn train.batch_size=96 data.train_subset=19200 train.epochs=2
     train.log_every_steps=25 checkpoint.at_epoch_end=false train.plot=false "$@")
rm -rf "$root"

train_at() {  # train_at PROCESSES OUTPUT_DIR [KEY=VALUE ...]
    local processes=$1 out=$2
    shift 2
    accelerate launch --config_file "$profile" --num_processes "$processes" "${target[@]}" train "${run[@]}" \
        "output_dir=$out" "$@"
}

echo "== 1. uninterrupted, 2 processes"
train_at 2 "$root/uninterrupted"

echo "== 2. the same run at 2 processes, stopped by SIGTERM once step $stop_after is logged"
train_at 2 "$root/stopped" &
launcher=$!
until grep -qs "\"step\": $stop_after," "$root/stopped/metrics.jsonl"; do
    kill -0 "$launcher" 2>/dev/null || { echo "the run ended before step $stop_after"; exit 1; }
    sleep 0.2
done
# The launcher is the child of the background shell: signal it, as a scheduler preempting the job would.
pkill -TERM -P "$launcher" || { echo "the run ended before it could be stopped: raise the steps"; exit 1; }
wait "$launcher" || true  # each process saves the step it stops at and exits 75; the launcher exits 1
if [ -f "$root/stopped/model.safetensors" ] || ! ls -d "$root/stopped/checkpoints/step-"* >/dev/null 2>&1; then
    echo "the run ended before the stop took effect: raise the steps after STOP_AFTER_STEP"; exit 1
fi
cp -r "$root/stopped" "$root/stopped_then_1"

echo "== 3. continued at 3 processes, and from a copy at 1"
train_at 3 "$root/stopped" resume=auto
train_at 1 "$root/stopped_then_1" resume=auto

echo "== 4. compared with the uninterrupted run"
python - "$root" <<'EOF'
import json, sys
from pathlib import Path
from safetensors.torch import load_file

root = Path(sys.argv[1])
def lines(run): return [json.loads(text) for text in (root / run / "metrics.jsonl").read_text().splitlines()]
reference = load_file(str(root / "uninterrupted" / "model.safetensors"))
final = {run: [line for line in lines(run) if line["split"] == "test"][-1] for run in
         ("uninterrupted", "stopped", "stopped_then_1")}
for run, label in (("stopped", "2 -> 3"), ("stopped_then_1", "2 -> 1")):
    weights = load_file(str(root / run / "model.safetensors"))
    whole = float(sum((weights[k] - v).square().sum() for k, v in reference.items()).sqrt()
                  / sum(v.square().sum() for v in reference.values()).sqrt())
    worst = max(float((weights[k] - v).norm() / v.norm()) for k, v in reference.items())
    losses = [(a["loss"], b["loss"]) for a, b in zip(lines("uninterrupted"), lines(run)) if a["split"] == "train"]
    loss_gap = max(abs(a - b) / abs(a) for a, b in losses)
    stop = [json.loads(s) for s in (root / run / "starts.jsonl").read_text().splitlines()][-1]
    print(f"{label} processes (resumed at step {stop['step']}): weights differ by {whole:.1e} (relative, whole "
          f"model; {worst:.1e} in the worst tensor); train losses by at most {loss_gap:.1e} over {len(losses)} lines; test accuracy "
          f"{final[run]['accuracy']:.4f} vs {final['uninterrupted']['accuracy']:.4f} uninterrupted, loss "
          f"{final[run]['loss']:.6f} vs {final['uninterrupted']['loss']:.6f}")
EOF
