"""MLflow tracking: runs with params/tags/metrics/artifacts (``TrackedRun``), the Hydra
callback that turns a sweep into one parent run (``callback``), and ``pdflow compare``.
MLflow itself is imported only when a run is opened."""
