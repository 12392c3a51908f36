"""Generates the Grafana dashboards of dsa-indexer (docs/deploy.md, "Dashboards and alerts").

Built with grafana-foundation-sdk (scripts/requirements-tools.txt). Writes one JSON file a
dashboard into each output folder; by default deploy/observability/dashboards/ and the chart's
helm/dsa-indexer/files/dashboards/. Panels read the recording rules of
deploy/observability/rules/dsa-rules.yaml where one exists (the `dsa:` series) and the raw metrics
of docs/deploy.md's contract otherwise.

Usage: "$(bash scripts/python_tools.sh)/python" deploy/observability/dashboards/generate.py [--out DIR]...
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Callable, Optional

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus as prometheus_builders
from grafana_foundation_sdk.builders import stat as stat_builders
from grafana_foundation_sdk.builders import table as table_builders
from grafana_foundation_sdk.builders import timeseries as timeseries_builders
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

REPO = pathlib.Path(__file__).resolve().parents[3]
DEFAULT_OUTS = [
    REPO / "deploy/observability/dashboards",
    REPO / "helm/dsa-indexer/files/dashboards",
]

# Every dashboard carries this tag; the links bar lists the dashboards that have it.
TAG = "dsa-indexer"
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The series filter of every query: the dashboard's namespace and job variables.
SEL = 'namespace=~"$namespace", job=~"$job"'

# Thresholds the alerts of dsa-rules.yaml use, drawn on the panels they judge.
# Mirrors the fallback miss target of the rule dsa:indexer_miss_target_ratio:effective (what
# DsaIndexerAuditedMissRatioHigh judges a job without --miss-target against), for the red threshold
# of the "Audited miss ratio (mean)" stat only: Grafana's thresholds are numbers, not queries.
# Change it with the rule; every query reads the rule instead.
MISS_RATIO_TARGET = 0.25
MLI_LAG_BUDGET_SECONDS = 0.005  # DsaAttentionSelectionWaitOverBudget


def query(expr: str, legend: str, ref_id: str, instant: bool = False,
          table: bool = False) -> prometheus_builders.Dataquery:
    """One PromQL target; `legend` is Grafana's legend format ({{label}})."""
    q = (prometheus_builders.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id)
         .datasource(DATASOURCE))
    if instant:
        q = q.instant()
    if table:
        q = q.format(prometheus_models.PromQueryFormat.TABLE)
    return q


def _targets(panel, exprs: list[tuple[str, str]], **kwargs):
    for i, (expr, legend) in enumerate(exprs):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + i), **kwargs))
    return panel


def timeseries(title: str, description: str, unit: str, exprs: list[tuple[str, str]],
               span: int = 12, stacked: bool = False, min_value: Optional[float] = 0,
               max_value: Optional[float] = None, threshold: Optional[float] = None,
               dashed: Optional[str] = None) -> timeseries_builders.Panel:
    """A time series panel of `exprs` ((expr, legend) pairs). `threshold` draws a dashed red line
    at that value (an alert's threshold); `dashed` is a regexp of series names drawn dashed (a
    bound, e.g. the queue's)."""
    panel = (timeseries_builders.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).height(8).span(span).line_width(1).fill_opacity(10)
             .legend(common_builders.VizLegendOptions()
                     .display_mode(common_models.LegendDisplayMode.LIST)
                     .placement(common_models.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_builders.VizTooltipOptions()
                      .mode(common_models.TooltipDisplayMode.MULTI)
                      .sort(common_models.SortOrder.DESCENDING)))
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    if stacked:
        panel = panel.fill_opacity(40).stacking(
            common_builders.StackingConfig().mode(common_models.StackingMode.NORMAL))
    if threshold is not None:
        panel = (panel.thresholds(
            dashboard_builders.ThresholdsConfig().mode(dashboard_models.ThresholdsMode.ABSOLUTE)
            .steps([dashboard_models.Threshold(value=None, color="green"),
                    dashboard_models.Threshold(value=threshold, color="red")]))
                 .thresholds_style(common_builders.GraphThresholdsStyleConfig()
                                   .mode(common_models.GraphTresholdsStyleMode.DASHED)))
    if dashed is not None:
        panel = panel.override_by_regexp(dashed, [
            dashboard_models.DynamicConfigValue(id_val="custom.lineStyle",
                                                value={"fill": "dash", "dash": [10, 10]}),
            dashboard_models.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
        ])
    return _targets(panel, exprs)


