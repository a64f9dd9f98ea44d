"""Sweeps: launchers (`launchers`), each job's status file (`status`, `job`), the ablation report (`report`, `analysis`)
and Pareto fronts (`pareto_front`)."""
