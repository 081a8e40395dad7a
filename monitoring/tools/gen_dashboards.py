#!/usr/bin/python3
"""Generates the Grafana dashboards in monitoring/grafana/dashboards/ from this file.

The JSON files are committed so Grafana's file provisioning can load them as they are; this
script is their source. Edit the panels here, run it, commit both:

    monitoring/tools/gen_dashboards.py            # rewrite the JSON files
    monitoring/tools/gen_dashboards.py --check    # exit 1 if a JSON file is not what this writes

Generating keeps the four dashboards uniform (datasource variable, job/instance filters, panel
ids, layout), which hand-edited JSON drifts away from. Metric names: docs/METRICS.md.
Standard library only.
"""

import argparse
import json
import os
import sys

DS = {"type": "prometheus", "uid": "${datasource}"}

# The filter every query of a dashboard applies: `%F` in an expression below becomes this.
FILTER = 'job=~"$job", instance=~"$instance"'

# Worker-side pool metrics come from two scrape jobs other than the controller's, so the
# controller dashboard selects them by these jobs rather than by its $job variable.
POOL_JOBS = 'job=~"offload-optimizer-server|offload-trainer-worker"'

RATE = "$__rate_interval"


def q(expr):
    return expr.replace("%F", FILTER)


def rate(metric, fn="rate", matchers="%F", window=RATE):
    """fn(metric{matchers}[window]), the dashboard filter by default."""
    return q(f"{fn}({metric}{{{matchers}}}[{window}])")


def increase(metric, matchers="%F", window=RATE):
    return rate(metric, "increase", matchers, window)


def hq(quantile, metric, by="le"):
    """histogram_quantile over the rate of METRIC_bucket, aggregated by BY."""
    return f"histogram_quantile({quantile}, sum by ({by}) ({rate(metric + '_bucket')}))"


def hmean(metric, by=None):
    """Mean of a histogram over the rate window: rate(_sum) / rate(_count)."""
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} ({rate(metric + '_sum')}) / {agg} ({rate(metric + '_count')})"


