"""`accel-train sweep`: a hyperparameter search in which every trial is a normal, resumable run.

    space.py    the search space as the command line gives it (`train.lr=loguniform(1e-4,1e-1)`), checked
                against the config keys before any trial; no Optuna, no torch
    study.py    Optuna's side: the study stored in the sweep folder, its seeded TPE sampler and median pruner
    trial.py    one trial: `accel-train train` under the launch command, its eval lines read as they are
                written, pruned by SIGTERM (the trial saves and exits 75)
    runner.py   the sweep: resume the trial that was running, then sample until N trials are done
    results.py  the sweep folder read back: the table by metric, the best trial and its train command

A sweep folder (output_dir):

    sweep.yaml         what the sweep searches (recipe, space, fixed settings, metric, seed): a rerun must match it
    study.journal      Optuna's journal storage: every trial's state, values and reports
    trial-0003/        a run folder like any other (`accel-train eval`, `train ... resume=auto`, `runs`, `plot`)
    logs/trial-0003.log  that trial's output
    curves.png         the best trials' curves, overlaid; parameters.png: the metric against each parameter
"""
