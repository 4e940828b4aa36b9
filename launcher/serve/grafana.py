"""A Grafana dashboard of the exporter's series (launcher.serve.exporter): pure, one JSON document.

Importable (Dashboards > New > Import) and provisionable (a file in a dashboards provider's
folder). A ``run`` variable (the runs the exporter knows, several at once) and a ``datasource``
variable (the site's Prometheus). Panels: state, loss, throughput, MFU, steps, checkpoint age,
attempts started and ended by why, per-rank seconds per step (a heatmap: a slow rank is a hot
row), each rank's compute against the others' median, the slow ranks, and, where a site runs NVIDIA's DCGM exporter, GPU utilisation, memory,
power and XID errors of the nodes the selected runs' ranks are on; where slurmctld serves its own
metrics (SLURM 26.05's metrics/openmetrics), the queue by partition, the nodes' states and the
controller's requeues (DCGM's ``Hostname`` label against
the node the ranks report, as a filter: ``DCGM_... and on (Hostname) label_replace(...)``).

Every expression is in :data:`EXPRESSIONS` (the panels are built from them), so a test can run
each against a real Prometheus (tests/unit/test_metrics.py).
"""

from __future__ import annotations

from typing import Any

RUN = 'run=~"$run"'
# The nodes the selected runs' ranks are on, labelled as DCGM labels its series (Hostname)
_NODES = f'label_replace(group by (node) (lmlaunch_rank_step_seconds{{{RUN}}}), "Hostname", "$1", "node", "(.*)")'


def _dcgm(metric: str) -> str:
    """DCGM's series of those nodes, values untouched (``and`` filters: two runs on one node are no
    many-to-many match, as a multiplying join would be)."""
    return f"{metric} and on (Hostname) {_NODES}"


