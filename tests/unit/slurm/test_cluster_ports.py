"""The test cluster names every port its daemons and sruns may take, so a test choosing ports
for its own services can stay out of them."""

from __future__ import annotations

import re
from pathlib import Path

from services.testing.slurm_cluster import SlurmCluster


def test_the_cluster_ports_cover_the_daemons_and_the_whole_srun_range(tmp_path: Path) -> None:
    cluster = SlurmCluster(tmp_path)
    conf = cluster._slurm_conf(tmp_path / "munge.socket")
    fields = dict(re.findall(r"^(\w+)=(\S+)$", conf, re.MULTILINE))
    low, high = (int(p) for p in fields["SrunPortRange"].split("-"))
    expected = {int(fields["SlurmctldPort"]), int(fields["SlurmdPort"]), *range(low, high + 1)}
    assert set(cluster.ports) == expected
