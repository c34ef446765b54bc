"""Black-box strategy ``tpe``: Optuna's TPE sampler over the knobs, for spaces too large for a grid and
with no findings to steer by. Optional: ``pip install 'tracelens[tune]'``.

Optuna keeps its study in its RDB storage on the sweep's own SQLite file (``sqlite:///OUT/sweep.sqlite``;
its tables sit beside the ``autotune_*`` ones), so the sampler's history survives a kill like the
trials do; the same URL lets sweeps on several machines share one study. Each knob is a categorical
parameter whose choices are the JSON text of its values (lists such as recompute_layer_ids included).

Trials themselves still go through :meth:`Sweep.evaluate`: a point that already finished is told to
the sampler from the store and never run again, a point the constraints reject is told as pruned, and
a failed trial is told as failed. A trial a killed sweep was running is enqueued again first.
"""

from __future__ import annotations

import json

from .space import key_of

MAX_STALE_ASKS = 200  # consecutive suggestions that were all visited or disallowed: the sampler is done


def missing() -> str | None:
    """Why the strategy cannot run here (one line), or None: the sweep checks this before it opens its store."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        return ("strategy tpe needs Optuna, which is not installed: pip install 'tracelens[tune]' "
                "(or use --strategy guided, grid or random)")
    return None


def run_tpe(sweep) -> str:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space, store = sweep.space, sweep.store
    storage = optuna.storages.RDBStorage(f"sqlite:///{store.path.resolve()}",
                                         engine_kwargs={"connect_args": {"timeout": 30}})
    study = optuna.create_study(study_name="autotune", storage=storage, load_if_exists=True,
                                direction="maximize" if space.maximize else "minimize",
                                sampler=optuna.samplers.TPESampler(seed=sweep.seed))
    dists = {k: optuna.distributions.CategoricalDistribution([json.dumps(v) for v in vals])
             for k, vals in space.knobs.items()}
    state = optuna.trial.TrialState
    for ft in study.get_trials(deepcopy=False, states=(state.RUNNING, state.WAITING)):
        if ft.state == state.RUNNING:  # asked by a sweep that was killed before telling
            storage.set_trial_state_values(ft._trial_id, state.FAIL)
    for t in store.running():  # run again first what the killed sweep never finished
        study.enqueue_trial({k: json.dumps(v) for k, v in t["knobs"].items()}, skip_if_exists=False)
    sweep.visited = [t["key"] for t in store.trials(finished_only=True)]
    n_points, stale = len(space.grid()), 0
    while sweep.budget_left():
        trial = study.ask(dists)
        point = {k: json.loads(trial.params[k]) for k in space.knobs}
        if not space.allowed(point):
            study.tell(trial, state=state.PRUNED)
            stale += 1
        elif key_of(point) in sweep.visited:
            done = store.done(key_of(point))
            if done is not None and done["status"] == "ok":
                study.tell(trial, done["objective"])
            else:
                study.tell(trial, state=state.FAIL)
            stale += 1
        else:
            stale = 0
            t = sweep.evaluate(point, f"TPE suggestion (Optuna trial {trial.number})")
            if t["status"] == "ok":
                study.tell(trial, t["objective"])
            else:
                study.tell(trial, state=state.FAIL)
        if len(set(sweep.visited)) >= n_points:
            return "every allowed point run"
        if stale >= MAX_STALE_ASKS:
            return "the sampler keeps proposing visited or disallowed points"
    return "budget spent"
