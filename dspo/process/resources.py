"""Files the repository carries (`data/`): sample QA data, the HotpotQA dev corpus, the Qwen2.5 tokenizer.

Configs reach them through `${paths.data}` (conf/paths/default.yaml), which resolves to `$DSPO_DATA` when set, else to
this repository's `data/` folder, whatever the working directory. Sources and licences: `data/README.md`.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    """`$DSPO_DATA` if set, else `<repository>/data`."""
    override = os.environ.get("DSPO_DATA")
    return Path(override).expanduser() if override else REPO_ROOT / "data"


def data_file(*parts: str) -> Path:
    """A file under `data_dir()`; the error says where it was looked for and how to point elsewhere."""
    path = data_dir().joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: dspo reads its sample data from the repository's data/ folder "
            "(an editable install, `make setup`); set DSPO_DATA=/path/to/data to use a copy elsewhere"
        )
    return path


QWEN_TOKENIZER = ("tokenizers", "qwen2.5")
HOTPOTQA_DEV500 = ("hotpotqa_dev500",)
BENCHMARKS = ("benchmarks",)

OmegaConf.register_new_resolver("dspo.data_dir", lambda: str(data_dir()), replace=True)
