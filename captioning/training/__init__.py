"""Training: the loop (:mod:`~captioning.training.train`, ``fit``), what a run carries and
its checkpoints hold (:mod:`~captioning.training.run_state`), the run folder and its lock
(:mod:`~captioning.training.run_folder`), the optimiser and learning-rate schedule
(:mod:`~captioning.training.optim`). The objectives it trains are in
:mod:`captioning.objectives`."""
