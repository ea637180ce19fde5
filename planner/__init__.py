"""The layout planner behind ``tools/plan.py``: what to rent and how to split the model on it.

One job per module:

* ``inputs`` — the model and batch from a preset, a Hugging Face config or Megatron's flags;
  ``presets``, ``model_spec`` (sizes, parameter counts, FLOPs), ``hardware`` (GPUs and links);
* ``candidate`` — one way to run (split, schedule, micro-batch, recompute, layout) and its flags;
* ``activations`` and ``memory`` — bytes per rank, walked along the real schedule tables;
* ``costs`` and ``step_time`` — seconds per action and collective, the simulator over the tables;
* ``layouts`` — layout strings that balance stages, the embedding and the loss included;
* ``search`` — every candidate, rejections grouped by reason, ranked by simulated step;
* ``report`` and ``cli`` — the table, the JSON line and the command line;
* ``live_bytes`` and ``dry_run`` — the real stages built under fake tensors, their memory counted;
* ``profile`` — per-layer costs measured here; ``rebalance`` — a layout from a real run's timeline;
* ``megatron_formula`` — Megatron's theoretical memory formula, for comparison.
"""
