"""File modes of what a run writes: the user's umask, as for any file they create.

``tempfile.mkstemp`` (our atomic checkpoint writes) and safetensors (weights) create files readable
by their owner only (0600), while the configs and tokenizers beside them get the umask's 0644; a
colleague or a serving job could read the tokenizer of an export but not its weights.
"""

from __future__ import annotations

import os
from pathlib import Path


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_current_umask()
"""The mode ``open()`` gives a new file under this process's umask (read at import)."""


def give_default_mode(*paths: Path | str) -> None:
    """Set ``FILE_MODE`` on each file, and on every file directly inside each directory."""
    for path in map(Path, paths):
        for file in path.iterdir() if path.is_dir() else [path]:
            if file.is_file():
                file.chmod(FILE_MODE)