# (title, expression, legend, unit, kind); kind: timeseries | heatmap | stat
PANELS: tuple[tuple[str, str, str, str, str], ...] = (
    ("State", f"lmlaunch_run_info{{{RUN}}}", "{{run}} {{state}} (job {{job_id}})", "none", "stat"),
    ("Training loss", f"lmlaunch_run_train_loss{{{RUN}}}", "{{run}}", "none", "timeseries"),
    ("Throughput", f"lmlaunch_run_tokens_per_second{{{RUN}}}", "{{run}}", "short", "timeseries"),
    ("MFU", f"lmlaunch_run_mfu_ratio{{{RUN}}}", "{{run}}", "percentunit", "timeseries"),
    ("Step of max_steps", f"lmlaunch_run_step{{{RUN}}} / lmlaunch_run_max_steps{{{RUN}}}", "{{run}}",
     "percentunit", "timeseries"),
    ("Checkpoint age", f"lmlaunch_run_checkpoint_age_seconds{{{RUN}}}", "{{run}}", "s", "timeseries"),
    ("Attempts started", f"lmlaunch_run_attempts_started_total{{{RUN}}}", "{{run}}", "none", "timeseries"),
    ("Attempts ended, by why", f"sum by (run, reason) (lmlaunch_run_attempts_ended_total{{{RUN}}})",
     "{{run}} {{reason}}", "none", "timeseries"),
    ("Restarts inside the allocation", f"lmlaunch_run_restarts_in_place_total{{{RUN}}}", "{{run}}", "none",
     "timeseries"),
    ("Steps trained again after stops", f"lmlaunch_run_steps_lost_total{{{RUN}}}", "{{run}}", "none", "timeseries"),
    ("Queue wait (submission or requeue to start)", f"lmlaunch_run_queue_wait_seconds_total{{{RUN}}}", "{{run}}", "s",
     "timeseries"),
    ("Goodput (training over allocated seconds)", f"lmlaunch_run_goodput_ratio{{{RUN}}}", "{{run}}", "percentunit",
     "timeseries"),
    ("GPU-hours held (training: goodput in GPU-hours)",
     f'label_replace(lmlaunch_run_gpu_hours_total{{{RUN}}}, "of", "held", "", "") or '
     f'label_replace(lmlaunch_run_training_gpu_hours_total{{{RUN}}}, "of", "training", "", "")',
     "{{run}} {{of}}", "none", "timeseries"),
    ("Model states held by the worst rank", f"lmlaunch_run_model_states_held_bytes{{{RUN}}}", "{{run}}", "bytes",
     "timeseries"),
    ("Model states planned per rank", f"lmlaunch_run_model_states_planned_bytes{{{RUN}}}", "{{run}}", "bytes",
     "timeseries"),
    ("Peak memory planned per rank", f"lmlaunch_run_device_peak_planned_bytes{{{RUN}}}", "{{run}}", "bytes",
     "timeseries"),
    ("Compute per step, by rank (forward)", f'lmlaunch_rank_step_seconds{{{RUN}, part="forward"}}',
     "{{run}} rank {{rank}} ({{node}})", "s", "heatmap"),
    ("Waits per step, by rank (backward + boundary)",
     f'sum by (run, rank, node) (lmlaunch_rank_step_seconds{{{RUN}, part=~"backward|boundary"}})',
     "{{run}} rank {{rank}} ({{node}})", "s", "timeseries"),
    ("Compute against the other ranks' median", f"lmlaunch_rank_compute_ratio{{{RUN}}}",
     "{{run}} rank {{rank}} ({{node}})", "none", "timeseries"),
    ("Slow ranks (stragglers)", f"lmlaunch_run_slow_ranks{{{RUN}}}", "{{run}}", "none", "timeseries"),
    ("Why the run waits (SLURM's pending reason)", f"lmlaunch_run_pending_reason{{{RUN}}}", "{{run}}: {{reason}}",
     "none", "stat"),
    ("GPU utilisation (DCGM)", _dcgm("DCGM_FI_DEV_GPU_UTIL"), "{{Hostname}} gpu {{gpu}}", "percent",
     "timeseries"),
    ("GPU memory used (DCGM)", _dcgm("DCGM_FI_DEV_FB_USED"), "{{Hostname}} gpu {{gpu}}", "decmbytes",
     "timeseries"),
    ("GPU power (DCGM)", _dcgm("DCGM_FI_DEV_POWER_USAGE"), "{{Hostname}} gpu {{gpu}}", "watt", "timeseries"),
    ("GPU XID errors (DCGM)", _dcgm("DCGM_FI_DEV_XID_ERRORS"), "{{Hostname}} gpu {{gpu}}", "none",
     "timeseries"),
)
# The controller's own series (slurmctld with MetricsType=metrics/openmetrics, SLURM 26.05 here: GET
# /metrics/{jobs,nodes,partitions,scheduler} on SlurmctldPort, slurmctld(8)): the queue, the nodes'
# states, the requeues. In the dashboard only where the cluster serves them (dashboard(controller=...)).
CONTROLLER_PANELS: tuple[tuple[str, str, str, str, str], ...] = (
    ("Queue: pending jobs by partition (slurmctld)", "slurm_partition_jobs_pending", "{{partition}}", "none",
     "timeseries"),
    ("Queue: running jobs by partition (slurmctld)", "slurm_partition_jobs_running", "{{partition}}", "none",
     "timeseries"),
    ("Nodes by state (slurmctld)", '{__name__=~"slurm_nodes_(idle|alloc|mixed|down|drain|fail|completing)"}',
     "{{__name__}}", "none", "timeseries"),
    ("Jobs requeued, preempted, failed with a node (slurmctld)",
     '{__name__=~"slurm_jobs_(requeued|preempted|node_failed|expediting)"}', "{{__name__}}", "none", "timeseries"),
    ("Scheduler: jobs in the main and backfill queues (slurmctld)",
     '{__name__=~"slurm_(schedule_queue_len|bf_queue_len)"}', "{{__name__}}", "none", "timeseries"),
)
CONTROLLER_PATHS = ("/metrics/jobs", "/metrics/nodes", "/metrics/partitions", "/metrics/scheduler")
CONTROLLER_EXPRESSIONS: tuple[str, ...] = tuple(p[1] for p in CONTROLLER_PANELS)
EXPRESSIONS: tuple[str, ...] = tuple(p[1] for p in PANELS)
DCGM = tuple(p[1] for p in PANELS if "DCGM_" in p[1])  # series only where a site runs NVIDIA's DCGM exporter
# series only while a selected run's job waits in the queue (SLURM's pending reason)
WAITING_ONLY = tuple(p[1] for p in PANELS if "pending_reason" in p[1])
# series only on a device whose peak FLOPs lmtrain knows (a GPU): MFU, besides DCGM's;
# ... and of a GPU job (GPU-hours; the local cluster's `cluster up --gpus` has them, with no device)
DEVICE_ONLY = DCGM + tuple(p[1] for p in PANELS if "mfu" in p[1] or "gpu_hours" in p[1])


def dashboard(title: str = "lmlaunch runs", *, controller: bool = False) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schemaVersion 39); with ``controller``, the panels of
    slurmctld's own series too (a cluster that serves them: MetricsType=metrics/openmetrics)."""
    panels = []
    for i, (name, expr, legend, unit, kind) in enumerate(PANELS + (CONTROLLER_PANELS if controller else ())):
        panels.append({
            "id": i + 1, "type": kind, "title": name,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 4 if kind == "stat" else 8, "w": 24 if kind == "stat" else 12,
                        "x": 0 if kind == "stat" or i % 2 else 12, "y": i * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": "A", "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}],
            **({"options": {"calculate": False, "yAxis": {"unit": unit}}} if kind == "heatmap" else {}),
        })
    return {
        "title": title, "uid": "lmlaunch-runs", "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "tags": ["lmlaunch", "slurm", "training"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "run", "type": "query", "label": "Run", "multi": True, "includeAll": True, "allValue": ".*",
             "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 2,
             "query": {"query": "label_values(lmlaunch_run_info, run)", "refId": "run"},
             "definition": "label_values(lmlaunch_run_info, run)"},
        ]},
        "panels": panels,
    }
