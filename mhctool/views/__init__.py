"""Figures and pages drawn from reports (never from a run's live state): plots and the
self-contained HTML report."""