def stat(title: str, description: str, unit: str, expr: str, legend: str = "",
         span: int = 6, decimals: Optional[int] = None,
         steps: Optional[list[tuple[Optional[float], str]]] = None) -> stat_builders.Panel:
    """A single-value panel of `expr`'s last value; `steps` are (from value, colour) thresholds."""
    panel = (stat_builders.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).height(4).span(span)
             .graph_mode(common_models.BigValueGraphMode.AREA)
             .color_mode(common_models.BigValueColorMode.VALUE)
             .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
             .thresholds(dashboard_builders.ThresholdsConfig()
                         .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
                         .steps([dashboard_models.Threshold(value=v, color=c)
                                 for v, c in (steps or [(None, "green")])])))
    if decimals is not None:
        panel = panel.decimals(decimals)
    return _targets(panel, [(expr, legend)])


def variables(job_metric: str) -> list:
    """Data source, namespace and job variables, all selected by default. "All" namespaces is
    `.*`, so that series without a namespace label (outside Kubernetes) match too; "All" jobs is
    the list of jobs that export `job_metric`, so that other jobs' `up` and `process_*` series
    stay out."""
    namespace = (dashboard_builders.QueryVariable("namespace").label("Namespace")
                 .datasource(DATASOURCE).query("label_values(dsa_build_info, namespace)")
                 .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
                 .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
                 .multi(True).include_all(True).all_value(".*")
                 .current(dashboard_models.VariableOption(text="All", value="$__all")))
    job = (dashboard_builders.QueryVariable("job").label("Job").datasource(DATASOURCE)
           .query(f'label_values({job_metric}{{namespace=~"$namespace"}}, job)')
           .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
           .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
           .multi(True).include_all(True)
           .current(dashboard_models.VariableOption(text="All", value="$__all")))
    datasource = (dashboard_builders.DatasourceVariable("datasource").label("Data source")
                  .type("prometheus"))
    return [datasource, namespace, job]


def new_dashboard(uid: str, title: str, description: str,
                  job_metric: str) -> dashboard_builders.Dashboard:
    return (dashboard_builders.Dashboard(title).uid(uid).description(description)
            .tags([TAG]).editable().time("now-1h", "now").refresh("30s").timezone("browser")
            .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
            .variables(variables(job_metric))
            .link(dashboard_builders.DashboardLink("DSA dashboards")
                  .type(dashboard_models.DashboardLinkType.DASHBOARDS).tags([TAG])
                  .as_dropdown(True).include_vars(True).keep_time(True)))


