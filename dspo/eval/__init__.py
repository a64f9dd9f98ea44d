"""Evaluation: `pipeline` (greedy predict -> score -> write, shared by validation during training and the CLI) and
`cli` (`dspo-eval`: load a model folder or a training checkpoint, evaluate the benchmarks, write the results)."""
