"""Training jobs (``python -m selfspec.train job=<name>``): heads, prompts, skips, ppd_tree, draft_vocab.

* :mod:`~selfspec.training.driver` — the one job skeleton (prepare → lock → load → track →
  objective → save → report) and the config checks every job shares;
* :mod:`~selfspec.training.loop` — the training loop (checkpoints, resume) of the jobs that train;
* one module per job, each only its own objective and data, declared as ``JOB``:
  :mod:`~selfspec.training.head_distillation` (``heads``), :mod:`~selfspec.training.prompt_tuning`
  (``prompts``), :mod:`~selfspec.training.skips` (``skips``), :mod:`~selfspec.training.ppd_tree`
  (``ppd_tree``), :mod:`~selfspec.training.draft_vocab` (``draft_vocab``);
* :mod:`~selfspec.training.continuations` (the target's own continuations the jobs learn from) and
  :mod:`~selfspec.training.bars` (progress bars).
"""