def router() -> dashboard_builders.Dashboard:
    d = new_dashboard(
        "dsa-router", "DSA / Router (coordinator)",
        "The coordinator's view of the requests: outcomes, time to first token, inter-token "
        "latency, tokens/s, the admission queue against its bound, the workers it can place on, "
        "and speculative decoding's acceptance.",
        "dsa_coordinator_requests_total")
    d = (d.with_panel(stat(
        "Requests/s", "Requests ended per second, all outcomes (5 m).", "reqps",
        f"sum(dsa:coordinator_requests:rate5m{{{SEL}}})"))
         .with_panel(stat(
             "Not completed", "Share of the requests that ended failed, rejected or cancelled "
             "(5 m).", "percentunit",
             f'sum(dsa:coordinator_requests:rate5m{{{SEL}, outcome!="completed"}}) / '
             f"sum(dsa:coordinator_requests:rate5m{{{SEL}}})",
             steps=[(None, "green"), (0.01, "orange"), (0.05, "red")]))
         .with_panel(stat(
             "TTFT p99", "Time to first token, p99 over 5 m.", "s",
             f"max(dsa:coordinator_ttft_seconds:p99_5m{{{SEL}}})"))
         .with_panel(stat(
             "Generated tokens/s", "Tokens sent to clients per second (5 m).", "suffix: tok/s",
             f"sum(dsa:coordinator_generated_tokens:rate5m{{{SEL}}})"))
         .with_panel(stat(
             "Prompt tokens/s", "Context tokens of the requests admitted per second (5 m).",
             "suffix: tok/s", f"sum(dsa:coordinator_prompt_tokens:rate5m{{{SEL}}})"))
         .with_panel(stat(
             "End-to-end p99", "Generate arrival to the request's end, p99 over 5 m (every "
             "outcome of a queued request).", "s",
             f"max(dsa:coordinator_request_duration_seconds:p99_5m{{{SEL}}})")))
    d = d.with_row(dashboard_builders.Row("Requests and latency"))
    d = (d.with_panel(timeseries(
        "Requests by outcome", "Requests ended per second by outcome (5 m): completed, failed, "
        "rejected (queue full, RESOURCE_EXHAUSTED), cancelled.", "reqps",
        [(f"dsa:coordinator_requests:rate5m{{{SEL}}}", "{{outcome}}")], stacked=True))
         .with_panel(timeseries(
             "Requests by outcome and code", "Requests ended per second by outcome and final "
             "status code (5 m): why requests were rejected or failed (RESOURCE_EXHAUSTED: the "
             "queue or the caller's share full; INVALID_ARGUMENT; UNAVAILABLE ...).", "reqps",
             [(f"sum by (outcome, code) (rate(dsa_coordinator_requests_total{{{SEL}}}"
               "[$__rate_interval]))", "{{outcome}} {{code}}")], stacked=True))
         .with_panel(timeseries(
             "Tokens/s", "Prompt tokens admitted and tokens generated per second (5 m).",
             "suffix: tok/s",
             [(f"sum(dsa:coordinator_prompt_tokens:rate5m{{{SEL}}})", "prompt"),
              (f"sum(dsa:coordinator_generated_tokens:rate5m{{{SEL}}})", "generated")]))
         .with_panel(timeseries(
             "End-to-end latency", "Generate arrival to the request's end (every outcome of a "
             "queued request): p50 and p99 over 5 m.", "s",
             [(f"dsa:coordinator_request_duration_seconds:p50_5m{{{SEL}}}", "p50"),
              (f"dsa:coordinator_request_duration_seconds:p99_5m{{{SEL}}}", "p99")]))
         .with_panel(timeseries(
             "Migrations/s", "Running requests moved off a failed worker per second (5 m): each "
             "re-prefills its context and generated tokens on a surviving worker "
             "(docs/reliability.md).", "reqps",
             [(f"dsa:coordinator_migrations:rate5m{{{SEL}}}", "{{job}}")]))
         .with_panel(timeseries(
             "Time to first token", "Generate arrival to the first Tokens event: p50 and p99 "
             "over 5 m.", "s",
             [(f"dsa:coordinator_ttft_seconds:p50_5m{{{SEL}}}", "p50"),
              (f"dsa:coordinator_ttft_seconds:p99_5m{{{SEL}}}", "p99")]))
         .with_panel(timeseries(
             "Inter-token latency", "Per decode step after the first, time since the previous "
             "step over its tokens: p50 and p99 over 5 m.", "s",
             [(f"dsa:coordinator_itl_seconds:p50_5m{{{SEL}}}", "p50"),
              (f"dsa:coordinator_itl_seconds:p99_5m{{{SEL}}}", "p99")])))
    d = d.with_row(dashboard_builders.Row("Admission and workers"))
    d = (d.with_panel(timeseries(
        "Queue depth and bound", "Requests waiting for admission, and the queue's bound "
        "(--max-queue, dashed). At the bound new requests are rejected (alert "
        "DsaCoordinatorQueueFull).", "short",
        [(f"dsa_coordinator_queued_requests{{{SEL}}}", "queued {{instance}}"),
         (f"dsa_coordinator_max_queued_requests{{{SEL}}}", "bound {{instance}}")],
        span=8, dashed="bound .*"))
         .with_panel(timeseries(
             "Running requests", "Requests admitted and not yet ended (prefilling or "
             "decoding).", "short",
             [(f"dsa_coordinator_running_requests{{{SEL}}}", "{{instance}}")], span=8))
         .with_panel(timeseries(
             "Queue wait p99", "Generate arrival to admission, p99 over 5 m.", "s",
             [(f"dsa:coordinator_queue_duration_seconds:p99_5m{{{SEL}}}", "p99")], span=8))
         .with_panel(timeseries(
             "Workers by kind and state", "Workers the coordinator knows, by kind and readiness "
             "(ready + not_ready = known). No ready worker of a kind: alert "
             "DsaCoordinatorNoReadyWorkers.", "short",
             [(f"sum by (kind, state) (dsa_coordinator_workers{{{SEL}}})", "{{kind}} {{state}}")],
             span=24)))
    d = d.with_row(dashboard_builders.Row("Speculative decoding"))
    d = (d.with_panel(timeseries(
        "Acceptance", "Accepted / drafted tokens of the speculative decode steps (5 m); empty "
        "without drafts.", "percentunit",
        [(f"dsa:coordinator_spec_decode_acceptance:ratio_rate5m{{{SEL}}}", "{{job}}")],
        max_value=1))
         .with_panel(timeseries(
             "Draft tokens/s", "Draft tokens verified and accepted per second.", "suffix: tok/s",
             [(f"sum(rate(dsa_coordinator_spec_decode_draft_tokens_total{{{SEL}}}"
               "[$__rate_interval]))", "drafted"),
              (f"sum(rate(dsa_coordinator_spec_decode_accepted_tokens_total{{{SEL}}}"
               "[$__rate_interval]))", "accepted")])))
    return d


