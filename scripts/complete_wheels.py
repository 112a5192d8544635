"""Print the requirements a wheel directory still lacks for an older Python 3.11.x.

pip evaluates environment markers against the interpreter that runs it, so wheels
downloaded on Python 3.11.7 lack what a dependency needs only below that
(`async-timeout; python_full_version < "3.11.3"` of redis, for Debian's 3.11.2). This
reads every wheel's Requires-Dist, evaluates the markers for CPython 3.11.0 on Linux and
prints each requirement whose project has no wheel in the directory yet.
Usage: python scripts/complete_wheels.py WHEEL_DIR
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

TARGET = {"python_version": "3.11", "python_full_version": "3.11.0",
          "implementation_version": "3.11.0", "sys_platform": "linux",
          "platform_system": "Linux", "os_name": "posix", "extra": ""}


def requires_dist(wheel: Path) -> list[str]:
    """The Requires-Dist lines of one wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    return metadata.get_all("Requires-Dist") or []


def missing(wheel_dir: Path) -> list[str]:
    """Requirements needed on the target Python that no wheel in wheel_dir provides."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    present = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels}
    lacking: dict[str, str] = {}
    for wheel in wheels:
        for line in requires_dist(wheel):
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            name = canonicalize_name(req.name)
            if name in present or (req.marker and not req.marker.evaluate(TARGET)):
                continue
            lacking[name] = f"{req.name}{req.specifier}"
    return sorted(lacking.values())


if __name__ == "__main__":
    print("\n".join(missing(Path(sys.argv[1]))))
