"""MLflow: one MLflow run per ddp_kit run (`pip install 'ddp_kit[mlflow]'`).

Settings are MLflow's own environment variables: MLFLOW_TRACKING_URI (else MLflow's default store),
MLFLOW_EXPERIMENT_NAME or MLFLOW_EXPERIMENT_ID (else the Default experiment), the credentials
variables of your server, and MLFLOW_HTTP_REQUEST_TIMEOUT / MLFLOW_HTTP_REQUEST_MAX_RETRIES (how long
one request may take: 120 s and 7 retries by default; the hub gives up on a call after 30 s anyway).

Metrics are step-keyed and MLflow keeps every point it is sent, so a resumed attempt skips the steps
an earlier one sent (hub.py) and continues the same run (its status back to RUNNING; a run no longer
on the server, deleted or on another server, is started anew). The config goes
in as params when the run is created (params cannot change later); the versions and world size are
tags, updated by every attempt. An attempt ends the run as FINISHED, KILLED (preempted, interrupted)
or FAILED; the next attempt sets it RUNNING again."""
from __future__ import annotations

import os
import re
from typing import Any

from .base import Opening, Tracker

_KEY = re.compile(r"[^\w\-. /]")  # MLflow keys: alphanumerics, underscore, dash, period, space, slash
_STATUS = {0: "FINISHED", 75: "KILLED", 130: "KILLED"}


class MLflow(Tracker):
    package = "mlflow"
    extra = "mlflow"

    def open(self, opening: Opening) -> str:
        self.location = os.environ.get("MLFLOW_TRACKING_URI", "")
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient()
        self.location = client.tracking_uri
        tags = [RunTag(f"ddp_kit.{k}", str(v)) for k, v in opening.facts.items()]
        if opening.run_id is not None and _exists(client, opening.run_id):
            client.update_run(opening.run_id, status="RUNNING")
            self.run_id = opening.run_id
            client.log_batch(self.run_id, tags=tags)
            return self.run_id
        run = client.create_run(_experiment(client), run_name=opening.name, tags={t.key: t.value for t in tags})
        self.run_id = run.info.run_id
        params = [Param(_KEY.sub("_", k), str(v)) for k, v in _flat(opening.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per request
            client.log_batch(self.run_id, params=params[i:i + 100])
        return self.run_id

    def log(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        metrics = [Metric(_KEY.sub("_", k), v, ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, exit_code: int) -> None:
        self.client.set_terminated(self.run_id, status=_STATUS.get(exit_code, "FAILED"))


def _exists(client: Any, run_id: str) -> bool:
    """The run is on this server (False: deleted, or another server now: a new run, not a failed tracker)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise


def _experiment(client: Any) -> str:
    """MLFLOW_EXPERIMENT_ID, else MLFLOW_EXPERIMENT_NAME (created when missing), else MLflow's Default."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return "0"
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model_args": {"hidden": 64}} -> {"model_args.hidden": 64}"""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


TRACKER = MLflow