def indexer() -> dashboard_builders.Dashboard:
    d = new_dashboard(
        "dsa-indexer", "DSA / Indexer",
        "The indexer workers: select phase durations, SPIN's blocks scored against visible and "
        "the realized block sparsity, the audited miss ratio, the index-key cache, and where the "
        "selects ran (device or CPU).",
        "dsa_indexer_selects_total")
    d = (d.with_panel(stat(
        "Realized block sparsity", "1 - blocks scored / blocks visible (5 m): the share of "
        "visible 64-slot blocks SPIN skipped.", "percentunit",
        f"dsa:indexer_realized_block_sparsity:ratio_rate5m{{{SEL}}}", "{{job}}", span=8))
         .with_panel(stat(
             "Audited miss ratio (mean)", "Mean over the audited rows of the fraction of the "
             "dense top-K the pruned selection lost (10 m). Red above the alert's fallback miss "
             "target, its threshold where the job sets no --miss-target (the Audited miss ratio "
             "panel draws each job's).", "percentunit",
             f"dsa:indexer_audited_miss_ratio:mean_rate10m{{{SEL}}}", "{{job}}", span=8,
             steps=[(None, "green"), (MISS_RATIO_TARGET, "red")]))
         .with_panel(stat(
             "Selects on the CPU", "Share of the row groups whose scan and top-K ran on the CPU "
             "(5 m), worst indexer. 100% is expected for --device cpu.", "percentunit",
             f"max(dsa:indexer_selects_on_cpu:ratio_rate5m{{{SEL}}})", span=8)))
    d = d.with_row(dashboard_builders.Row("Select"))
    d = (d.with_panel(timeseries(
        "Select phase duration p50", "Wall time of each phase of a select (row group), p50 over "
        "5 m: predict (SPIN), scan, top-K, update (EMA).", "s",
        [(f"dsa:indexer_select_duration_seconds:p50_5m{{{SEL}}}", "{{phase}}")]))
         .with_panel(timeseries(
             "Select phase duration p99", "The same, p99 over 5 m.", "s",
             [(f"dsa:indexer_select_duration_seconds:p99_5m{{{SEL}}}", "{{phase}}")]))
         .with_panel(timeseries(
             "Blocks scored and visible", "64-slot blocks per second that selects scored (after "
             "SPIN pruning) and that were visible (what all-keep would score).", "short",
             [(f"dsa:indexer_blocks_scored:rate5m{{{SEL}}}", "scored"),
              (f"dsa:indexer_blocks_visible:rate5m{{{SEL}}}", "visible")]))
         .with_panel(timeseries(
             "Realized block sparsity", "1 - scored / visible over 5 m, and the mean target "
             "block sparsity rho the selects planned with over 10 m (the coordinator's "
             "--target-block-sparsity, or where adaptive sparsity's --miss-target moved it).",
             "percentunit",
             [(f"dsa:indexer_realized_block_sparsity:ratio_rate5m{{{SEL}}}", "{{job}}"),
              (f"dsa:indexer_target_block_sparsity:mean_rate10m{{{SEL}}}", "rho {{job}}")],
             max_value=1)))
    d = d.with_row(dashboard_builders.Row("Accuracy and placement"))
    # The threshold DsaIndexerAuditedMissRatioHigh judges the mean against, per job: its
    # --miss-target, or the rules' fallback.
    miss_threshold = f"dsa:indexer_miss_target_ratio:effective{{{SEL}}}"
    d = (d.with_panel(timeseries(
        "Audited miss ratio", "Audited rows (--audit-fraction): the fraction of the dense top-K "
        "the pruned selection lost, mean and p99 over 10 m. Dashed: the miss target the alert "
        "judges the mean against (dsa:indexer_miss_target_ratio:effective), the job's "
        "--miss-target (adaptive sparsity holds it), or the rules' fallback where it sets none.",
        "percentunit",
        [(f"dsa:indexer_audited_miss_ratio:mean_rate10m{{{SEL}}}", "mean"),
         (f"dsa:indexer_audited_miss_ratio:p99_10m{{{SEL}}}", "p99"),
         (miss_threshold, "target {{job}}")],
        dashed="target .*"))
         .with_panel(timeseries(
             "Selects by where they ran", "Row groups per second by indexer and scored_on "
             "(device or cpu). CPU selects beside device ones: alert DsaIndexerSelectsOnCpu; "
             "only CPU after device ones: DsaIndexerDeviceLost.", "short",
             [(f"dsa:indexer_selects:rate5m{{{SEL}}}", "{{instance}} {{scored_on}}")]))
         .with_panel(timeseries(
             "Index-key cache blocks by state", "64-slot blocks of the index-key cache: "
             "exclusive, shared (prefix blocks held by several sequences) and free; they add up "
             "to the capacity.", "short",
             [(f"sum by (state) (dsa_indexer_cache_blocks{{{SEL}}})", "{{state}}")],
             stacked=True))
         .with_panel(timeseries(
             "Free cache per indexer", "Free blocks / capacity per indexer. Admission waits for "
             "cache capacity, so a full cache queues requests.", "percentunit",
             [(f"dsa:indexer_cache_blocks_free:ratio{{{SEL}}}", "{{instance}}")],
             max_value=1)))
    return d


