"""Training jobs (``python -m selfspec.train job=<name>``): heads, prompts, skips, ppd_tree, draft_vocab.

* :mod:`~selfspec.training.driver` — the one job skeleton (prepare → lock → load → track →
  objective → save → report) and the config checks every job shares;
* :mod:`~selfspec.training.loop` — the training loop (checkpoints, resume) of the jobs that train;
* one module per job (``heads``, ``prompts``, ``skips``, ``tree``, ``draft_vocab``), each only its
  own objective and data, declared as ``JOB``.
"""
