"""The collapse guard (issue 55): detectors on every round (`detectors`), rollback to the newest healthy checkpoint
with a smaller step (`rollback`), and the Lightning callback that runs them and reports (`callback`, config `guard`)."""