def attention() -> dashboard_builders.Dashboard:
    d = new_dashboard(
        "dsa-attention", "DSA / Attention",
        "The attention workers: how long each model layer waited for its lagged selection (the "
        "MLI lag budget), decode step and prefill durations, the KV cache and the sequences.",
        "dsa_attention_sequences")
    d = d.with_row(dashboard_builders.Row("Selection wait (MLI lag)"))
    d = (d.with_panel(timeseries(
        "Selection wait p99 by layer", "Per model layer, p99 over 5 m of the time the layer "
        "waited for the selection it attends. The first k full layers attend their own "
        "selection and always wait one indexer round trip; the others should wait ~0. Dashed: "
        f"the MLI lag budget ({MLI_LAG_BUDGET_SECONDS * 1e3:g} ms).", "s",
        [(f"dsa:attention_selection_wait_seconds_by_layer:p99_5m{{{SEL}}}", "layer {{layer}}")],
        span=16, threshold=MLI_LAG_BUDGET_SECONDS))
         .with_panel(timeseries(
             "Median layer and all layers", "What alert DsaAttentionSelectionWaitOverBudget "
             "compares with the budget: the median over the layers of their p99; and the p99 of "
             "every layer's waits together.", "s",
             [(f"quantile by (namespace, job) (0.5, "
               f"dsa:attention_selection_wait_seconds_by_layer:p99_5m{{{SEL}}})",
               "median layer's p99"),
              (f"dsa:attention_selection_wait_seconds:p99_5m{{{SEL}}}", "all layers p99")],
             span=8, threshold=MLI_LAG_BUDGET_SECONDS)))
    d = d.with_row(dashboard_builders.Row("Steps"))
    d = (d.with_panel(timeseries(
        "Decode step duration", "One DecodeStep over all model layers: p50 and p99 over 5 m.",
        "s",
        [(f"dsa:attention_decode_step_duration_seconds:p50_5m{{{SEL}}}", "p50"),
         (f"dsa:attention_decode_step_duration_seconds:p99_5m{{{SEL}}}", "p99")], span=8))
         .with_panel(timeseries(
             "Prefill duration", "One successful Prefill (index keys and KV cache): p50 and p99 "
             "over 5 m.", "s",
             [(f"dsa:attention_prefill_duration_seconds:p50_5m{{{SEL}}}", "p50"),
              (f"dsa:attention_prefill_duration_seconds:p99_5m{{{SEL}}}", "p99")], span=8))
         .with_panel(timeseries(
             "Full-layer selects by form", "Full-layer selects sent per second, by form: host "
             "buffers, or device-resident on the co-located GPU.", "short",
             [(f"sum by (form) (rate(dsa_attention_full_layer_selects_total{{{SEL}}}"
               "[$__rate_interval]))", "{{form}}")], span=8)))
    d = d.with_row(dashboard_builders.Row("KV cache and sequences"))
    d = (d.with_panel(timeseries(
        "KV slots by state", "KV-cache slots (one position of every model layer), used and "
        "free; they add up to the capacity.", "short",
        [(f"sum by (state) (dsa_attention_kv_slots{{{SEL}}})", "{{state}}")], span=8,
        stacked=True))
         .with_panel(timeseries(
             "KV slots used per worker", "Used / capacity per attention worker.", "percentunit",
             [(f"dsa:attention_kv_slots_used:ratio{{{SEL}}}", "{{instance}}")], span=8,
             max_value=1))
         .with_panel(timeseries(
             "Sequences", "Sequences each attention worker holds.", "short",
             [(f"dsa_attention_sequences{{{SEL}}}", "{{instance}}")], span=8)))
    return d


