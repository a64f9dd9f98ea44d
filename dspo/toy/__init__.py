"""The embedded default: everything `dspo-train` needs to run with no arguments, and nothing the framework needs.

A toy multi-hop world (`world`: invented entities, a passage corpus, 1-hop and 2-hop questions in disjoint entity
splits), a tokenizer trained on it (`tokenizer`), a tiny Qwen2-architecture model (`model`), scripted tool-use
demonstrations and name-recall drills (`demos`, `drills`), and the SFT warm start that turns the random model into a
search agent (`warmstart`). It plugs into the framework through the same config groups a real setup uses:
`prepare=toyworld` (builds it once, cached), `model=tiny`, `data=toyworld`, `retriever=toyworld`.

Nothing in `dspo` outside this package imports it; configs, entry points, tests and benchmarks do.
"""