class Dashboard:
    """Collects panels and lays them out left to right, 24 columns wide, rows top to bottom."""

    def __init__(self, uid, title, description, variables):
        self.uid, self.title, self.description = uid, title, description
        self.variables = variables
        self.panels = []
        self.next_id = 1
        self.x = self.y = self.line_h = 0

    def _place(self, w, h):
        if self.x + w > 24:
            self.y += self.line_h
            self.x = self.line_h = 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.line_h = max(self.line_h, h)
        return pos

    def _id(self):
        i = self.next_id
        self.next_id += 1
        return i

    def row(self, title):
        if self.x:
            self.y += self.line_h
            self.x = self.line_h = 0
        self.panels.append({"collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                            "id": self._id(), "panels": [], "title": title, "type": "row"})
        self.y += 1

    def _targets(self, targets, table=False):
        out = []
        for i, t in enumerate(targets):
            expr, legend = t if isinstance(t, tuple) else (t, "")
            target = {"datasource": DS, "editorMode": "code", "expr": expr,
                      "legendFormat": legend, "refId": chr(ord("A") + i)}
            if table:
                target.update(format="table", instant=True, range=False)
            else:
                target.update(range=True)
            out.append(target)
        return out

    def timeseries(self, title, description, targets, unit, w=12, h=8, stack=False, bars=False,
                   min=0, max=None, log2=False, threshold=None):
        custom = {
            "drawStyle": "bars" if bars else "line",
            "fillOpacity": 60 if bars else (30 if stack else 10),
            "lineWidth": 1,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"group": "A", "mode": "normal" if stack else "none"},
            "scaleDistribution": {"type": "log", "log": 2} if log2 else {"type": "linear"},
            "thresholdsStyle": {"mode": "line" if threshold is not None else "off"},
        }
        steps = [{"color": "green", "value": None}]
        if threshold is not None:
            steps.append({"color": "red", "value": threshold})
        defaults = {"color": {"mode": "palette-classic"}, "custom": custom, "unit": unit,
                    "thresholds": {"mode": "absolute", "steps": steps}}
        if min is not None and not log2:
            defaults["min"] = min
        if max is not None:
            defaults["max"] = max
        self.panels.append({
            "datasource": DS, "description": description,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "gridPos": self._place(w, h), "id": self._id(),
            "options": {"legend": {"calcs": [], "displayMode": "list", "placement": "bottom",
                                   "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": self._targets(targets), "title": title, "type": "timeseries",
        })

    def stat(self, title, description, expr, unit, w=4, h=4, threshold=None, red_below=None):
        steps = [{"color": "green", "value": None}]
        if threshold is not None:
            steps.append({"color": "red", "value": threshold})
        if red_below is not None:
            steps = [{"color": "red", "value": None}, {"color": "green", "value": red_below}]
        self.panels.append({
            "datasource": DS, "description": description,
            "fieldConfig": {"defaults": {"color": {"mode": "thresholds"}, "unit": unit,
                                         "thresholds": {"mode": "absolute", "steps": steps}},
                            "overrides": []},
            "gridPos": self._place(w, h), "id": self._id(),
            "options": {"colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                        "orientation": "auto", "textMode": "auto",
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
            "targets": self._targets([expr]), "title": title, "type": "stat",
        })

    def table(self, title, description, expr, hide, w=24, h=8):
        self.panels.append({
            "datasource": DS, "description": description,
            "fieldConfig": {"defaults": {"custom": {"align": "auto", "filterable": True}},
                            "overrides": []},
            "gridPos": self._place(w, h), "id": self._id(),
            "options": {"cellHeight": "sm", "showHeader": True},
            "targets": self._targets([expr], table=True), "title": title,
            "transformations": [{"id": "organize",
                                 "options": {"excludeByName": {k: True for k in hide}}}],
            "type": "table",
        })

    def json(self):
        return {
            "annotations": {"list": [{
                "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                "name": "Annotations & Alerts", "type": "dashboard"}]},
            "description": self.description,
            "editable": True,
            "graphTooltip": 1,
            "id": None,
            "links": [{"asDropdown": True, "includeVars": False, "keepTime": True,
                       "tags": ["offload"], "title": "Offload", "type": "dashboards"}],
            "panels": self.panels,
            "refresh": "30s",
            "schemaVersion": 39,
            "tags": ["offload"],
            "templating": {"list": self.variables},
            "time": {"from": "now-6h", "to": "now"},
            "timepicker": {},
            "timezone": "",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
        }


def datasource_var():
    return {"current": {}, "hide": 0, "includeAll": False, "label": "Data source",
            "multi": False, "name": "datasource", "options": [], "query": "prometheus",
            "refresh": 1, "regex": "", "type": "datasource"}


def query_var(name, label, query):
    # No allValue: "All" then expands to the values the query found, so a variable chained on
    # another (instance on job) keeps the other's selection instead of matching everything.
    return {"current": {}, "datasource": DS, "definition": query, "hide": 0,
            "includeAll": True, "label": label, "multi": True, "name": name, "options": [],
            "query": query, "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1,
            "type": "query"}


def job_instance_vars(metric):
    """datasource, job and instance variables over METRIC, instance chained on job."""
    return [datasource_var(),
            query_var("job", "Job", f"label_values({metric}, job)"),
            query_var("instance", "Instance", f'label_values({metric}{{job=~"$job"}}, instance)')]


def job_dashboard():
    info = "offload_trainer_info"
    d = Dashboard(
        "offload-job", "Offload / Training job",
        "A training job seen from its trainer ranks (scrape job offload-trainer; a torch job's "
        "ranks through their pool workers, scrape job offload-trainer-worker, with steps, tokens "
        "and loss as the script reports them): throughput, step time and its phases, loss and "
        "optimizer state, device memory.",
        [datasource_var(),
         query_var("job", "Job", "label_values(offload_trainer_steps_total, job)"),
         query_var("job_id", "Training job", f'label_values({info}{{job=~"$job"}}, job_id)'),
         query_var("instance", "Rank",
                   f'label_values({info}{{job=~"$job", job_id=~"$job_id"}}, instance)')])
    tokens = rate('offload_trainer_tokens_total')

    d.row("Throughput")
    d.stat("Tokens/s", "Tokens per second over all selected ranks.", q(f"sum({tokens})"), "short")
    d.stat("Achieved TFLOP/s", "Model FLOP/s of the last step, summed over the ranks.",
           q("sum(offload_trainer_flops_per_second{%F}) / 1e12"), "tflops")
    d.stat("Last step", "Highest finished step of any selected rank.",
           q("max(offload_trainer_step{%F})"), "none")
    d.stat("Ranks up", "Selected ranks Prometheus can scrape.", q("sum(up{%F})"), "none")
    d.stat("Skipped steps (time range)", "Steps skipped for fp16 overflow in the dashboard's time range.",
           f"sum({increase('offload_trainer_skipped_steps_total', window='$__range')})", "none",
           threshold=1)
    d.stat("Step time p50", "Median wall time of a step, all selected ranks.",
           hq(0.5, "offload_trainer_step_seconds"), "s")
    d.timeseries("Tokens/s (job)", "sum(rate(offload_trainer_tokens_total)) over the ranks.",
                 [(q(f"sum({tokens})"), "tokens/s")], "short")
    d.timeseries("Tokens/s per rank", "Each rank's own tokens per second.",
                 [(q(f"sum by (instance) ({tokens})"), "{{instance}}")], "short")
    d.timeseries("Achieved TFLOP/s per rank",
                 "offload_trainer_flops_per_second / 1e12: model FLOP/s (6N + attention per "
                 "token) of each rank's last step.",
                 [(q("offload_trainer_flops_per_second{%F} / 1e12"), "{{instance}}")], "tflops")
    d.timeseries("Steps/s per rank", "Optimizer steps finished per second (skipped included).",
                 [(f"sum by (instance) ({rate('offload_trainer_steps_total')})",
                   "{{instance}}")], "short")

    d.row("Step time")
    step = "offload_trainer_step_seconds"
    d.timeseries("Step time quantiles", "Wall time of a whole step over all selected ranks.",
                 [(hq(0.5, step), "p50"), (hq(0.9, step), "p90"), (hq(0.99, step), "p99"),
                  (hmean(step), "mean")], "s")
    d.timeseries("Step time p99 per rank", "A rank far above the others is a straggler.",
                 [(hq(0.99, step, "le, instance"), "{{instance}}")], "s")
    phase = "offload_trainer_phase_seconds"
    d.timeseries("Step phase breakdown (mean)",
                 "Mean time of each phase (sum/count of offload_trainer_phase_seconds), stacked: "
                 "forward, backward, wait_offload, wait_reduce, commit, wait_commit, all_gather. "
                 "Growing wait_* phases point at the optimizer servers or the network.",
                 [(hmean(phase, "phase"), "{{phase}}")], "s", stack=True)
    d.timeseries("Step phase p99", "99th percentile of each phase's time.",
                 [(hq(0.99, phase, "le, phase"), "{{phase}}")], "s")

    d.row("Training")
    d.timeseries("Loss", "Training loss of each rank's last step.",
                 [(q("offload_trainer_loss{%F}"), "{{instance}}")], "none", w=8, min=None)
    d.timeseries("Loss scale", "fp16 dynamic loss scale (1 for bf16/fp32); log2 axis.",
                 [(q("offload_trainer_loss_scale{%F}"), "{{instance}}")], "none", w=8,
                 log2=True)
    d.timeseries("Learning rate", "Learning rate of the last step.",
                 [(q("offload_trainer_learning_rate{%F}"), "{{instance}}")], "none", w=8)
    d.timeseries("Gradient norm", "Global gradient norm of the last step.",
                 [(q("offload_trainer_grad_norm{%F}"), "{{instance}}")], "none", w=8)
    d.timeseries("Skipped steps", "Steps skipped for fp16 overflow per interval.",
                 [(f"sum by (instance) ({increase('offload_trainer_skipped_steps_total')})",
                   "{{instance}}")], "short", w=8, bars=True)
    d.timeseries("Skip ratio", "Skipped steps / steps over all selected ranks; the "
                 "OffloadSkipRateHigh alert fires above 5% for 15m.",
                 [(f"sum({rate('offload_trainer_skipped_steps_total')}) / "
                     f"sum({rate('offload_trainer_steps_total')})", "skipped")],
                 "percentunit", w=8, threshold=0.05)

    d.row("Memory")
    d.timeseries("Device memory used", "Memory the model holds on its device (CUDA: allocated "
                 "by the runner; CPU: the runner's arena).",
                 [(q("offload_trainer_device_memory_used_bytes{%F}"), "{{instance}} {{device}}")],
                 "bytes", w=8)
    d.timeseries("Device memory used (of device)", "used / the device's total memory.",
                 [(q("offload_trainer_device_memory_used_bytes{%F} / "
                     "offload_trainer_device_memory_total_bytes{%F}"), "{{instance}} {{device}}")],
                 "percentunit", w=8, max=1, threshold=0.9)
    d.timeseries("Rank resident memory", "Host RSS of each rank's process.",
                 [(q("process_resident_memory_bytes{%F}"), "{{instance}}")], "bytes", w=8)

    d.row("Ranks")
    d.table("Ranks of the job", "offload_trainer_info: what each rank runs.",
            q('offload_trainer_info{%F, job_id=~"$job_id"}'), ["Time", "Value", "__name__"])
    return d


def optimizer_dashboard():
    m = "offload_optimizer_params_updated_total"
    m_rx, m_tx = "offload_optimizer_receive_bytes_total", "offload_optimizer_transmit_bytes_total"
    d = Dashboard(
        "offload-optimizer", "Offload / Optimizer servers",
        "CPU optimizer servers (scrape job offload-optimizer-server): Adam throughput and "
        "latency, gradient and parameter traffic by transport, memory against the budget.",
        job_instance_vars(m))
    limit = "(offload_optimizer_memory_limit_bytes{%F} > 0)"
    rss = "process_resident_memory_bytes{%F}"

    d.row("Overview")
    d.stat("Servers up", "Selected optimizer servers Prometheus can scrape.",
           q("sum(up{%F})"), "none")
    d.stat("Parameters updated/s (all)", "Parameters Adam updates per second, all servers.",
           f"sum({rate(m)})", "short")
    d.stat("Gradients received", "Gradient bytes received per second, all transports.",
           f"sum({rate(m_rx)})", "Bps")
    d.stat("Shard jobs (all)", "Shard jobs held, all servers.",
           q("sum(offload_optimizer_shard_jobs{%F})"), "none")
    d.stat("Adam p99", "99th percentile of one shard step's Adam time.",
           hq(0.99, "offload_optimizer_adam_seconds"), "s")
    d.stat("Memory used of limit (max)", "Highest RSS / --memory_limit_mib of any server; the "
           "OffloadOptimizerMemoryNearLimit alert fires above 90%.",
           q(f"max({rss} / on(instance, job) {limit})"), "percentunit", threshold=0.9)

    d.row("Throughput")
    d.timeseries("Parameters updated/s", "Parameters Adam updated per second.",
                 [(f"sum by (instance) ({rate(m)})", "{{instance}}")], "short")
    d.timeseries("Shard steps/s", "Shard steps committed (applied) or dropped for fp16 overflow "
                 "(skipped).",
                 [(f"sum by (result) ({rate('offload_optimizer_steps_total')})",
                   "{{result}}")], "short", stack=True)
    d.timeseries("Gradient bytes received/s", "By transport: grpc, shm, ucx.",
                 [(f"sum by (instance, transport) ({rate(m_rx)})", "{{instance}} {{transport}}")],
                 "Bps")
    d.timeseries("Parameter bytes sent/s", "Parameters sent back to the ranks, by transport.",
                 [(f"sum by (instance, transport) ({rate(m_tx)})", "{{instance}} {{transport}}")],
                 "Bps")

    d.row("Adam")
    adam = "offload_optimizer_adam_seconds"
    d.timeseries("Adam time per shard step", "Adam kernel time of one shard step, all servers.",
                 [(hq(0.5, adam), "p50"), (hq(0.99, adam), "p99"), (hmean(adam), "mean")], "s")
    d.timeseries("Adam p99 per server", "A server far above the others is short of CPU.",
                 [(hq(0.99, adam, "le, instance"), "{{instance}}")], "s")
    d.timeseries("Queue depth", "Adam work items waiting for a thread.",
                 [(q("offload_optimizer_queue_depth{%F}"), "{{instance}}")], "short")
    d.timeseries("Shard jobs", "Shard jobs each server holds.",
                 [(q("offload_optimizer_shard_jobs{%F}"), "{{instance}}")], "short")

    d.row("Resources")
    d.timeseries("Optimizer state vs memory limit", "Bytes of optimizer state (fp32 master "
                 "weights, moments) against the --memory_limit_mib budget.",
                 [(q("offload_optimizer_state_bytes{%F}"), "state {{instance}}"),
                  (q("offload_optimizer_memory_limit_bytes{%F}"), "limit {{instance}}")],
                 "bytes", w=8)
    d.timeseries("Resident memory", "RSS of each server process.",
                 [(q(rss), "{{instance}}")], "bytes", w=8)
    d.timeseries("Memory used of limit", "RSS and state as a fraction of the memory limit.",
                 [(q(f"{rss} / on(instance, job) {limit}"), "rss {{instance}}"),
                  (q(f"offload_optimizer_state_bytes{{%F}} / on(instance, job) {limit}"),
                   "state {{instance}}")], "percentunit", w=8, threshold=0.9)
    d.timeseries("CPU cores used", "rate(process_cpu_seconds_total): user + system CPU seconds "
                 "per second.",
                 [(rate('process_cpu_seconds_total'), "{{instance}}")],
                 "short")
    d.timeseries("Open file descriptors", "Open fds of each server process.",
                 [(q("process_open_fds{%F}"), "{{instance}}")], "short")

    d.row("Disk tier")
    wait = "offload_optimizer_disk_wait_seconds"
    d.timeseries("Disk read and written/s", "Optimizer state the disk tier's passes move per "
                 "second (--state_dir): every step reads and writes each job's state once.",
                 [(rate("offload_optimizer_disk_read_bytes_total"), "read {{instance}}"),
                  (rate("offload_optimizer_disk_written_bytes_total"), "written {{instance}}")],
                 "Bps", w=8)
    d.timeseries("Waiting on the disk per shard step", "Time a range step's pass waited on the "
                 "disk. Close to the Adam time: the disk bounds the step; near zero: the cores do.",
                 [(hq(0.5, wait), "p50"), (hq(0.99, wait), "p99"), (hmean(wait), "mean")], "s",
                 w=8)
    d.timeseries("State on disk vs free", "Bytes of optimizer state in state files, and the "
                 "free bytes left on the disk tier's file system.",
                 [(q("offload_optimizer_disk_state_bytes{%F}"), "state {{instance}}"),
                  (q("offload_optimizer_disk_free_bytes{%F}"), "free {{instance}}")], "bytes", w=8)
    return d


def gpu_dashboard():
    # The GPU dashboard reads two scrape jobs, dcgm-exporter (the GPUs) and offload-trainer (what
    # the model holds on them), so its job variable offers both and each panel matches its own.
    d = Dashboard(
        "offload-gpu", "Offload / GPUs",
        "GPUs from NVIDIA dcgm-exporter (utilization, tensor cores, frame buffer, power, "
        "temperature) and the trainer ranks' own device memory.",
        [datasource_var(),
         query_var("job", "Job", 'label_values(up{job=~"dcgm-exporter|offload-trainer"}, job)'),
         query_var("instance", "Instance", 'label_values(up{job=~"$job"}, instance)')])
    gpu = "{{instance}} gpu {{gpu}}"
    mib = "1048576"  # DCGM reports the frame buffer in MiB

    d.row("Utilization")
    d.stat("GPUs", "GPUs reporting through dcgm-exporter.",
           q("count(DCGM_FI_DEV_GPU_UTIL{%F})"), "none")
    d.stat("Mean GPU utilization", "DCGM_FI_DEV_GPU_UTIL averaged over the GPUs.",
           q("avg(DCGM_FI_DEV_GPU_UTIL{%F})"), "percent")
    d.stat("Mean tensor core activity", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE (profiling metric set).",
           q("avg(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{%F})"), "percentunit")
    d.stat("Frame buffer used (all GPUs)", "All GPUs' frame buffer in use.",
           q(f"sum(DCGM_FI_DEV_FB_USED{{%F}}) * {mib}"), "bytes")
    d.stat("Power (all GPUs)", "Power drawn by all GPUs.", q("sum(DCGM_FI_DEV_POWER_USAGE{%F})"), "watt")
    d.stat("Max temperature", "Hottest GPU.", q("max(DCGM_FI_DEV_GPU_TEMP{%F})"), "celsius",
           threshold=85)
    d.timeseries("GPU utilization", "Fraction of time a kernel ran (DCGM_FI_DEV_GPU_UTIL).",
                 [(q("DCGM_FI_DEV_GPU_UTIL{%F}"), gpu)], "percent", max=100)
    d.timeseries("Tensor core activity", "Fraction of cycles the tensor pipes were active "
                 "(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE; needs dcgm-exporter's profiling set).",
                 [(q("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{%F}"), gpu)], "percentunit", max=1)

    d.row("Memory")
    d.timeseries("Frame buffer used", "DCGM_FI_DEV_FB_USED (MiB, shown in bytes).",
                 [(q(f"DCGM_FI_DEV_FB_USED{{%F}} * {mib}"), gpu)], "bytes", w=8)
    d.timeseries("Frame buffer free", "DCGM_FI_DEV_FB_FREE (MiB, shown in bytes).",
                 [(q(f"DCGM_FI_DEV_FB_FREE{{%F}} * {mib}"), gpu)], "bytes", w=8)
    d.timeseries("Frame buffer used (fraction)", "used / (used + free).",
                 [(q("DCGM_FI_DEV_FB_USED{%F} / "
                     "(DCGM_FI_DEV_FB_USED{%F} + DCGM_FI_DEV_FB_FREE{%F})"), gpu)],
                 "percentunit", w=8, max=1, threshold=0.9)
    d.timeseries("Trainer device memory used", "offload_trainer_device_memory_used_bytes: what "
                 "the model holds on its device, as the rank counts it.",
                 [(q("offload_trainer_device_memory_used_bytes{%F}"), "{{instance}} {{device}}")],
                 "bytes")
    d.timeseries("Trainer device memory used (of device)", "used / the device's total memory.",
                 [(q("offload_trainer_device_memory_used_bytes{%F} / "
                     "offload_trainer_device_memory_total_bytes{%F}"), "{{instance}} {{device}}")],
                 "percentunit", max=1, threshold=0.9)

    d.row("Power and temperature")
    d.timeseries("Power", "DCGM_FI_DEV_POWER_USAGE.",
                 [(q("DCGM_FI_DEV_POWER_USAGE{%F}"), gpu)], "watt")
    d.timeseries("Temperature", "DCGM_FI_DEV_GPU_TEMP.",
                 [(q("DCGM_FI_DEV_GPU_TEMP{%F}"), gpu)], "celsius", threshold=85)
    return d


def controller_dashboard():
    d = Dashboard(
        "offload-controller", "Offload / Job controller",
        "The job controller (scrape job offload-controller): jobs by state, the worker pool, "
        "heartbeat timeouts, failed and restarted attempts; and the pool workers' own view.",
        job_instance_vars("offload_controller_jobs"))

    d.row("Overview")
    d.stat("Controller up", "Selected controllers Prometheus can scrape.",
           q("sum(up{%F})"), "none", red_below=1)
    d.stat("Running jobs", "Jobs in state running.",
           q('sum(offload_controller_jobs{%F, state="running"})'), "none")
    d.stat("Pending jobs", "Jobs waiting for workers.",
           q('sum(offload_controller_jobs{%F, state="pending"})'), "none")
    d.stat("Registered workers", "Workers registered with the controller, all kinds.",
           q("sum(offload_controller_workers{%F})"), "none")
    d.stat("Busy workers", "Workers running an assignment.",
           q('sum(offload_controller_workers{%F, state="busy"})'), "none")
    d.stat("Failed attempts", "Job attempts that failed in the dashboard's time range.",
           f"sum({increase('offload_controller_attempt_failures_total', window='$__range')})",
           "none", threshold=1)

    d.row("Jobs and workers")
    d.timeseries("Jobs by state", "offload_controller_jobs by state.",
                 [(q("sum by (state) (offload_controller_jobs{%F})"), "{{state}}")], "short",
                 stack=True)
    d.timeseries("Workers by kind and state", "Registered workers: trainer / optimizer_server, "
                 "idle / busy.",
                 [(q("sum by (kind, state) (offload_controller_workers{%F})"),
                   "{{kind}} {{state}}")], "short", stack=True)
    d.timeseries("Heartbeat timeouts", "Workers declared dead for missed heartbeats.",
                 [(f"sum by (kind) "
                   f"({increase('offload_controller_worker_heartbeat_timeouts_total')})",
                   "{{kind}}")], "short", w=8, bars=True)
    d.timeseries("Attempt failures", "Job attempts that failed.",
                 [(f"sum({increase('offload_controller_attempt_failures_total')})",
                   "failed")], "short", w=8, bars=True)
    d.timeseries("Restarts from checkpoint", "Attempts restarted from a checkpoint.",
                 [(f"sum({increase('offload_controller_job_restarts_total')})",
                   "restarts")], "short", w=8, bars=True)

    d.row("Tenants")
    d.timeseries("Optimizer servers held by tenant", "offload_tenant_optimizer_servers: servers "
                 "the tenant's running jobs hold, stacked: the top is what all tenants hold.",
                 [(q("sum by (tenant) (offload_tenant_optimizer_servers{%F})"), "{{tenant}}")],
                 "short", w=8, stack=True)
    d.timeseries("Trainer ranks held by tenant", "offload_tenant_ranks: trainer ranks the "
                 "tenant's running jobs hold, stacked.",
                 [(q("sum by (tenant) (offload_tenant_ranks{%F})"), "{{tenant}}")],
                 "short", w=8, stack=True)
    d.timeseries("Jobs queued and running by tenant", "offload_tenant_jobs: the tenant's jobs "
                 "waiting for the pool (queued) and running.",
                 [(q("sum by (tenant, state) (offload_tenant_jobs{%F})"),
                   "{{tenant}} {{state}}")], "short", w=8)
    d.timeseries("Fair-share deficit by tenant", "offload_tenant_fair_share_deficit: the "
                 "tenant's entitled share of the pool minus its dominant share (servers or "
                 "ranks, whichever is the larger fraction of the pool). Above 0 the tenant holds "
                 "less than its share of the pool, below 0 more.",
                 [(q("offload_tenant_fair_share_deficit{%F}"), "{{tenant}}")], "percentunit",
                 min=None)
    d.timeseries("Preemptions by tenant", "The tenant's jobs stopped at a checkpoint for a job "
                 "of higher priority, per interval (offload_tenant_preemptions_total).",
                 [(f"sum by (tenant) ({increase('offload_tenant_preemptions_total')})",
                   "{{tenant}}")], "short", bars=True)

    d.row("Pool workers (as the workers see it)")
    d.timeseries("Registered and busy workers", "offload_worker_registered and "
                 "offload_worker_busy from the workers themselves, by scrape job.",
                 [(f"sum by (job) (offload_worker_registered{{{POOL_JOBS}}})",
                   "registered {{job}}"),
                  (f"sum by (job) (offload_worker_busy{{{POOL_JOBS}}})", "busy {{job}}")],
                 "short", w=8)
    d.timeseries("Assignments started", "Assignments the workers started.",
                 [(f"sum by (job) ({increase('offload_worker_assignments_total', POOL_JOBS)})",
                   "{{job}}")], "short", w=8, bars=True)
    d.timeseries("Heartbeat failures (worker side)", "Heartbeats that did not reach the "
                 "controller, per worker.",
                 [(f"sum by (job, instance) "
                   f"({increase('offload_worker_heartbeat_failures_total', POOL_JOBS)})",
                   "{{job}} {{instance}}")], "short", w=8, bars=True)

    d.row("Controller process")
    d.timeseries("Controller resident memory", "RSS of the controller process.",
                 [(q("process_resident_memory_bytes{%F}"), "{{instance}}")], "bytes", w=8)
    d.timeseries("Controller CPU cores used", "rate(process_cpu_seconds_total).",
                 [(rate('process_cpu_seconds_total'), "{{instance}}")], "short",
                 w=8)
    d.timeseries("Controller open file descriptors", "process_open_fds.",
                 [(q("process_open_fds{%F}"), "{{instance}}")], "short", w=8)

    d.row("Versions")
    d.table("Build info of every Offload binary", "offload_build_info across all Offload "
            "scrape jobs: which program and version each target runs.",
            'offload_build_info{job=~"offload-.*"}', ["Time", "Value", "__name__"])
    return d


DASHBOARDS = {
    "offload-job.json": job_dashboard,
    "offload-optimizer.json": optimizer_dashboard,
    "offload-gpu.json": gpu_dashboard,
    "offload-controller.json": controller_dashboard,
}


def render(build):
    return json.dumps(build().json(), indent=2) + "\n"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(here, "..", "grafana", "dashboards"),
                        help="dashboards folder (default: monitoring/grafana/dashboards)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a file differs from what would be written")
    args = parser.parse_args()
    stale = []
    for name, build in DASHBOARDS.items():
        path = os.path.join(args.out, name)
        text = render(build)
        if args.check:
            try:
                with open(path) as f:
                    current = f.read()
            except FileNotFoundError:
                current = None
            if current != text:
                stale.append(path)
        else:
            with open(path, "w") as f:
                f.write(text)
    if stale:
        for path in stale:
            print(f"{os.path.normpath(path)} is not what monitoring/tools/gen_dashboards.py "
                  "writes; run it and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
