"""The learner's side: the LightningModule that holds the policy and the frozen reference (`module`), a step's
statistics (`step_stats`), strategies (FSDP2), loggers, the switch matrix (`combinations`) and the GPU check
(`gpu_check`). docs/architecture.md has the map."""
