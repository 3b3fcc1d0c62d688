"""Watching a run: metric sinks, sample trajectories, the cost/token monitor, alarms, reports.

`Monitor` (actloop.monitor.monitor) is what the trainer calls; `actloop.monitor.report` turns a
run directory into PNG plots and one self-contained HTML page (`actloop report RUN_DIR`)."""
