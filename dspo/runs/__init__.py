"""A run's files: its record (`record`), what is trusted from elsewhere (`trust`), which checkpoint a command resumes
(`resume`) and atomic checkpoint files (`checkpoint_files`). No Lightning: tools read a run without it."""
