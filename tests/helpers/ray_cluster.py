"""A local Ray cluster for tests/launch/test_ray.py, held for as long as this process's stdin is open.

    python ray_cluster.py TEMP_DIR NUM_CPUS    writes TEMP_DIR/address (the GCS address) once up

`ray.init()` here starts the head's processes (GCS, raylet, workers) as children of this one, and
`ray.shutdown()` stops exactly those when the test closes our stdin: no `ray stop`, which would
stop every Ray on the machine.
"""
import sys
from pathlib import Path

import ray

temp_dir, num_cpus = Path(sys.argv[1]), int(sys.argv[2])
ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(temp_dir), log_to_driver=False)
address = ray.get_runtime_context().gcs_address
(temp_dir / "address.tmp").write_text(address)
(temp_dir / "address.tmp").rename(temp_dir / "address")  # whole or absent
sys.stdin.read()
ray.shutdown()
