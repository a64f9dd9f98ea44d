"""dspo.rollout: where a trainer's rounds come from: the round sampler (prompts -> kept groups, `sampler`), the round
producer (`producer`) and its engine sides (`sides`: in this process, or an engine process: `worker` is the trainer's
handle, `serve` the process's loop, `messages` what they say), weight transfer (`transfer`), placement (`placement`),
fault points (`faults`) and what it needs of a trainer (`link`). It builds on the engines (`dspo.engines`), the
environment (`dspo.env`) and the agent (`dspo.agent`); nothing here imports Lightning (`dspo.callbacks` drives it)."""
