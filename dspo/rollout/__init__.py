"""dspo.rollout: where a trainer's rounds come from. It builds on the engines (`dspo.engines`), the environment
(`dspo.env`) and the agent (`dspo.agent`); nothing here imports Lightning (`dspo.callbacks` drives it).

- `settings`: the rollout config (`callbacks.rollout`), checked into one record, `RolloutSettings`.
- `producer`: `RoundProducer`, a rank's rounds and the one round state, `RoundState`, which only it writes; round
  building itself is `dspo.data.round_builder`.
- `sides`: the engine's two homes, seen from the trainer: `InProcessSide` (max_staleness 0) and `EngineProcessSide`
  (k >= 1); both return a round as a `RoundResult`.
- `engine_process`: the trainer's handle on the engine process (`EngineProcess`); `engine_process_main`: what runs
  in it (`serve`, `EngineProcessLoop`); `messages`: what the two say to each other; `channel`: the reply pipe.
- `spec`: what an engine side is built from (`WorkerSpec`), each round's seed.
- `sampler`: `RoundSampler`, prompts -> kept groups (engine calls, the filter, the keep-rate prior); `tally`: a
  round's statistics, counted call by call; `roles`: per-role groups and statistics.
- `transfer`: weights into the engine process; `placement`: its cores, threads and GPUs; `faults`: fault points
  for the tests; `store`: the collective transfers' key store; `link`: what the producer needs of a trainer
  (`TrainerLink`); `cli`: the `dspo-rollout` command.
"""
