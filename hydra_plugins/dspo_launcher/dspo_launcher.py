"""dspo's Hydra launchers where Hydra looks for plugins (`hydra/launcher=local|slurm`; the code is
dspo.sweeps.launchers).

Without the cluster extra (Hydra's submitit plugin), the classes still exist so that Hydra's plugin scan stays quiet,
and selecting one says what to install."""

from __future__ import annotations

from typing import Any

try:
    from dspo.sweeps.launchers import LocalLauncherBase, SlurmLauncherBase
except ImportError as missing:  # pragma: no cover - the cluster extra is part of dev
    from hydra.plugins.launcher import Launcher

    _MISSING = str(missing)

    class _Missing(Launcher):
        def __init__(self, **params: Any) -> None:
            raise ImportError(_MISSING)

        def setup(self, **kwargs: Any) -> None: ...

        def launch(self, job_overrides: Any, initial_job_idx: int) -> Any: ...

    LocalLauncherBase = SlurmLauncherBase = _Missing  # type: ignore[misc, assignment]


class LocalLauncher(LocalLauncherBase):  # type: ignore[valid-type, misc]
    """`hydra/launcher=local`: dspo.sweeps.launchers.LocalLauncherBase."""


class SlurmLauncher(SlurmLauncherBase):  # type: ignore[valid-type, misc]
    """`hydra/launcher=slurm`: dspo.sweeps.launchers.SlurmLauncherBase."""
