"""The throwaway TRL environment of `bench/vs_trl.py`: a venv that sees this environment's packages (torch,
transformers, ...) through a .pth file and adds only TRL and what it lacks, pinned so that nothing of ours is replaced.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
from pathlib import Path


def probe_trl(python: Path) -> dict | None:
    code = (
        "import json, torch, transformers, trl, accelerate\n"
        "print(json.dumps({'trl': trl.__version__, 'accelerate': accelerate.__version__, 'torch': torch.__version__,"
        " 'transformers': transformers.__version__, 'torch_file': torch.__file__, 'tf_file': transformers.__file__}))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else None


def ensure_trl_venv(venv: Path, version: str, fresh: bool) -> dict:
    """Throwaway venv that sees this environment's packages and adds TRL (+ its missing deps) on top."""
    import venv as venv_module
    from importlib.metadata import distributions

    ours = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    python = venv / "bin" / "python"
    if fresh and venv.exists():
        shutil.rmtree(venv)
    info = probe_trl(python) if python.exists() else None
    if info is None or info["trl"] != version:
        print(f"building the TRL environment in {venv} (trl=={version}) ...", flush=True)
        venv_module.EnvBuilder(with_pip=True, clear=True).create(venv)
        site = subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
        lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in ours)
        Path(site, "_dspo_environment.pth").write_text(lines)
        pins = {d.metadata["Name"]: d.version for d in distributions() if d.metadata["Name"]}
        pins.pop("dspo", None)
        constraints = venv / "constraints.txt"  # pip may add packages, never replace ours
        constraints.write_text("".join(f"{name}=={v}\n" for name, v in sorted(pins.items())))
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-c", str(constraints)]
        done = subprocess.run([*pip, f"trl=={version}"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip install trl=={version} failed in {venv}:\n{done.stdout}\n{done.stderr}")
        info = probe_trl(python)
        if info is None:
            raise RuntimeError(f"TRL environment {venv}: `import trl` fails after installing trl=={version}")
    for key in ("torch_file", "tf_file"):
        if not any(info[key].startswith(p) for p in ours):
            raise RuntimeError(f"TRL environment uses its own {info[key]}; rebuild with --fresh-trl-venv")
    return info