def processes() -> dashboard_builders.Dashboard:
    d = new_dashboard(
        "dsa-processes", "DSA / Build and processes",
        "Every server process: the version it runs (dsa_build_info), whether Prometheus reaches "
        "it, uptime, CPU, memory and file descriptors; the workers' GPUs (DCGM exporter).",
        "dsa_build_info")
    build_info = (table_builders.Panel().title("Build info")
                  .description("dsa_build_info{component, version} = 1 per process.")
                  .datasource(DATASOURCE).height(8).span(12)
                  .with_transformation(dashboard_models.DataTransformerConfig(
                      id_val="organize",
                      options={"excludeByName": {"Time": True, "Value": True, "__name__": True},
                               "indexByName": {"component": 0, "version": 1, "instance": 2,
                                               "job": 3, "namespace": 4}})))
    build_info = _targets(build_info, [(f"dsa_build_info{{{SEL}}}", "")], instant=True,
                          table=True)
    d = (d.with_panel(build_info)
         .with_panel(timeseries(
             "Versions running", "Processes per component and version: two versions of one "
             "component at once is a rollout in progress.", "short",
             [(f"count by (component, version) (dsa_build_info{{{SEL}}})",
               "{{component}} {{version}}")], stacked=True)))
    d = d.with_row(dashboard_builders.Row("Processes"))
    d = (d.with_panel(timeseries(
        "Scrape up", "1 when the last scrape of the target succeeded (alert DsaTargetDown after "
        "1 m at 0).", "short",
        [(f"up{{{SEL}}}", "{{instance}}")], span=8, max_value=1))
         .with_panel(timeseries(
             "Uptime", "Seconds since the process started; a drop is a restart.", "s",
             [(f"time() - process_start_time_seconds{{{SEL}}}", "{{instance}}")], span=8))
         .with_panel(timeseries(
             "CPU", "CPU seconds per second (cores busy).", "short",
             [(f"rate(process_cpu_seconds_total{{{SEL}}}[$__rate_interval])", "{{instance}}")],
             span=8))
         .with_panel(timeseries(
             "Resident memory", "Resident set size.", "bytes",
             [(f"process_resident_memory_bytes{{{SEL}}}", "{{instance}}")], span=8))
         .with_panel(timeseries(
             "Virtual memory", "Virtual memory size (CUDA processes map large ranges).", "bytes",
             [(f"process_virtual_memory_bytes{{{SEL}}}", "{{instance}}")], span=8))
         .with_panel(timeseries(
             "Open file descriptors", "Open / maximum file descriptors.", "percentunit",
             [(f"process_open_fds{{{SEL}}} / process_max_fds{{{SEL}}}", "{{instance}}")],
             span=8, max_value=1)))
    # NVIDIA's DCGM exporter, where it runs and maps GPUs to pods: the GPUs of this release's
    # worker pods (their names start with the job's), empty elsewhere.
    gpu_pods = 'namespace=~"$namespace", pod=~"($job)-.*"'
    d = d.with_row(dashboard_builders.Row("GPUs (DCGM exporter)"))
    d = (d.with_panel(timeseries(
        "GPU utilization", "DCGM_FI_DEV_GPU_UTIL of the GPUs the workers' pods hold (percent of "
        "time a kernel ran); empty without NVIDIA's DCGM exporter.", "percent",
        [(f"DCGM_FI_DEV_GPU_UTIL{{{gpu_pods}}}", "{{pod}} gpu {{gpu}}")], span=12,
        max_value=100))
         .with_panel(timeseries(
             "GPU memory used", "DCGM_FI_DEV_FB_USED / (used + free) of the same GPUs.",
             "percentunit",
             [(f"DCGM_FI_DEV_FB_USED{{{gpu_pods}}} / (DCGM_FI_DEV_FB_USED{{{gpu_pods}}} + "
               f"DCGM_FI_DEV_FB_FREE{{{gpu_pods}}})", "{{pod}} gpu {{gpu}}")], span=12,
             max_value=1)))
    return d


DASHBOARDS: dict[str, Callable[[], dashboard_builders.Dashboard]] = {
    "dsa-router.json": router,
    "dsa-indexer.json": indexer,
    "dsa-attention.json": attention,
    "dsa-processes.json": processes,
}


def number_panels(model: dict) -> dict:
    """Gives every panel (rows included) an id 1, 2, ... in order, as Grafana expects."""
    for i, panel in enumerate(model.get("panels", []), start=1):
        panel["id"] = i
    return model


def render(build: Callable[[], dashboard_builders.Dashboard]) -> str:
    model = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    return json.dumps(number_panels(model), indent=2, sort_keys=True) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", action="append", type=pathlib.Path,
                        help="output folder (repeatable); default: "
                        + ", ".join(str(p.relative_to(REPO)) for p in DEFAULT_OUTS))
    args = parser.parse_args()
    for out in args.out or DEFAULT_OUTS:
        out.mkdir(parents=True, exist_ok=True)
        for name, build in DASHBOARDS.items():
            (out / name).write_text(render(build))


if __name__ == "__main__":
    main()
